"""Benchmark: collector-store ingest, acknowledged and durable, on this machine.

Runs ``agl store serve`` as its own process and sends spans of realistic size (20 attributes, ~1.3 KB each)
in batches, from several concurrent senders:

* ``raw-http``  pre-encoded OTLP/HTTP protobuf batches (the receiver's own ceiling)
* ``sdk-http``  the OpenTelemetry SDK's OTLP/HTTP exporter
* ``sdk-grpc``  the OpenTelemetry SDK's OTLP/gRPC exporter
* ``raw-http`` against PostgreSQL (``--postgres``)

Every span counted was acknowledged only after its transaction committed (SQLite WAL, synchronous=NORMAL).
Then it fills the store to ``--fill`` spans (default 1M) while sampling the server's memory, and times
reading one rollout's spans back through the API.

``--peer`` measures agl beside Microsoft Agent Lightning 0.3.0's store server in the same run (its
environment: ``bash bench/setup_agl_env.sh``, found at ``.venv-agl`` or given with ``--peer-python``):
the same pre-encoded batches (``--batch`` spans, 20 spans per rollout, each span carrying the rollout and
attempt ids under each store's own attribute keys) from ``--senders`` senders, in rounds that alternate
between the two stores; each round sends ``--batches`` batches per sender (``--peer-batches`` to the
peer, which is slower) and its rate is spans acknowledged over the round's wall time. The senders use the
standard library's ``http.client`` with keep-alive (``--client httpx`` for httpx), the lighter load
generator: each request costs the sender about 0.4 ms of CPU against httpx's 0.9, on the two cores the
stores need; both stores get the same senders, and the line above the table gives their CPU per request.
Agent Lightning keeps spans in memory (not durable) and accepts a span only for a rollout and attempt it
issued, so the bench first starts ``--peer-rollouts`` rollouts per sender through its API and the batches
cycle through them. Medians of ``--rounds`` rounds; the last line is the ratio against the 10x target.

``--breakdown`` times one batch's stages in this process (decode, redaction, row building, SQL insert,
commit) and the rest of a request through a running ``agl store serve`` once its parse workers are up
(HTTP, the hand-off to a parse worker, which decodes and writes, and its answer back, the response), in
microseconds per span, beside the physical limit: protobuf's
``ParseFromString`` of the same batch plus the store's insert statements, with equally sized rows, into a
bare SQLite table with the same indexes (WAL, synchronous=NORMAL, no checkpointer) and its commit.

    python bench/store_ingest.py [--seconds 8] [--senders 4] [--batch 512] [--fill 1000000] [--postgres DSN]
    python bench/store_ingest.py --peer [--rounds 5] [--senders 2] [--batches 12] [--peer-batches 3]
                                        [--client http.client|httpx]
    python bench/store_ingest.py --breakdown [--repeats 20]
"""

from __future__ import annotations

import argparse
import http.client
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from agl_core import semconv

