"""Fault suite: PostgreSQL restarted mid-ingest, the store SIGKILLed mid-ingest on PostgreSQL, and a full
disk under SQLite. In each, senders record which requests the store acknowledged; every acknowledged span
must be stored, the store answers only 200 or the retryable 503 (never a 500), and where the store
process survives it ingests again without a restart. (A killed parse worker: test_store_hardening.py;
SIGKILL on SQLite: test_store_ingest.py.)

PostgreSQL here is a private cluster the test starts and stops itself (the machine's shared server is
never restarted); the full disk is a small tmpfs the test mounts."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agl_core.store import SqliteStore, StoreClient
from agl_core.store.service import StoreService

from .test_cli_store import _free_port
from .test_store_ingest import make_request

PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"))), None)


class _Cluster:
    """A PostgreSQL cluster of the test's own, run as the ``postgres`` user."""

    def __init__(self) -> None:
        assert PG_BIN is not None, "PostgreSQL's server binaries are not installed (/usr/lib/postgresql)"
        self.dir = Path(tempfile.mkdtemp(prefix="agl-pg-"))
        shutil.chown(self.dir, "postgres")
        self.port = _free_port()
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._as_postgres(
            str(PG_BIN / "initdb"), "-D", str(self.dir / "data"), "--auth=trust", "-U", "postgres"
        )

    def _as_postgres(self, *command: str) -> None:
        # the server's output goes to its log file: a pipe it inherited would never close
        subprocess.run(
            ["runuser", "-u", "postgres", "--", *command],
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        data, log = str(self.dir / "data"), str(self.dir / "server.log")
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", data, "-o", options, "-l", log, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.dir / "data"), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[_Cluster]:
    pg = _Cluster()
    pg.start()
    try:
        yield pg
    finally:
        pg.remove()


class _Senders:
    """Threads posting OTLP batches of 20 spans to ``url``; ``acked`` holds (sender, batch) answered 200."""

    def __init__(self, url: str, prefix: str, threads: int = 3) -> None:
        self.url, self.prefix = url, prefix
        self.acked: list[tuple[int, int]] = []
        self.statuses: set[int] = set()
        self.errors = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(k,)) for k in range(threads)]

    def _send(self, k: int) -> None:
        with httpx.Client(timeout=10) as http:
            b = 0
            while not self._stop.is_set():
                body = make_request(f"{self.prefix}{k}", 20, first=1 + b * 20).SerializeToString()
                try:
                    response = http.post(
                        self.url + "/v1/traces",
                        content=body,
                        headers={"content-type": "application/x-protobuf"},
                    )
                except httpx.HTTPError:
                    self.errors += 1
                    time.sleep(0.05)
                    continue
                self.statuses.add(response.status_code)
                if response.status_code == 200:
                    self.acked.append((k, b))
                    b += 1
                else:
                    time.sleep(0.05)  # retry the same batch, as an exporter would

    def __enter__(self) -> _Senders:
        for t in self._threads:
            t.start()
        return self

    def wait_for(self, n: int, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.acked) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(self.acked) >= n, f"only {len(self.acked)} batches acknowledged; statuses {self.statuses}"

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(15)

    def assert_all_stored(self, client: StoreClient) -> None:
        for k in {k for k, _ in self.acked}:
            stored = {s.name for s in client.all_spans([f"{self.prefix}{k}"])}
            for kk, b in self.acked:
                if kk == k:
                    missing = {f"span-{i}" for i in range(1 + b * 20, 21 + b * 20)} - stored
                    assert not missing, f"acknowledged batch {b} of sender {k} lost {len(missing)} spans"


def test_postgres_restarted_mid_ingest_loses_nothing_and_the_store_recovers(cluster):
    from agl_core.store.postgres import PostgresStore

    store = PostgresStore(cluster.dsn, schema="restart")
    service = StoreService(store, parse_workers=0)
    url = service.start_http_background()
    try:
        with _Senders(url, "ro-pg") as senders:
            senders.wait_for(10)
            cluster.stop("immediate")  # a crash, from the store's side: every connection cut
            time.sleep(1.0)
            during = len(senders.acked)
            api = httpx.post(url + "/api/rollouts/dequeue", json={"worker_id": "w"}, timeout=10)
            assert api.status_code == 503 and "retry" in api.json()["error"]["message"], api.text
            cluster.start()
            senders.wait_for(during + 10, timeout_s=60)  # ingest resumes without restarting the store
        assert senders.statuses <= {200, 503}, senders.statuses
        assert 503 in senders.statuses
        with StoreClient(url) as client:
            senders.assert_all_stored(client)
            assert client.dequeue_rollout("w") is None  # the API is back too
    finally:
        service.close()
        store.close()


def test_store_sigkilled_mid_ingest_on_postgres_loses_no_acknowledged_span(cluster):
    port = _free_port()
    dsn = cluster.dsn

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agl_core.cli", "store", "serve", "--db", dsn, "--http-port", str(port)]
            + ["--no-grpc"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    return proc
            assert proc.poll() is None and time.monotonic() < deadline, "store did not start"
            time.sleep(0.05)

    proc = start()
    url = f"http://127.0.0.1:{port}"
    with _Senders(url, "ro-kill") as senders:
        senders.wait_for(15)
        proc.kill()
        proc.wait()
    proc = start()
    try:
        with StoreClient(url) as client:
            senders.assert_all_stored(client)
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 4 MB tmpfs mounted for the test (root required; the suite runs as root on these machines)."""
    where = Path(tempfile.mkdtemp(prefix="agl-disk-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], check=True, timeout=30)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, timeout=30)
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_full_disk_answers_retry_later_and_ingest_resumes_when_space_is_freed(small_disk):
    filler = small_disk / "filler"
    store = SqliteStore(small_disk / "store.sqlite")
    service = StoreService(store, parse_workers=0)
    url = service.start_http_background()
    try:
        with _Senders(url, "ro-disk", threads=2) as senders:
            senders.wait_for(5)
            # fill what is left of the disk, leaving the database nowhere to grow
            with filler.open("wb") as fh, contextlib.suppress(OSError):
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            deadline = time.monotonic() + 30
            while 503 not in senders.statuses and time.monotonic() < deadline:
                time.sleep(0.05)
            assert 503 in senders.statuses, f"the full disk was never reported; statuses {senders.statuses}"
            assert httpx.get(url + "/healthz").status_code == 200
            assert httpx.get(url + "/api/stats").status_code == 200  # reads still work
            during = len(senders.acked)
            filler.unlink()
            senders.wait_for(during + 5, timeout_s=60)  # ingest resumes, no restart
        assert senders.statuses <= {200, 503}, senders.statuses
        with StoreClient(url) as client:
            senders.assert_all_stored(client)
    finally:
        service.close()
        store.close()
