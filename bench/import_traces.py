"""Benchmark: ``agl import`` of trace files against the store's own durable OTLP/HTTP ingest, same run.

Writes a synthetic trace file twice, as the Collector's ``file`` exporter writes it: OTLP JSON lines and
length-prefixed protobuf (``--spans`` spans in traces of 20, ``--per-record`` spans per line / record,
each span ~1 KB: 16 text attributes, the GenAI operation and model, and an OpenInference ``session.id``
shared by five traces, so the import groups by session). Each file is imported into a fresh SQLite
store; beside it, ``agl store serve`` (bench/store_ingest.py's server) is fed the same records over
OTLP/HTTP by concurrent senders (keep-alive ``http.client`` connections), protobuf and JSON, each record
once. Every figure counts spans
committed to SQLite.

    python bench/import_traces.py [--spans 200000] [--per-record 1000] [--senders 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_ingest import Server, send_round  # noqa: E402

from agl_core.importer import import_traces  # noqa: E402


def make_request(first: int, count: int, rng: random.Random) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = "bench-agent"
    scope = rs.scope_spans.add()
    scope.scope.name = "openinference.instrumentation.bench"
    now = time.time_ns()
    for n in range(first, first + count):
        trace = n // 20
        span = scope.spans.add(
            trace_id=(trace + 1).to_bytes(16, "big"),
            span_id=(n + 1).to_bytes(8, "big"),
            parent_span_id=b"" if n % 20 == 0 else (trace * 20 + 1).to_bytes(8, "big"),
            name="chat policy",
            kind=3,
            start_time_unix_nano=now,
            end_time_unix_nano=now + 1000,
        )
        values = {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": "policy",
            "session.id": f"session-{trace // 5}",
        }
        for i in range(16):
            values[f"app.field_{i:02d}"] = "".join(
                rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(48)
            )
        for key, value in values.items():
            span.attributes.add(key=key).value.string_value = value
    return request


def json_line(request: ExportTraceServiceRequest) -> bytes:
    """OTLP/JSON as the Collector writes it: hex ids, numeric enums."""
    data = json_format.MessageToDict(request, use_integers_for_enums=True)
    for rs in data["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(data, separators=(",", ":")).encode() + b"\n"


def write_files(directory: Path, spans: int, per_record: int) -> tuple[Path, Path, list[bytes], list[bytes]]:
    rng = random.Random(7)
    json_path, proto_path = directory / "traces.jsonl", directory / "traces.pb"
    json_lines: list[bytes] = []
    proto_bodies: list[bytes] = []
    with open(json_path, "wb") as jf, open(proto_path, "wb") as pf:
        for first in range(0, spans, per_record):
            request = make_request(first, min(per_record, spans - first), rng)
            body = request.SerializeToString()
            line = json_line(request)
            pf.write(len(body).to_bytes(4, "big") + body)
            jf.write(line)
            proto_bodies.append(body)
            json_lines.append(line)
    return json_path, proto_path, json_lines, proto_bodies


def http_ingest(server: Server, bodies: list[bytes], per_body: int, content_type: str, senders: int) -> float:
    """Spans/s acknowledged (committed) while ``senders`` threads post every body once, back to back, each
    on a keep-alive ``http.client`` connection (bench/store_ingest.py's senders)."""
    rate, _, _ = send_round(
        server.url, [bodies[k::senders] for k in range(senders)], per_body, content_type=content_type
    )
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--spans", type=int, default=200_000)
    parser.add_argument("--per-record", type=int, default=1_000)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="medians over this many runs of each side")
    args = parser.parse_args()
    if args.repeats < 1 or args.spans < 1 or args.per_record < 1 or args.senders < 1:
        parser.error("--spans, --per-record, --senders and --repeats must be at least 1")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        json_path, proto_path, json_lines, proto_bodies = write_files(directory, args.spans, args.per_record)
        sizes = {"otlp-json": json_path.stat().st_size, "otlp-proto": proto_path.stat().st_size}
        os.sync()  # the files just written are not flushed to disk under the first measurement
        imported: dict[str, list[float]] = {"otlp-proto": [], "otlp-json": []}
        ingest: dict[str, list[float]] = {"otlp-proto": [], "otlp-json": []}
        rollouts = {}
        for repeat in range(args.repeats):  # alternating, so that a busy spell touches both sides
            for fmt, path in (("otlp-proto", proto_path), ("otlp-json", json_path)):
                db = directory / f"import-{fmt}-{repeat}.sqlite"
                start = time.perf_counter()
                summary = import_traces([path], str(db))
                elapsed = time.perf_counter() - start
                assert summary.new_spans == args.spans and not summary.problems, summary
                imported[fmt].append(args.spans / elapsed)
                rollouts[fmt] = summary.rollouts
            for fmt, bodies, ctype in (
                ("otlp-proto", proto_bodies, "application/x-protobuf"),
                ("otlp-json", json_lines, "application/json"),
            ):
                server = Server(str(directory / f"serve-{fmt}-{repeat}.sqlite"))
                try:
                    ingest[fmt].append(http_ingest(server, bodies, args.per_record, ctype, args.senders))
                finally:
                    server.stop()
            for path in directory.glob(f"*-{repeat}.sqlite*"):
                path.unlink()
        for fmt in ("otlp-proto", "otlp-json"):
            rows.append(
                (
                    fmt,
                    sizes[fmt],
                    rollouts[fmt],
                    statistics.median(imported[fmt]),
                    statistics.median(ingest[fmt]),
                )
            )

    print(
        f"{args.spans:,} spans in traces of 20, {args.per_record} per record; SQLite, durable;"
        f" medians of {args.repeats} runs"
    )
    print(
        f"{'format':<11} {'file MB':>8} {'rollouts':>9} {'import spans/s':>15}"
        f" {'HTTP ingest spans/s':>20} {'ratio':>6}"
    )
    for fmt, size, rollouts, rate, reference in rows:
        print(
            f"{fmt:<11} {size / 1e6:>8.0f} {rollouts:>9,} {rate:>15,.0f}"
            f" {reference:>20,.0f} {rate / reference:>5.2f}x"
        )
    worst = min(rate / reference for _, _, _, rate, reference in rows)
    verdict = "ok" if worst >= 1 else "missed"
    print(
        f"import vs the store's own ingest of the same format: worst {worst:.2f}x, target >= 1.0x: {verdict}"
    )
    return 0 if worst >= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