REFERENCE_SPANS_PER_S = 7_800
TARGET_SPANS_PER_S = 5 * REFERENCE_SPANS_PER_S
READ_TARGET_MS = 10.0
#: --peer: agl's durable ingest over Agent Lightning 0.3.0's in-memory one, measured in the same run.
PEER_TARGET_RATIO = 10.0
PEER_ROLLOUT_KEY, PEER_ATTEMPT_KEY = "agentlightning.rollout_id", "agentlightning.attempt_id"
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(
    url: str, seconds: float, interval: float, failure: str, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Poll ``url`` until it answers 200; ``RuntimeError(failure)`` after ``seconds`` or once ``proc``
    has exited."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(interval)


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
    def __init__(self, db: str, *args: str) -> None:
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
                *args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        _wait_until_up(self.url + "/healthz", 30, 0.05, "store did not start")

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


class Batches:
    """Pre-encoded export requests of ``size`` spans shaped like :func:`make_batch`'s, made fast: one
    template request is built once and each batch rewrites only its ids (trace, span, rollout, attempt).

    ``ids(sender, rollout_no)`` gives the (rollout id, attempt id) a span carries, under ``keys``."""

    def __init__(
        self,
        size: int,
        keys: tuple[str, str],
        ids: Callable[[int, int], tuple[str, str]],
        seed: int = 4,
    ) -> None:
        rng = random.Random(seed)
        request = ExportTraceServiceRequest()
        rs = request.resource_spans.add()
        rs.resource.attributes.add(key="service.name").value.string_value = "sender"
        scope = rs.scope_spans.add()
        now = time.time_ns()
        for _ in range(size):
            span = scope.spans.add(
                trace_id=bytes(16), span_id=bytes(8), name="chat policy", start_time_unix_nano=now
            )
            span.end_time_unix_nano = now + 1000
            attrs = _attributes(rng, "-")
            attrs.pop(semconv.ROLLOUT_ID)
            attrs.pop(semconv.ATTEMPT_ID)
            span.attributes.add(key=keys[0]).value.string_value = "-"
            span.attributes.add(key=keys[1]).value.string_value = "-"
            for key, value in attrs.items():
                span.attributes.add(key=key).value.string_value = str(value)
        self.template = request.SerializeToString()
        self.size = size
        self.ids = ids

    def make(self, sender: int, batch_no: int) -> bytes:
        request = ExportTraceServiceRequest.FromString(self.template)
        request.resource_spans[0].resource.attributes[0].value.string_value = f"sender-{sender}"
        for j, span in enumerate(request.resource_spans[0].scope_spans[0].spans):
            n = batch_no * self.size + j
            span.trace_id = sender.to_bytes(4, "big") + (n // 20 + 1).to_bytes(12, "big")
            span.span_id = (sender << 40 | n + 1).to_bytes(8, "big")
            rollout, attempt = self.ids(sender, n // 20)
            span.attributes[0].value.string_value = rollout
            span.attributes[1].value.string_value = attempt
        return request.SerializeToString()


class PeerServer:
    """Microsoft Agent Lightning 0.3.0's store server (``agentlightning.cli.store``, in-memory backend)
    run by the interpreter of its own environment."""

    def __init__(self, python: str) -> None:
        self.port = _free_port()
        env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True")  # no network fetch at import
        self.proc = subprocess.Popen(
            [python, "-m", "agentlightning.cli.store", "--host", "127.0.0.1", "--port", str(self.port)]
            + ["--log-level", "ERROR"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        _wait_until_up(  # importing agentlightning takes seconds
            self.url + "/v1/agl/health",
            120,
            0.1,
            f"Agent Lightning's store did not start ({python})",
            self.proc,
        )

    def start_rollouts(self, n: int) -> list[tuple[str, str]]:
        """``n`` rollouts started through its API, each with its first attempt: (rollout id, attempt id)."""
        out = []
        with httpx.Client(timeout=30) as http:
            for i in range(n):
                r = http.post(self.url + "/v1/agl/rollouts", json={"input": {"task": i}})
                r.raise_for_status()
                body = r.json()
                out.append((body["rollout_id"], body["attempt"]["attempt_id"]))
        return out

    def stored(self, rollouts: list[tuple[str, str]]) -> int:
        with httpx.Client(timeout=30) as http:
            return sum(
                http.get(self.url + "/v1/agl/spans", params={"rollout_id": r, "limit": 1}).json()["total"]
                for r, _ in rollouts
            )

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def send_round(
    url: str,
    bodies: list[list[bytes]],
    batch: int,
    client: str = "http.client",
    content_type: str = "application/x-protobuf",
) -> tuple[float, int, float]:
    """Post ``bodies[k]`` back to back from sender ``k`` (one thread and keep-alive connection each);
    returns (spans acknowledged per second of the round's wall time, responses other than 200, the
    senders' CPU ms per request). ``client``: ``http.client`` (the standard library's, the lightest
    load generator at hand) or ``httpx``."""
    parts = urllib.parse.urlsplit(url)
    acked = [0] * len(bodies)
    failed = [0] * len(bodies)
    cpu = [0.0] * len(bodies)
    headers = {"content-type": content_type}
    ready = threading.Barrier(len(bodies) + 1, timeout=60)

    def loop(k: int) -> None:
        post: Callable[[bytes], int]
        if client == "httpx":
            session = httpx.Client(timeout=120)
            session.get(url + "/")  # connect before the clock starts

            def post(body: bytes) -> int:
                return session.post(url + "/v1/traces", content=body, headers=headers).status_code

            close = session.close
        else:
            conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=120)
            conn.connect()

            def post(body: bytes) -> int:
                conn.request("POST", "/v1/traces", body=body, headers=headers)
                response = conn.getresponse()
                response.read()
                return response.status

            close = conn.close
        ready.wait()
        start = time.thread_time()
        for body in bodies[k]:
            if post(body) == 200:
                acked[k] += batch
            else:
                failed[k] += 1
        cpu[k] = time.thread_time() - start
        close()

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(len(bodies))]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    requests = sum(len(b) for b in bodies)
    return sum(acked) / elapsed, sum(failed), 1000 * sum(cpu) / max(requests, 1)


def _peer_python(given: str | None) -> str | None:
    if given:
        return given
    default = ROOT / ".venv-agl" / "bin" / "python"
    return str(default) if default.exists() else None


def compare(args: argparse.Namespace) -> int:
    """agl against Agent Lightning 0.3.0, rounds alternating between them; see the module docstring."""
    senders, size = args.senders, args.batch
    peer_python = _peer_python(args.peer_python)
    agl_batches = Batches(
        size, (semconv.ROLLOUT_ID, semconv.ATTEMPT_ID), lambda k, r: (f"ro-{k}-{r}", f"ro-{k}-{r}-a1")
    )
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(str(Path(tmp) / "bench.sqlite"))
        peer = None
        # Agent Lightning accepts spans only for rollouts and attempts it started: one per 20 spans,
        # started before each round (not timed), so every rollout holds 20 spans as on agl's side.
        peer_ids: dict[tuple[int, int], tuple[str, str]] = {}
        if peer_python is None:
            print(
                "peer: no Agent Lightning environment at .venv-agl (bash bench/setup_agl_env.sh, or"
                " --peer-python PATH); measuring agl alone"
            )
        else:
            peer = PeerServer(peer_python)
        try:
            peer_batches = (
                Batches(size, (PEER_ROLLOUT_KEY, PEER_ATTEMPT_KEY), lambda k, r: peer_ids[k, r])
                if peer is not None
                else None
            )
            rates: dict[str, list[float]] = {"agl": [], "peer": []}
            failures = {"agl": 0, "peer": 0}
            sent = {"agl": 0, "peer": 0}
            sender_ms: dict[str, list[float]] = {"agl": [], "peer": []}
            for rnd in range(args.rounds + 1):  # round 0 warms both up and is not counted
                sides = ["agl", "peer"] if rnd % 2 == 0 else ["peer", "agl"]
                for side in sides:
                    maker = agl_batches if side == "agl" else peer_batches
                    if maker is None:
                        continue
                    n = max(1, args.batches if side == "agl" else (args.peer_batches or args.batches))
                    if rnd == 0:
                        n = 1
                    first = 1000 * rnd
                    if side == "peer":
                        assert peer is not None
                        for k in range(senders):
                            wanted = range(first * size // 20, ((first + n) * size + 19) // 20)
                            started = peer.start_rollouts(len(wanted))
                            sender = rnd * senders + k + 1
                            peer_ids.update(
                                ((sender, r), ids) for r, ids in zip(wanted, started, strict=True)
                            )
                    bodies = [
                        [maker.make(rnd * senders + k + 1, first + i) for i in range(n)]
                        for k in range(senders)
                    ]
                    url = server.url if side == "agl" else peer.url  # type: ignore[union-attr]
                    rate, failed, cpu_ms = send_round(url, bodies, size, args.client)
                    sent[side] += senders * n * size
                    if rnd:
                        rates[side].append(rate)
                        failures[side] += failed
                        sender_ms[side].append(cpu_ms)
            agl_stored = httpx.get(server.url + "/api/stats").json()["spans"]
            peer_stored = peer.stored(list(peer_ids.values())) if peer is not None else 0
        finally:
            server.stop()
            if peer is not None:
                peer.stop()

    agl_rate = statistics.median(rates["agl"])
    print(
        f"{args.rounds} rounds alternating, {senders} senders ({args.client}), {size}-span batches"
        f" (~{len(agl_batches.template) // size} B/span); senders' CPU per request: agl"
        f" {statistics.median(sender_ms['agl']):.2f} ms"
        + (f", peer {statistics.median(sender_ms['peer']):.2f} ms" if sender_ms["peer"] else "")
    )
    print(f"{'store':<34} {'median spans/s':>14} {'min':>8} {'max':>8}  stored/sent")
    print(
        f"{'agl (SQLite, durable)':<34} {agl_rate:>14.0f} {min(rates['agl']):>8.0f} {max(rates['agl']):>8.0f}"
        f"  {agl_stored}/{sent['agl']}"
    )
    if not rates["peer"]:
        print(
            f"store ingest: agl {agl_rate:.0f} spans/s; Agent Lightning 0.3.0 not measured (no .venv-agl):"
            f" target {PEER_TARGET_RATIO:.0f}x not checked"
        )
        return 1
    peer_rate = statistics.median(rates["peer"])
    print(
        f"{'Agent Lightning 0.3.0 (in memory)':<34} {peer_rate:>14.0f} {min(rates['peer']):>8.0f}"
        f" {max(rates['peer']):>8.0f}  {peer_stored}/{sent['peer']}"
    )
    if failures["agl"] or failures["peer"]:
        print(f"responses other than 200: agl {failures['agl']}, Agent Lightning {failures['peer']}")
    ratio = agl_rate / peer_rate
    ok = ratio >= PEER_TARGET_RATIO and agl_stored == sent["agl"]
    verdict = "ok" if ok else f"MISSED by {PEER_TARGET_RATIO / ratio:.2f}x"
    print(
        f"store ingest: agl {agl_rate:.0f} spans/s durable vs Agent Lightning 0.3.0 {peer_rate:.0f}"
        f" in memory, ratio {ratio:.1f}x, target >= {PEER_TARGET_RATIO:.0f}x: {verdict}"
    )
    return 0 if ok else 1


def _mean_us(times: list[float], spans: int) -> float:
    """Microseconds per span, the mean over batches (a checkpoint now and then is part of the cost)."""
    return statistics.fmean(times) * 1e6 / spans


def breakdown(args: argparse.Namespace) -> int:
    """Where one batch's time goes, in microseconds per span; see the module docstring."""
    import sqlite3

    from agl_core.store._schema import schema
    from agl_core.store.formats.otlp import decode_protobuf, extract_rows
    from agl_core.store.redact import parse_rules
    from agl_core.store.sqlite import PAGE_SIZE, SqliteStore

    size = args.batch
    maker = Batches(
        size, (semconv.ROLLOUT_ID, semconv.ATTEMPT_ID), lambda k, r: (f"ro-{k}-{r}", f"ro-{k}-{r}-a1")
    )
    bodies = [maker.make(k + 1, i) for k in range(2) for i in range(args.repeats)]
    redactor = parse_rules(["email", "api-key"])
    stage: dict[str, list[float]] = {k: [] for k in ("decode", "rows", "redact", "insert", "commit", "limit")}
    with tempfile.TemporaryDirectory() as tmp:
        store = SqliteStore(Path(tmp) / "stages.sqlite")
        bare = sqlite3.connect(Path(tmp) / "bare.sqlite", isolation_level=None)
        bare.execute(f"PRAGMA page_size={PAGE_SIZE}")  # as the store's own files
        bare.execute("PRAGMA journal_mode=WAL")
        bare.execute("PRAGMA synchronous=NORMAL")
        bare.executescript(
            schema(serial="INTEGER PRIMARY KEY AUTOINCREMENT", blob="BLOB", real="REAL", bigint="INTEGER")
        )
        for body in bodies:
            t0 = time.perf_counter()
            request = decode_protobuf(body)
            t1 = time.perf_counter()
            parsed = extract_rows(request, raw=body)  # as the ingest pipeline calls it
            t2 = time.perf_counter()
            extract_rows(decode_protobuf(body), redactor)
            t3 = time.perf_counter()
            stage["decode"].append(t1 - t0)
            stage["rows"].append(t2 - t1)
            stage["redact"].append(t3 - t2 - (t2 - t0))  # with the rules, less decode and rows without
            with store._write() as conn:
                t4 = time.perf_counter()
                store._insert_spans(conn, parsed.rows)
                t5 = time.perf_counter()
            t6 = time.perf_counter()
            stage["insert"].append(t5 - t4)
            stage["commit"].append(t6 - t5)
            # the physical limit: protobuf's own parse, a bare insert of rows of the same sizes, commit
            rows = [(*row[:10], bytes(len(row[10]))) for row in parsed.rows]
            t7 = time.perf_counter()
            ExportTraceServiceRequest.FromString(body)
            bare.execute("BEGIN")
            store._insert_spans(bare, rows)  # the store's own statements, on the bare connection
            bare.execute("COMMIT")
            stage["limit"].append(time.perf_counter() - t7)
        store.close()
        bare.close()
        # the whole request through a running store, one sender: the rest is HTTP and hand-offs
        server = Server(str(Path(tmp) / "served.sqlite"))
        try:
            served = [maker.make(100 + k, i) for k in range(2) for i in range(args.repeats)]
            whole = []
            with httpx.Client(timeout=60) as http:
                http.get(server.url + "/healthz")
                # not timed: the first exports start the parse workers and open the file in each
                for i in range(4):
                    http.post(
                        server.url + "/v1/traces",
                        content=maker.make(99, 10_000 + i),
                        headers={"content-type": "application/x-protobuf"},
                    ).raise_for_status()
                for body in served:
                    t0 = time.perf_counter()
                    r = http.post(
                        server.url + "/v1/traces",
                        content=body,
                        headers={"content-type": "application/x-protobuf"},
                    )
                    whole.append(time.perf_counter() - t0)
                    assert r.status_code == 200, r.status_code
        finally:
            server.stop()
    us = {k: _mean_us(v, size) for k, v in stage.items()}
    total = _mean_us(whole, size)
    inside = us["decode"] + us["rows"] + us["insert"] + us["commit"]
    print(f"one {size}-span batch ({len(bodies[0]) // size} B/span), means of {len(bodies)}; us per span")
    print(f"{'decode (ParseFromString)':<44} {us['decode']:>7.2f}")
    print(f"{'row building (validate, ids, span bytes)':<44} {us['rows']:>7.2f}")
    print(f"{'redaction (email + api-key; off by default)':<44} {us['redact']:>7.2f}")
    print(f"{'SQL insert (multi-row statements)':<44} {us['insert']:>7.2f}")
    print(f"{'commit':<44} {us['commit']:>7.2f}")
    print(f"{'HTTP, hand-offs, response (the rest)':<44} {max(total - inside, 0.0):>7.2f}")
    print(f"{'whole request, one sender':<44} {total:>7.2f}   ({1e6 / total:,.0f} spans/s)")
    print(
        f"{'physical limit: parse + bare insert + commit':<44} {us['limit']:>7.2f}"
        f"   ({1e6 / us['limit']:,.0f} spans/s)"
    )
    print(
        f"breakdown: agl spends {inside:.2f} us/span decoding, building rows and writing, {total:.2f} per"
        f" request; the physical limit is {us['limit']:.2f} ({inside / us['limit']:.2f}x and"
        f" {total / us['limit']:.2f}x of it)"
    )
    return 0


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
    parser.add_argument("--peer", action="store_true", help="agl beside Agent Lightning 0.3.0, same run")
    parser.add_argument("--peer-python", help="Agent Lightning's interpreter (default: .venv-agl/bin/python)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=12, help="--peer: batches per sender per agl round")
    parser.add_argument("--peer-batches", type=int, help="--peer: per sender per peer round (--batches)")
    parser.add_argument(
        "--client",
        choices=("http.client", "httpx"),
        default="http.client",
        help="--peer: the senders' HTTP client (both stores get the same)",
    )
    parser.add_argument("--breakdown", action="store_true", help="where one batch's time goes")
    parser.add_argument("--repeats", type=int, default=20, help="--breakdown: batches timed")
    args = parser.parse_args()
    if args.breakdown:
        return breakdown(args)
    if args.peer:
        if "--senders" not in sys.argv:
            args.senders = 2
        return compare(args)

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
