"""``agl store serve`` as a user runs it: a real process, the real OTLP exporter, then stats."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from agl_core.store import SqliteStore
from agl_core.tracing import rollout_scope
from tests._servers import wait_healthy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_store_serve_process_ingests_and_reports_stats(tmp_path):
    port, grpc_port = _free_port(), _free_port()
    db = tmp_path / "s.sqlite"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agl_core.cli",
            "store",
            "serve",
            "--db",
            str(db),
            "--http-port",
            str(port),
            "--grpc-port",
            str(grpc_port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url + "/healthz", proc)
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url + "/v1/traces")))
        for i in range(3):
            with rollout_scope(f"ro-{i}", tracer_provider=provider):
                pass
        provider.shutdown()
        stats = subprocess.run(
            [sys.executable, "-m", "agl_core.cli", "store", "stats", "--url", url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stats.returncode == 0, stats.stderr
        assert '"spans": 3' in stats.stdout
        # a second server on the same port fails with a clear message instead of a traceback
        clash = subprocess.run(
            [
                sys.executable,
                "-m",
                "agl_core.cli",
                "store",
                "serve",
                "--db",
                str(tmp_path / "o.sqlite"),
                "--http-port",
                str(port),
                "--no-grpc",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert clash.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in clash.stderr
        grpc_clash = subprocess.run(
            [
                sys.executable,
                "-m",
                "agl_core.cli",
                "store",
                "serve",
                "--db",
                str(tmp_path / "p.sqlite"),
                "--http-port",
                str(_free_port()),
                "--grpc-port",
                str(grpc_port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert grpc_clash.returncode == 2 and f"{grpc_port} for OTLP/gRPC" in grpc_clash.stderr
    finally:
        proc.terminate()
        proc.communicate(timeout=30)  # reads and closes the pipe
    assert db.exists()


def test_store_stats_reports_unreachable_store():
    done = subprocess.run(
        [sys.executable, "-m", "agl_core.cli", "store", "stats", "--url", f"http://127.0.0.1:{_free_port()}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "cannot reach the store" in done.stderr


def test_inspect_reads_an_embedded_stores_sqlite_file(tmp_path, capsys):
    from agl_core import semconv
    from agl_core.cli import main
    from agl_core.store import SqliteStore

    from .conftest import make_span

    ids = {semconv.ROLLOUT_ID: "ro-file", semconv.ATTEMPT_ID: "at-1"}
    store = SqliteStore(tmp_path / "store.sqlite")
    try:
        store.add_spans(
            [
                make_span(semconv.SPAN_ROLLOUT, ids),
                make_span(semconv.SPAN_REWARD, {**ids, semconv.REWARD_VALUE: 1.0}),
            ]
        )
    finally:
        store.close()
    assert main(["inspect", "ro-file", "--store", str(tmp_path / "store.sqlite")]) == 0
    out = capsys.readouterr().out
    assert "agl.rollout" in out and "rollout made no LLM call through the gateway" in out
    assert main(["inspect", "ro-file", "--store", str(tmp_path / "nope.sqlite")]) == 1
    assert "neither a store URL" in capsys.readouterr().err


def test_a_port_in_use_is_named_with_the_flag_that_changes_it(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        store = subprocess.run(
            [sys.executable, "-m", "agl_core.cli", "store", "serve", "--db", str(tmp_path / "s.sqlite")]
            + ["--http-port", port, "--no-grpc"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        gateway = subprocess.run(
            [sys.executable, "-m", "agl_core.cli", "gateway", "serve", "--backend", "openai"]
            + ["--upstream", "http://127.0.0.1:9/v1", "--upstream-model", "m", "--port", port],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert store.returncode == 2 and f"127.0.0.1:{port}" in store.stderr
    assert "(OTLP/HTTP and the API: --http-port PORT)" in store.stderr
    assert gateway.returncode == 2 and "(--port PORT)" in gateway.stderr


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.timing
def test_store_serve_stopped_by_a_signal_says_what_it_kept_and_exits_the_shells_way(tmp_path, stop):
    port = _free_port()
    db = tmp_path / "s.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agl_core.cli", "store", "serve", "--db", str(db), "--http-port", str(port)]
        + ["--no-grpc", "--parse-workers", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
        assert httpx.post(
            f"http://127.0.0.1:{port}/api/rollouts", json={"rollouts": [{"task_id": "t"}]}
        ).is_success
        started = time.monotonic()
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + stop and time.monotonic() - started < 10
    name = signal.Signals(stop).name
    assert f"agl store serve: stopped by {name}; every span and rollout it acknowledged is in {db}" in err
    assert "Traceback" not in err
    kept = SqliteStore(db)
    try:
        assert kept.stats()["rollouts"] == 1
    finally:
        kept.close()
