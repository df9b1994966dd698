"""Ingest workers that write: on a SQLite store, a parse worker decodes a big export and commits it itself,
taking turns with the store process and the other workers on a lock file."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest

from agl_core import semconv
from agl_core.store import StoreClient
from agl_core.store.ingest import IngestPipeline
from agl_core.store.service import StoreService
from agl_core.store.sqlite import SqliteStore

from ._exports import export_steps
from .test_store_ingest import make_request

PROTOBUF = {"content-type": "application/x-protobuf"}


def _big(rollout: str, n: int = 120, first: int = 1) -> bytes:
    """An export over the 16 KB that the store ships to a worker."""
    body = make_request(rollout, n, first=first, attrs=4).SerializeToString()
    assert len(body) > 16_384
    return body


def _waiting_on_lock_file(store: SqliteStore, timeout_s: float = 30.0) -> bool:
    """Whether some process is blocked on ``flock`` of the store's lock file (Linux's /proc/locks lists
    a blocked request with ``->``), polled for up to ``timeout_s``."""
    inode = os.stat(str(store.path) + "-agl-write.lock").st_ino
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open("/proc/locks") as locks:
            for line in locks:
                fields = line.split()
                if "->" in fields and "FLOCK" in fields and any(f.endswith(f":{inode}") for f in fields):
                    return True
        time.sleep(0.02)
    return False


def test_workers_write_big_exports_while_the_store_process_writes_the_rest(sqlite_store, monkeypatch):
    """Big exports from 4 senders are written by the workers (never by the store process's writer),
    small ones and rollouts by the store process, all at once: every span is stored once, in one
    sequence, and a span with an invalid id is refused on its own (partial success) in a worker too."""
    in_process: list[int] = []
    original = sqlite_store.add_span_rows

    def counted(rows, scopes):
        in_process.append(len(rows))
        return original(rows, scopes)

    monkeypatch.setattr(sqlite_store, "add_span_rows", counted)
    service = StoreService(sqlite_store, parse_workers=2)
    url = service.start_http_background()
    failures: list[str] = []

    def sender(k: int) -> None:
        with httpx.Client(timeout=60) as http:
            for b in range(6):
                r = http.post(
                    url + "/v1/traces", content=_big(f"ro-big-{k}", first=1 + 120 * b), headers=PROTOBUF
                )
                if r.status_code != 200:
                    failures.append(f"big {k}/{b}: {r.status_code} {r.text}")
                small = make_request(f"ro-small-{k}", 5, first=1 + 5 * b).SerializeToString()
                r = http.post(url + "/v1/traces", content=small, headers=PROTOBUF)
                if r.status_code != 200:
                    failures.append(f"small {k}/{b}: {r.status_code}")

    try:
        threads = [threading.Thread(target=sender, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        sqlite_store.enqueue_rollouts([{"task_id": "t", "rollout_id": f"ro-q{i}"} for i in range(20)])
        for t in threads:
            t.join(120)
        assert not failures
        # one span with a zero span id among 119 good ones
        bad = make_request("ro-bad", 120, attrs=4)
        bad.resource_spans[0].scope_spans[0].spans[7].span_id = bytes(8)
        r = httpx.post(url + "/v1/traces", content=bad.SerializeToString(), headers=PROTOBUF)
        assert r.status_code == 200
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        answer = ExportTraceServiceResponse.FromString(r.content)
        assert answer.partial_success.rejected_spans == 1
        assert "span_id" in answer.partial_success.error_message
        with StoreClient(url) as client:
            for k in range(4):
                assert len(client.all_spans([f"ro-big-{k}"])) == 720
                assert len(client.all_spans([f"ro-small-{k}"])) == 30
            assert len(client.all_spans(["ro-bad"])) == 119
        assert len(sqlite_store.get_rollouts([f"ro-q{i}" for i in range(20)])) == 20
    finally:
        service.close()
    # the store process wrote only the small exports (5 spans each): the big ones never came back to it
    assert in_process and set(in_process) <= {5, 10, 15, 20}
    seqs = [row[0] for row in sqlite_store._read("SELECT seq FROM spans ORDER BY seq")]
    assert len(seqs) == len(set(seqs)) == 4 * 720 + 4 * 30 + 119
    assert os.path.exists(str(sqlite_store.path) + "-agl-write.lock")


@pytest.mark.timing
def test_a_worker_waits_for_the_store_process_to_commit_and_is_woken_at_once(sqlite_store):
    """While the store process holds the write (its lock file taken), a worker's write waits on the lock
    file (woken by the kernel when it is let go, where SQLite's busy handler would poll with sleeps of up
    to 100 ms), then is written."""
    pipeline = IngestPipeline(sqlite_store, parse_workers=1, workers_write=True)
    try:
        pipeline.ingest_async(_big("ro-warm")).result(60)  # the worker is up and has the file open
        with sqlite_store._write() as conn:
            conn.execute(
                "INSERT INTO resources (name, version, value, created_at) VALUES ('held', 1, '1', 0)"
            )
            waiting = pipeline.ingest_async(_big("ro-wait"))
            # the worker waits in flock on the lock file, not in SQLite's sleeping busy handler
            assert _waiting_on_lock_file(sqlite_store), "the worker is not waiting on the lock file"
            assert not waiting.done(), "the worker wrote while the store process held the write"
            released = time.monotonic()
        done = waiting.result(30)
        woken_after = time.monotonic() - released
        assert done.spans == 120 and done.rejected == 0
        assert len(sqlite_store.query_spans(rollout_ids=["ro-wait"])) == 120
        assert woken_after < 10.0
    finally:
        pipeline.close()


def test_a_write_that_fails_in_a_worker_is_refused_retryably_and_keeps_nothing(sqlite_store):
    """A worker's transaction that fails (here a trigger standing in for a full disk) answers 503 +
    Retry-After; none of that export's spans are kept, and the next export is written."""
    sqlite_store._writer.execute(
        "CREATE TRIGGER full BEFORE INSERT ON spans WHEN NEW.name = 'span-60'"
        " BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"
    )
    service = StoreService(sqlite_store, parse_workers=1)
    url = service.start_http_background()
    try:
        r = httpx.post(url + "/v1/traces", content=_big("ro-full"), headers=PROTOBUF, timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "disk is full" in r.text
        assert sqlite_store.query_spans(rollout_ids=["ro-full"]) == []
        r = httpx.post(url + "/v1/traces", content=_big("ro-next", first=200), headers=PROTOBUF, timeout=60)
        assert r.status_code == 200
        assert len(sqlite_store.query_spans(rollout_ids=["ro-next"])) == 120
    finally:
        service.close()


def test_workers_write_only_into_a_sqlite_store():
    with pytest.raises(ValueError, match="SqliteStore"):
        IngestPipeline(object(), parse_workers=1, workers_write=True)
    # without workers there is nothing to write elsewhere: the flag changes nothing
    assert IngestPipeline(object(), workers_write=True).has_workers is False


def test_another_process_sharing_writes_takes_turns_on_the_lock_file(tmp_path):
    """Two processes writing one file through ``share_writes``: the second waits on the lock file while
    the first holds a transaction open, then writes; nothing is lost or refused as busy."""
    path = tmp_path / "shared.sqlite"
    here = SqliteStore(path)
    here.share_writes()
    script = (
        "import sys, time\n"
        "from agl_core.store.sqlite import SqliteStore\n"
        "s = SqliteStore(sys.argv[1], checkpoints=False)\n"
        "s.share_writes()\n"
        "t = time.monotonic()\n"
        "s.put_resource('there', 1)\n"
        "print(time.monotonic() - t)\n"
        "s.close()\n"
    )
    try:
        with here._write() as conn:
            conn.execute(
                "INSERT INTO resources (name, version, value, created_at) VALUES ('here', 1, '1', 0)"
            )
            other = subprocess.Popen(
                [sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True
            )
            assert _waiting_on_lock_file(here), "the other process is not waiting on the lock file"
            time.sleep(0.4)
            assert other.poll() is None
        out, _ = other.communicate(timeout=60)
        assert other.returncode == 0
        assert float(out) > 0.3  # it waited for this process's commit
        assert here.get_resource("there") is not None and here.get_resource("here") is not None
        with sqlite3.connect(path) as conn:
            assert conn.execute("SELECT COUNT(*) FROM resources").fetchone()[0] == 2
    finally:
        here.close()


def test_rollout_ids_come_from_agl_attributes_in_a_worker_too(sqlite_store):
    pipeline = IngestPipeline(sqlite_store, parse_workers=1, workers_write=True)
    try:
        request = make_request("ro-ids", 120, attrs=4)
        for span in request.resource_spans[0].scope_spans[0].spans:
            span.attributes.add(key=semconv.ATTEMPT_ID).value.string_value = "ro-ids-a1"
        assert pipeline.ingest_async(request.SerializeToString()).result(60).spans == 120
        rows = sqlite_store._read("SELECT DISTINCT rollout_id, attempt_id FROM spans")
        assert rows == [("ro-ids", "ro-ids-a1")]
    finally:
        pipeline.close()


# --- the worker pool itself ------------------------------------------------------------------------------
def _digest(body: bytes, salt: str) -> tuple[int, str, int]:
    """Runs in a worker: what it received."""
    import hashlib

    return len(body), hashlib.sha256(body).hexdigest() + salt, os.getpid()


def _nap(body: bytes, seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


class _Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("local state")
        self.handle = threading.Lock()  # cannot be pickled


def _fail(body: bytes, kind: str) -> None:
    if kind == "value":
        raise ValueError(f"bad body of {len(body)} bytes")
    raise _Unpicklable()


def test_a_worker_gets_the_body_as_sent_and_its_errors_come_back():
    import hashlib

    from agl_core.store.workers import WorkerPool

    pool = WorkerPool(2)
    try:
        big = os.urandom(3 * 1024 * 1024)  # three times the pipe's buffer
        size, digest, pid = pool.submit(_digest, big, "!").result(60)
        assert (size, digest) == (len(big), hashlib.sha256(big).hexdigest() + "!")
        assert pid != os.getpid()
        assert pool.submit(_digest, b"", "").result(60)[0] == 0
        with pytest.raises(ValueError, match="bad body of 5 bytes"):
            pool.submit(_fail, b"12345", "value").result(60)
        with pytest.raises(RuntimeError, match="_Unpicklable"):
            pool.submit(_fail, b"", "unpicklable").result(60)
        # four at once on two workers: the rest wait for a free one
        results = [pool.submit(_digest, bytes([i]) * 1000, str(i)) for i in range(4)]
        assert [r.result(60)[1][-1] for r in results] == ["0", "1", "2", "3"]
    finally:
        pool.shutdown()


def test_a_killed_worker_fails_only_its_job_and_is_replaced():
    import signal

    from agl_core.store.workers import WorkerLost, WorkerPool

    pool = WorkerPool(1)
    try:
        first_pid = pool.submit(_nap, b"", 0).result(60)
        held = pool.submit(_nap, b"", 60)
        waiting = pool.submit(_digest, b"abc", "")
        time.sleep(0.3)
        os.kill(first_pid, signal.SIGKILL)
        with pytest.raises(WorkerLost, match="restarted"):
            held.result(30)
        size, _, pid = waiting.result(60)  # taken by the new worker
        assert size == 3 and pid != first_pid
        assert pool.restarted == 1
    finally:
        pool.shutdown()


def test_shutting_down_answers_the_held_job_and_refuses_the_rest():
    from agl_core.store.workers import WorkerLost, WorkerPool

    pool = WorkerPool(1)
    held = pool.submit(_nap, b"", 1.0)
    waiting = pool.submit(_nap, b"", 0)
    time.sleep(0.2)
    pid = None
    pool.shutdown()
    pid = held.result(0)  # finished before the worker stopped
    assert isinstance(pid, int)
    with pytest.raises(WorkerLost, match="shutting down"):
        waiting.result(0)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(_nap, b"", 0)


def test_workers_start_when_a_job_needs_one():
    """A store that never receives a big export starts no worker process; the second starts only when
    two jobs are held at once."""
    import psutil

    from agl_core.store.workers import WorkerPool

    before = {p.pid for p in psutil.Process().children()}
    pool = WorkerPool(2)
    try:
        assert {p.pid for p in psutil.Process().children()} == before
        pool.submit(_nap, b"", 0).result(60)
        pool.submit(_nap, b"", 0).result(60)  # the first worker is idle again: no second one
        assert len({p.pid for p in psutil.Process().children()} - before) == 1
        both = [pool.submit(_nap, b"", 0.5) for _ in range(2)]
        assert len({f.result(60) for f in both}) == 2
        assert len({p.pid for p in psutil.Process().children()} - before) == 2
    finally:
        pool.shutdown()


@pytest.mark.parametrize(
    "value, message",
    [
        ("-1", "--parse-workers must be between 0 and 64"),
        ("65", "--parse-workers must be between 0 and 64"),
        ("two", "argument --parse-workers: invalid int value: 'two'"),
    ],
)
def test_store_serve_refuses_a_bad_worker_count(tmp_path, value, message):
    done = subprocess.run(
        [sys.executable, "-m", "agl_core.cli", "store", "serve", "--db", str(tmp_path / "s.sqlite")]
        + ["--no-grpc", "--parse-workers", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "s.sqlite").exists()


def test_the_real_grpc_exporter_reaches_a_worker_that_writes(sqlite_store):
    """OTLP/gRPC takes the same path as OTLP/HTTP: a batch over 16 KB from the SDK's gRPC exporter is
    decoded and committed by a worker before the exporter is answered."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    in_process: list[int] = []
    original = sqlite_store.add_span_rows
    sqlite_store.add_span_rows = lambda rows, scopes: in_process.append(len(rows)) or original(rows, scopes)
    service = StoreService(sqlite_store, parse_workers=1)
    port = service.start_grpc("127.0.0.1", 0)
    try:
        export_steps(GrpcExporter(endpoint=f"127.0.0.1:{port}", insecure=True), "ro-grpc", 300, "z" * 80)
        (root,) = sqlite_store.query_spans(rollout_ids=["ro-grpc"], limit=1)
        assert len(sqlite_store.query_spans(trace_id=root.trace_id)) == 301
        assert not in_process or max(in_process) < 300  # the big batch never reached this process's writer
    finally:
        service.close()
