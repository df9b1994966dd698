"""Collector-store faults with the real OpenTelemetry exporters, over OTLP/HTTP and OTLP/gRPC at once.

Each test runs four senders side by side: the SDK's OTLP/HTTP and OTLP/gRPC exporters (which retry
"retry later" answers themselves), and a raw HTTP and a raw gRPC sender that record every answer. A span
counts as acknowledged when its export returned success; every acknowledged span must be in the database
afterwards. Faults: the store SIGKILLed mid-ingest (SQLite, PostgreSQL), a private PostgreSQL stopped
(immediate) and started again under a running store, and the SQLite disk filling up. While the store
survives, ingest and the coordination API answer only success or the retryable 503 / ``UNAVAILABLE``
(never a 500), and both work again without a restart.

A narrower raw-HTTP SIGKILL test on SQLite is in test_store_ingest.py; a killed parse worker in
test_store_hardening.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import psycopg
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agl_core import semconv
from agl_core.store import SqliteStore, StoreClient
from agl_core.store.postgres import PostgresStore
from agl_core.store.service import StoreService

_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_KINDS = ("sdk-http", "sdk-grpc", "raw-http", "raw-grpc")
_BATCH = 10
_PG_VERSIONS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def make_request(rollout: str, n: int, *, first: int = 1) -> ExportTraceServiceRequest:
    """An OTLP export of ``n`` spans of ``rollout``, span ids ``first`` .. ``first + n - 1`` (unique within
    the rollout, whose name also gives the trace id)."""
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    trace_id = hashlib.sha256(rollout.encode()).digest()[:16]
    for i in range(first, first + n):
        now = time.time_ns()
        span = scope.spans.add(
            trace_id=trace_id, span_id=i.to_bytes(8, "big"), name=f"span-{i}", start_time_unix_nano=now
        )
        span.end_time_unix_nano = now
        span.attributes.add(key=semconv.ROLLOUT_ID).value.string_value = rollout
    return request


class _Cluster:
    """A PostgreSQL cluster of the test's own (the machine's shared server is never restarted), run as
    the ``postgres`` user, which ``initdb`` needs when the tests run as root."""

    def __init__(self) -> None:
        if not _PG_VERSIONS:
            pytest.fail("PostgreSQL's server programs are missing: apt-get install postgresql")
        self.bin = _PG_VERSIONS[-1]
        self.dir = Path(tempfile.mkdtemp(prefix="agl-pg-"))
        shutil.chown(self.dir, "postgres")
        self.data = self.dir / "data"
        self.port = _free_port()
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._pg("initdb", "-D", str(self.data), "--auth=trust", "-U", "postgres")

    def _pg(self, program: str, *args: str) -> None:
        # the server's output goes to its log file: an inherited pipe would stay open after the test
        command = [str(self.bin / program), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, stdin=subprocess.DEVNULL, capture_output=True, timeout=120)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = str(self.dir / "server.log")
        self._pg("pg_ctl", "-D", str(self.data), "-o", options, "-l", log, "-w", "start")

    def stop(self, mode: str) -> None:
        self._pg("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


class _Traffic:
    """One sender thread per kind in :data:`_KINDS`, each on rollout ``{prefix}-{kind}``, sending batches
    of :data:`_BATCH` spans until stopped. ``acked[kind]`` holds the span ids the store acknowledged;
    ``answers`` every HTTP status / gRPC code the raw senders got (``"conn"`` for no answer at all)."""

    def __init__(self, http_url: str, grpc_port: int, prefix: str) -> None:
        self.http_url, self.grpc_port, self.prefix = http_url, grpc_port, prefix
        self.acked: dict[str, set[str]] = {kind: set() for kind in _KINDS}
        self.answers: set[Any] = set()
        self.missing_retry_after = 0
        #: seconds each sender waits after an acknowledged batch
        self.pace = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(kind,)) for kind in _KINDS]

    def rollout(self, kind: str) -> str:
        return f"{self.prefix}-{kind}"

    def total(self) -> int:
        with self._lock:
            return sum(len(ids) for ids in self.acked.values())

    def _ack(self, kind: str, ids: set[str]) -> None:
        with self._lock:
            self.acked[kind] |= ids

    def _run(self, kind: str) -> None:
        if kind.startswith("sdk"):
            self._run_sdk(kind)
        else:
            self._run_raw(kind)

    def _run_sdk(self, kind: str) -> None:
        exporter: Any
        if kind == "sdk-http":
            exporter = HttpExporter(endpoint=self.http_url + "/v1/traces", timeout=3)
        else:
            exporter = GrpcExporter(endpoint=f"127.0.0.1:{self.grpc_port}", insecure=True, timeout=3)
        spans = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": "faults"}))
        provider.add_span_processor(SimpleSpanProcessor(spans))
        tracer = provider.get_tracer("faults")
        try:
            while not self._stop.is_set():
                for i in range(_BATCH):
                    with tracer.start_as_current_span(
                        f"s{i}", attributes={semconv.ROLLOUT_ID: self.rollout(kind)}
                    ):
                        pass
                batch = spans.get_finished_spans()
                spans.clear()
                if exporter.export(batch) is SpanExportResult.SUCCESS:
                    self._ack(kind, {f"{s.context.span_id:016x}" for s in batch})
                    time.sleep(self.pace)
                else:
                    time.sleep(0.05)
        finally:
            exporter.shutdown()
            provider.shutdown()

    def _run_raw(self, kind: str) -> None:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        export: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(_EXPORT)
        b = 0
        try:
            with httpx.Client(timeout=10) as http:
                while not self._stop.is_set():
                    request = make_request(self.rollout(kind), _BATCH, first=1 + b * _BATCH)
                    ids = {s.span_id.hex() for s in request.resource_spans[0].scope_spans[0].spans}
                    answer = self._send(kind, http, export, request.SerializeToString())
                    with self._lock:
                        self.answers.add(answer)
                    if answer in (200, grpc.StatusCode.OK):
                        self._ack(kind, ids)
                        b += 1
                        time.sleep(self.pace)
                    else:  # retry the same batch, as an exporter would
                        time.sleep(0.05)
        finally:
            channel.close()

    def _send(self, kind: str, http: httpx.Client, export: Any, body: bytes) -> Any:
        if kind == "raw-http":
            try:
                response = http.post(
                    self.http_url + "/v1/traces",
                    content=body,
                    headers={"content-type": "application/x-protobuf"},
                )
            except httpx.HTTPError:
                return "conn"
            if response.status_code == 503 and "retry-after" not in response.headers:
                self.missing_retry_after += 1
            return response.status_code
        try:
            export(body, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    def __enter__(self) -> _Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(20)

    def wait_for(self, n: int, timeout_s: float = 30, *, each: bool = False) -> None:
        """Until ``n`` more spans in all (``each``: of every kind) are acknowledged than now."""
        with self._lock:
            start = {kind: len(ids) for kind, ids in self.acked.items()}
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                grown = {kind: len(ids) - start[kind] for kind, ids in self.acked.items()}
            if (min(grown.values()) if each else sum(grown.values())) >= n:
                return
            assert time.monotonic() < deadline, (
                f"acknowledged only {grown} more spans; answers {self.answers}"
            )
            time.sleep(0.02)

    def assert_stored(self, url: str) -> None:
        with StoreClient(url) as client:
            for kind, ids in self.acked.items():
                stored = {s.span_id for s in client.all_spans([self.rollout(kind)])}
                lost = ids - stored
                assert not lost, f"{len(lost)} of {len(ids)} spans acknowledged to {kind} are not stored"


def _assert_api_unavailable(response: httpx.Response) -> None:
    """A coordination-API answer during a fault: the retryable 503 with Retry-After and a message."""
    assert response.status_code == 503, response.text
    assert response.headers.get("retry-after") == "1"
    error = response.json()["error"]
    assert error["type"] == "unavailable" and "retry" in error["message"], error


def _call_every_endpoint(url: str, attempt_id: str) -> dict[str, httpx.Response]:
    """One call to each coordination-API endpoint (``attempt_id``: a running attempt of rollout ro-q0;
    rollout ro-cancel exists)."""
    ids = {"rollout_ids": ["ro-q0"]}
    calls: dict[str, tuple[str, str, Any]] = {
        "enqueue": ("POST", "/api/rollouts", {"rollouts": [{"task_id": "t"}]}),
        "dequeue": ("POST", "/api/rollouts/dequeue", {"worker_id": "w2"}),
        "query": ("POST", "/api/rollouts/query", ids),
        "cancel": ("POST", "/api/rollouts/cancel", {"rollout_ids": ["ro-cancel"]}),
        "consumed": ("POST", "/api/rollouts/consumed", ids),
        "merge": ("POST", "/api/rollouts/merge", {"moves": {"ro-never-stored": "ro-q0"}}),
        "heartbeat": ("POST", f"/api/attempts/{attempt_id}/heartbeat", {}),
        "complete": ("POST", f"/api/attempts/{attempt_id}/complete", {"status": "failed", "error": "x"}),
        "spans": ("POST", "/api/spans/query", ids),
        "put-resource": ("PUT", "/api/resources/model", {"value": {"v": 2}}),
        "get-resource": ("GET", "/api/resources/model", None),
        "stats": ("GET", "/api/stats", None),
    }
    with httpx.Client(base_url=url, timeout=30) as http:
        return {name: http.request(method, path, json=body) for name, (method, path, body) in calls.items()}


@pytest.fixture(scope="module")
def cluster() -> Iterator[_Cluster]:
    pg = _Cluster()
    pg.start()
    try:
        yield pg
    finally:
        pg.remove()


def _database(cluster: _Cluster, name: str) -> str:
    """A fresh database in the private cluster; its DSN."""
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return cluster.dsn.rsplit("/", 1)[0] + "/" + name


def _serve(db: str, http_port: int, grpc_port: int) -> subprocess.Popen[bytes]:
    """``agl store serve`` as a user runs it (one parse worker), once it answers /healthz."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "agl_core.cli", "store", "serve", "--db", db]
        + ["--http-port", str(http_port), "--grpc-port", str(grpc_port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{http_port}/healthz", timeout=1).status_code == 200:
                return proc
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"agl store serve --db {db} did not start (exit code {proc.returncode})")
        time.sleep(0.05)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_store_sigkilled_mid_ingest_keeps_every_acknowledged_span(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    db = str(tmp_path / "kill.sqlite")
    if backend == "postgres":
        db = _database(request.getfixturevalue("cluster"), "sigkill")
    http_port, grpc_port = _free_port(), _free_port()
    url = f"http://127.0.0.1:{http_port}"
    proc = _serve(db, http_port, grpc_port)
    try:
        with _Traffic(url, grpc_port, "ro-kill") as traffic:
            traffic.wait_for(_BATCH * 3, each=True)
            proc.kill()
            proc.wait()
        assert traffic.answers <= {200, grpc.StatusCode.OK, "conn", grpc.StatusCode.UNAVAILABLE}, (
            traffic.answers
        )
        proc = _serve(db, http_port, grpc_port)  # the same database
        traffic.assert_stored(url)
        with _Traffic(url, grpc_port, "ro-after-kill") as after:
            after.wait_for(_BATCH, each=True)
        after.assert_stored(url)
    finally:
        proc.kill()
        proc.wait()


_ServiceOn = Callable[[Any], tuple[str, int]]


@pytest.fixture
def service_on() -> Iterator[_ServiceOn]:
    """``service_on(store)``: a StoreService over ``store`` with OTLP/HTTP + API and OTLP/gRPC on free
    ports; returns ``(http_url, grpc_port)``. Closed (with the store) after the test."""
    opened: list[tuple[StoreService, Any]] = []

    def start(store: Any) -> tuple[str, int]:
        service = StoreService(store, parse_workers=0)
        opened.append((service, store))
        grpc_port = service.start_grpc("127.0.0.1", 0)
        return service.start_http_background(), grpc_port

    yield start
    for service, store in opened:
        service.close()
        store.close()


def test_postgres_restarted_under_the_store(cluster: _Cluster, service_on: _ServiceOn) -> None:
    store = PostgresStore(_database(cluster, "restart"))
    url, grpc_port = service_on(store)
    with StoreClient(url) as client:
        client.enqueue_rollouts([{"task_id": "t", "rollout_id": r} for r in ("ro-q0", "ro-q1", "ro-cancel")])
        client.put_resource("model", {"v": 1})
        claimed = client.dequeue_rollout("w")
        assert claimed is not None
        attempt_id = claimed[1].attempt_id
    with _Traffic(url, grpc_port, "ro-pg") as traffic:
        traffic.wait_for(_BATCH * 2, each=True)
        cluster.stop("immediate")  # a crash, as the store sees it: every connection cut
        try:
            time.sleep(1.0)
            during = traffic.total()
            time.sleep(1.0)
            # nothing can be committed now, so nothing may be acknowledged
            assert traffic.total() == during, "the store acknowledged spans while PostgreSQL was down"
            assert grpc.StatusCode.UNAVAILABLE in traffic.answers and 503 in traffic.answers, traffic.answers
            for response in _call_every_endpoint(url, attempt_id).values():
                _assert_api_unavailable(response)
            assert httpx.get(url + "/healthz").status_code == 200
        finally:
            cluster.start()
        traffic.wait_for(_BATCH * 2, timeout_s=60, each=True)  # every sender gets through again
    assert traffic.answers <= {200, 503, grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, traffic.answers
    assert traffic.missing_retry_after == 0
    traffic.assert_stored(url)
    # the coordination API is back too, same store process, and nothing it refused took effect
    answers = _call_every_endpoint(url, attempt_id)
    assert {name: r.status_code for name, r in answers.items()} == {name: 200 for name in answers}, {
        name: r.text for name, r in answers.items()
    }
    assert answers["dequeue"].json()["rollout"]["rollout_id"] == "ro-q1"
    assert answers["put-resource"].json()["resource"]["version"] == 2


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 2 MB tmpfs the test mounts (and unmounts)."""
    where = Path(tempfile.mkdtemp(prefix="agl-full-"))
    mount = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)]
    mounted = subprocess.run(mount, capture_output=True, text=True, timeout=30, check=False)
    if mounted.returncode != 0:
        where.rmdir()
        pytest.fail(
            f"the full-disk test mounts a small tmpfs and could not ({mounted.stderr.strip()}; uid"
            f" {os.geteuid()}): run it as root, or in a container with CAP_SYS_ADMIN"
        )
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, timeout=30)
        shutil.rmtree(where, ignore_errors=True)


def _fill(path: Path) -> None:
    """Append to ``path`` until the disk is full (unbuffered: nothing is left to fail on close)."""
    with contextlib.suppress(OSError), path.open("ab", buffering=0) as fh:
        while fh.write(b"\0" * 16384):
            pass


def test_full_disk_under_sqlite(small_disk: Path, service_on: _ServiceOn) -> None:
    store = SqliteStore(small_disk / "store.sqlite")
    url, grpc_port = service_on(store)
    with StoreClient(url) as client:
        client.enqueue_rollouts([{"task_id": "t", "rollout_id": r} for r in ("ro-q0", "ro-q1", "ro-cancel")])
        client.put_resource("model", {"v": 1})
        claimed = client.dequeue_rollout("w")
        assert claimed is not None
        attempt_id = claimed[1].attempt_id
    filler = small_disk / "filler"
    with _Traffic(url, grpc_port, "ro-disk") as traffic:
        # Each commit of a few spans appends several pages to SQLite's WAL: paced, the senders that got
        # through first leave the others (backing off after a 503) their share of the space freed below.
        traffic.pace = 0.1
        traffic.wait_for(_BATCH, each=True)
        _fill(filler)
        deadline = time.monotonic() + 30
        while not {503, grpc.StatusCode.UNAVAILABLE} <= traffic.answers:
            assert time.monotonic() < deadline, f"the full disk was never reported; answers {traffic.answers}"
            _fill(filler)  # take back what the database freed (its WAL restarting, say)
            time.sleep(0.05)
        # the store stays up and answers queries
        assert httpx.get(url + "/healthz").status_code == 200
        with StoreClient(url) as client:
            assert client.stats()["spans"] > 0
            assert len(client.all_spans([traffic.rollout("raw-http")])) >= _BATCH
        # a write that cannot fit: the retryable 503, with the reason
        big = [{"task_id": "t", "input": "x" * 4000} for _ in range(100)]
        enqueue = httpx.post(url + "/api/rollouts", json={"rollouts": big}, timeout=30)
        _assert_api_unavailable(enqueue)
        assert "full" in enqueue.json()["error"]["message"]
        # small writes may still fit in pages the database holds; none may fail otherwise
        for name, response in _call_every_endpoint(url, attempt_id).items():
            if response.status_code == 503:
                _assert_api_unavailable(response)
            else:
                assert response.status_code in (200, 204), (name, response.status_code, response.text)
        filler.unlink()
        traffic.wait_for(_BATCH, timeout_s=30, each=True)  # ingest resumes, no restart
    assert traffic.answers <= {200, 503, grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, traffic.answers
    assert traffic.missing_retry_after == 0
    traffic.assert_stored(url)
    with StoreClient(url) as client:
        assert len(client.enqueue_rollouts(big[:10])) == 10
        assert client.dequeue_rollout("w") is not None


def test_calls_after_a_postgres_restart_do_not_fail_on_the_cut_connections(
    cluster: _Cluster, service_on: _ServiceOn
) -> None:
    """Connections cut by a restart are only found dead when next used: that use must go to a new
    connection, not answer 503 once per connection while PostgreSQL is up again."""
    store = PostgresStore(_database(cluster, "stale"))
    url, _ = service_on(store)
    body = make_request("ro-stale", 5).SerializeToString()
    headers = {"content-type": "application/x-protobuf"}
    with httpx.Client(timeout=10) as http:
        assert http.post(url + "/v1/traces", content=body, headers=headers).status_code == 200
        assert http.post(url + "/api/spans/query", json={"rollout_ids": ["ro-stale"]}).status_code == 200
        cluster.stop("immediate")
        cluster.start()
        ingest = http.post(
            url + "/v1/traces",
            content=make_request("ro-stale", 5, first=6).SerializeToString(),
            headers=headers,
        )
        assert ingest.status_code == 200, ingest.content
        query = http.post(url + "/api/spans/query", json={"rollout_ids": ["ro-stale"]})
        assert query.status_code == 200, query.text
        assert len(query.json()["spans"]) == 10
        enqueue = http.post(url + "/api/rollouts", json={"rollouts": [{"task_id": "t"}]})
        assert enqueue.status_code == 200, enqueue.text
