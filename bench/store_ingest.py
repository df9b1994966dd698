"""Benchmark: collector-store ingest, acknowledged and durable, on this machine.

Runs ``agl store serve`` as its own process and sends spans of realistic size (20 attributes, ~1 KB each)
in batches, from several concurrent senders:

* ``raw-http``  pre-encoded OTLP/HTTP protobuf batches (the receiver's own ceiling)
* ``sdk-http``  the OpenTelemetry SDK's OTLP/HTTP exporter
* ``sdk-grpc``  the OpenTelemetry SDK's OTLP/gRPC exporter
* ``raw-http`` against PostgreSQL (``--postgres``)

Every span counted was acknowledged only after its transaction committed (SQLite WAL, synchronous=NORMAL).
Then it fills the store to ``--fill`` spans (default 1M) while sampling the server's memory, and times
reading one rollout's spans back through the API.

Reference (DESIGN.md, same machine kind): Agent Lightning 0.3.0 ingests about 7,800 spans/s over OTLP,
in memory, not durable. Target: at least 5x that, durable, on SQLite.

    python bench/store_ingest.py [--seconds 8] [--senders 4] [--batch 512] [--fill 1000000] [--postgres DSN]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

REFERENCE_SPANS_PER_S = 7_800
TARGET_SPANS_PER_S = 5 * REFERENCE_SPANS_PER_S
READ_TARGET_MS = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _attributes(rng: random.Random, rollout: str) -> dict[str, object]:
    attrs: dict[str, object] = {
        "agl.rollout.id": rollout,
        "agl.attempt.id": rollout + "-a1",
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "policy",
    }
    for i in range(16):
        attrs[f"app.field_{i:02d}"] = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(48))
    return attrs  # 20 attributes, ~1 KB encoded


def make_batch(sender: int, batch_no: int, size: int, rng: random.Random) -> bytes:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = f"sender-{sender}"
    scope = rs.scope_spans.add()
    now = time.time_ns()
    for i in range(size):
        n = batch_no * size + i
        rollout = f"ro-{sender}-{n // 20}"
        span = scope.spans.add(
            trace_id=sender.to_bytes(4, "big") + (n // 20 + 1).to_bytes(12, "big"),
            span_id=(sender << 40 | n + 1).to_bytes(8, "big"),
            name="chat policy",
            start_time_unix_nano=now,
            end_time_unix_nano=now + 1000,
        )
        for key, value in _attributes(rng, rollout).items():
            span.attributes.add(key=key).value.string_value = str(value)
    return request.SerializeToString()


class Server:
    def __init__(self, db: str) -> None:
        self.port, self.grpc_port = _free_port(), _free_port()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agl_core.cli",
                "store",
                "serve",
                "--db",
                db,
                "--http-port",
                str(self.port),
                "--grpc-port",
                str(self.grpc_port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("store did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def run_senders(n: int, seconds: float, send_one) -> tuple[int, float]:
    """Run ``n`` sender threads for ``seconds``; each call of ``send_one(k, i)`` returns spans acked."""
    total = [0] * n
    stop = threading.Event()

    def loop(k: int) -> None:
        i = 0
        while not stop.is_set():
            total[k] += send_one(k, i)
            i += 1

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(total), time.perf_counter() - start


def raw_http(server: Server, senders: int, batch: int, seconds: float, offset: int = 0) -> float:
    """Pre-encoded protobuf batches with distinct span ids, posted back to back by each sender."""
    rng = random.Random(1)
    per_sender = int(seconds * 80_000 / batch / senders) + 8  # more than can be sent in time
    bodies = [[make_batch(offset + k, i, batch, rng) for i in range(per_sender)] for k in range(senders)]
    clients = [httpx.Client(timeout=60) for _ in range(senders)]

    def send(k: int, i: int) -> int:
        if i >= per_sender:
            time.sleep(0.01)
            return 0
        r = clients[k].post(
            server.url + "/v1/traces",
            content=bodies[k][i],
            headers={"content-type": "application/x-protobuf"},
        )
        return batch if r.status_code == 200 else 0

    spans, elapsed = run_senders(senders, seconds, send)
    for c in clients:
        c.close()
    return spans / elapsed


def sdk(server: Server, protocol: str, senders: int, batch: int, seconds: float) -> float:
    """The real OTel SDK exporters, exporting pre-built finished spans (span creation is not timed)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Exporter

        exporters = [
            Exporter(endpoint=f"127.0.0.1:{server.grpc_port}", insecure=True) for _ in range(senders)
        ]
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Exporter

        exporters = [Exporter(endpoint=server.url + "/v1/traces") for _ in range(senders)]

    class Collect(SpanExporter):
        def __init__(self) -> None:
            self.spans: list = []

        def export(self, spans):  # noqa: D401
            self.spans.extend(spans)
            return SpanExportResult.SUCCESS

    rng = random.Random(2)
    batches: list[list[list]] = []
    expected = int(seconds * 40_000 / batch / senders) + 4
    for k in range(senders):
        collect = Collect()
        provider = TracerProvider()
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        provider.add_span_processor(SimpleSpanProcessor(collect))
        tracer = provider.get_tracer("bench")
        for n in range(expected * batch):
            with tracer.start_as_current_span(
                "chat policy", attributes=_attributes(rng, f"ro-sdk-{protocol}-{k}-{n // 20}")
            ):
                pass
        batches.append([collect.spans[i : i + batch] for i in range(0, len(collect.spans), batch)])

    def send(k: int, i: int) -> int:
        if i >= len(batches[k]):
            time.sleep(0.01)
            return 0
        return batch if exporters[k].export(batches[k][i]) == SpanExportResult.SUCCESS else 0

    spans, elapsed = run_senders(senders, seconds, send)
    return spans / elapsed


def fill_and_read(server: Server, total: int, batch: int) -> tuple[list[float], float, int]:
    """Ingest until the store holds ``total`` spans; sample the server's RSS at each 10%; then time
    reading single rollouts (20 spans each) through the API."""
    rng = random.Random(3)
    template = [make_batch(90 + k, i, batch, rng) for k in range(2) for i in range(2)]
    stats = httpx.get(server.url + "/api/stats").json()
    have = stats["spans"]
    filled = 0
    rss = []
    step = max(total // 10, batch)
    next_mark = have
    k = 0
    with httpx.Client(timeout=120) as http:
        while have < total or filled < 10 * batch:
            # vary ids cheaply: re-encode only the span ids of a template batch
            request = ExportTraceServiceRequest.FromString(template[k % len(template)])
            for j, span in enumerate(request.resource_spans[0].scope_spans[0].spans):
                n = filled + j
                span.trace_id = (200).to_bytes(4, "big") + (n // 20 + 1).to_bytes(12, "big")
                span.span_id = (n + 1 + (1 << 50)).to_bytes(8, "big")
                span.attributes[0].value.string_value = f"ro-fill-{n // 20}"
            r = http.post(
                server.url + "/v1/traces",
                content=request.SerializeToString(),
                headers={"content-type": "application/x-protobuf"},
            )
            if r.status_code == 200:
                have += batch
                filled += batch
            if have >= next_mark:
                rss.append(_rss_mib(server.proc.pid))
                next_mark += step
            k += 1
        from agl_core.store import StoreClient

        client = StoreClient(server.url)
        times = []
        for _ in range(50):
            rollout = f"ro-fill-{rng.randrange(filled // 20)}"
            t0 = time.perf_counter()
            spans = client.query_spans(rollout_ids=[rollout])
            times.append((time.perf_counter() - t0) * 1000)
            assert len(spans) == 20, (rollout, len(spans))
    return rss, statistics.median(times), have


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--fill", type=int, default=1_000_000)
    parser.add_argument(
        "--postgres",
        default=os.environ.get("AGL_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test"),
    )
    parser.add_argument("--skip-sdk", action="store_true")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(str(Path(tmp) / "bench.sqlite"))
        try:
            raw = raw_http(server, args.senders, args.batch, args.seconds)
            rows.append(("raw-http", "sqlite", raw))
            if not args.skip_sdk:
                rows.append(
                    ("sdk-http", "sqlite", sdk(server, "http", args.senders, args.batch, args.seconds))
                )
                rows.append(
                    ("sdk-grpc", "sqlite", sdk(server, "grpc", args.senders, args.batch, args.seconds))
                )
            rss, read_ms, stored = fill_and_read(server, args.fill, args.batch)
        finally:
            server.stop()
        if args.postgres:
            import psycopg

            schema = f"agl_bench_{os.getpid()}"
            dsn = args.postgres + ("&" if "?" in args.postgres else "?") + f"options=-csearch_path%3D{schema}"
            with psycopg.connect(args.postgres, autocommit=True) as conn:
                conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            pg = Server(dsn)
            try:
                rows.append(
                    (
                        "raw-http",
                        "postgresql",
                        raw_http(pg, args.senders, args.batch, args.seconds, offset=50),
                    )
                )
            finally:
                pg.stop()
                with psycopg.connect(args.postgres, autocommit=True) as conn:
                    conn.execute(f'DROP SCHEMA "{schema}" CASCADE')

    print(f"{'path':<10} {'backend':<11} {'spans/s':>9} {'vs reference':>13}")
    for path, backend, rate in rows:
        print(f"{path:<10} {backend:<11} {rate:>9.0f} {rate / REFERENCE_SPANS_PER_S:>12.1f}x")
    print(
        f"server RSS while filling to {stored:,} spans (MiB, each 10%): {', '.join(f'{m:.0f}' for m in rss)}"
    )
    print(
        f"read one rollout (20 spans) via the API at {stored:,} stored: median {read_ms:.2f} ms"
        f" (target < {READ_TARGET_MS} ms)"
    )
    headline = rows[0][2]
    flat = rss[-1] - rss[len(rss) // 2] < 64 if len(rss) >= 2 else True
    ok = headline >= TARGET_SPANS_PER_S and read_ms < READ_TARGET_MS and flat
    print(
        f"ingest: {headline:.0f} spans/s durable (raw-http, sqlite), target >= {TARGET_SPANS_PER_S}: "
        f"{'ok' if ok else 'missed'}"
        + ("" if flat else " (memory grew)")
        + ("" if read_ms < READ_TARGET_MS else " (read slow)")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
