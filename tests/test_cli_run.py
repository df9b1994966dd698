"""``agl run`` as a user runs it: a real process serving a real store over HTTP, stopped by signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import agl_core
from agl_core import semconv
from agl_core.cli import main
from agl_core.records import RolloutStatus
from agl_core.runner import LLM_RESOURCE
from agl_core.server import BackgroundServer
from agl_core.store import SqliteStore, StoreClient
from agl_core.store.server import create_store_app

ROOT = Path(__file__).resolve().parent.parent  # holds the tests package the agents live in
AGENT = "tests._runner_agents:scripted"


@pytest.fixture
def store(sqlite_store) -> Iterator[tuple[str, StoreClient]]:
    with BackgroundServer(create_store_app(sqlite_store)) as server, StoreClient(server.url) as client:
        client.put_resource(LLM_RESOURCE, {"base_url": "http://127.0.0.1:9", "model": "m"})
        yield server.url, client


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "agl-run.log"
    env = {**os.environ, "PYTHONPATH": str(Path(agl_core.__file__).resolve().parent.parent)}
    with log.open("w") as sink:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "agl_core.cli", "run", AGENT, "--path", str(ROOT), *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env=env,
        )
    return proc, log


def _wait_for(predicate, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_agl_run_serves_rollouts_with_spans_and_kills_a_hung_agent(store, tmp_path):
    url, client = store
    pids = tmp_path / "pids"
    queued = client.enqueue_rollouts(
        [{"task_id": f"t{i}", "input": {"reward": i / 4}} for i in range(3)]
        + [{"task_id": "hang", "input": {"hang": True, "pid_file": str(pids)}}]
    )
    proc, log = _start(
        tmp_path, "--store", url, "--mode", "process", "--rollout-timeout", "0.6", "--report-every", "0.1"
    )
    try:
        done = client.wait_for_rollouts([r.rollout_id for r in queued], timeout_s=20, poll_s=0.05)
        by_task = {r.task_id: r for r in done}
        assert [by_task[f"t{i}"].reward for i in range(3)] == [0.0, 0.25, 0.5]
        assert by_task["hang"].status == RolloutStatus.TIMED_OUT
        hung_pid = int(pids.read_text())
        _wait_for(lambda: not _alive(hung_pid), "the hung worker process to be gone", 5)
        # spans went to the store's OTLP endpoint: the rollout spans, the workers' reward spans, the timeout
        spans = client.query_spans(rollout_ids=[r.rollout_id for r in done])
        rewards = [s for s in spans if s.name == semconv.SPAN_REWARD]
        assert sorted(s.attributes[semconv.REWARD_VALUE] for s in rewards) == [0.0, 0.25, 0.5]
        assert [s.attributes[semconv.ERROR_TYPE] for s in spans if s.name == semconv.SPAN_ERROR] == [
            "RolloutTimeout"
        ]
        assert len([s for s in spans if s.name == semconv.SPAN_ROLLOUT]) == 4
        _wait_for(lambda: "3 done, 0 failed, 1 timed out" in log.read_text(), "a periodic report", 5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert f"agl run: {AGENT} on {url}, 1 worker(s) in process mode, rollout timeout 0.6 s" in out
    assert "agl run: stopped; 3 done, 0 failed, 1 timed out, 0 running" in out


def test_agl_run_stops_gracefully_on_sigterm(store, tmp_path):
    url, client = store
    gate = tmp_path / "gate"  # the running rollout ends only once the test opens it: no race with SIGTERM
    started = tmp_path / "started"  # the agent writes it first: the runner counts the rollout by then
    (running,) = client.enqueue_rollouts(
        [{"task_id": "last", "input": {"wait_for": str(gate), "pid_file": str(started), "reward": 1.0}}]
    )
    proc, log = _start(tmp_path, "--store", url, "--grace", "30")
    try:
        # the store marks it running when a worker claims it, a moment before the runner counts it
        _wait_for(started.exists, "the agent to start")
        proc.send_signal(signal.SIGTERM)
        _wait_for(
            lambda: "SIGTERM: taking no more rollouts" in log.read_text(), "the runner to stop taking", 10
        )
        (after_stop,) = client.enqueue_rollouts([{"task_id": "after", "input": {"reward": 1.0}}])
        gate.touch()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    # the running rollout finished within the grace period; nothing new was taken
    (finished,) = client.get_rollouts([running.rollout_id])
    assert finished.status == RolloutStatus.SUCCEEDED and finished.reward == 1.0
    assert client.get_rollouts([after_stop.rollout_id])[0].status == RolloutStatus.QUEUED
    assert "1 worker(s) in thread mode, rollout timeout none" in out
    assert "SIGTERM: taking no more rollouts; waiting up to 30 s for 1 running" in out
    assert "agl run: stopped; 1 done, 0 failed, 0 timed out, 0 running" in out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timing
def test_agl_run_second_signal_exits_at_once(store, tmp_path):
    url, client = store
    (hung,) = client.enqueue_rollouts([{"task_id": "hang", "input": {"hang": True}}])
    proc, log = _start(tmp_path, "--store", url, "--grace", "60")
    try:
        _wait_for(
            lambda: client.get_rollouts([hung.rollout_id])[0].status == RolloutStatus.RUNNING, "it to run"
        )
        proc.send_signal(signal.SIGINT)
        _wait_for(lambda: "taking no more rollouts" in log.read_text(), "the graceful stop to begin")
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 128 + signal.SIGTERM
        assert time.monotonic() - start < 2
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "second SIGTERM; exiting now" in log.read_text()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "0"], "argument --workers: must be between 1 and 1024, got 0"),
        (["--workers", "two"], "argument --workers: must be a whole number, got 'two'"),
        (
            ["--store", "localhost:4318"],
            "argument --store: must be the store's http(s) URL, like http://127.0.0.1:4318",
        ),
        (["--store", "ftp://h:1"], "argument --store: must be the store's http(s) URL"),
        (["--rollout-timeout", "0"], "argument --rollout-timeout: must be > 0 seconds, got '0'"),
        (
            ["--rollout-timeout", "soon"],
            "argument --rollout-timeout: must be a number of seconds, got 'soon'",
        ),
        (["--lease", "-1"], "argument --lease: must be > 0 seconds"),
        (["--grace", "nan"], "argument --grace: must be >= 0 seconds"),
        (["--mode", "fork"], "argument --mode: invalid choice: 'fork'"),
        (["--path", "/no/such/dir"], "argument --path: '/no/such/dir' is not a directory"),
    ],
)
def test_agl_run_rejects_bad_flags(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", AGENT, *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_agl_run_explains_agents_and_stores_it_cannot_use(store, tmp_path, capsys, monkeypatch):
    url, _ = store
    monkeypatch.chdir(tmp_path)
    assert main(["run", "no_such_agent_mod:run", "--store", url, "--path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot import agent module 'no_such_agent_mod': No module named 'no_such_agent_mod'" in err
    assert f"looks for 'no_such_agent_mod' in {tmp_path}, {tmp_path}, then on sys.path" in err
    assert "pass --path DIR with the directory that holds no_such_agent_mod.py" in err

    (tmp_path / "broken_agent.py").write_text("raise RuntimeError('bad import-time code')\n")
    assert main(["run", "broken_agent:run", "--store", url]) == 2
    assert (
        "importing agent module 'broken_agent' failed: RuntimeError: bad import-time code"
        in capsys.readouterr().err
    )

    assert main(["run", "tests._runner_agents:nope", "--store", url]) == 2
    assert "module 'tests._runner_agents' has no callable 'nope'" in capsys.readouterr().err

    assert main(["run", AGENT, "--store", url, "--mode", "async"]) == 2
    assert "mode 'async' runs 'async def' agents, but tests._runner_agents:scripted is a plain function" in (
        capsys.readouterr().err
    )

    guarded_store = SqliteStore(tmp_path / "guarded.sqlite")
    with BackgroundServer(create_store_app(guarded_store, token="s3cret")) as guarded:
        assert main(["run", AGENT, "--store", guarded.url]) == 1
        err = capsys.readouterr().err
        assert f"the store at {guarded.url} refused the request" in err and "--token" in err
    guarded_store.close()

    closed = BackgroundServer(create_store_app(guarded_store))
    closed._sock.close()  # a port nothing listens on
    assert main(["run", AGENT, "--store", closed.url]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach the store at {closed.url}" in err and "agl store serve" in err

    monkeypatch.setenv("AGL_STORE_URL", "not a url")
    assert main(["run", AGENT]) == 2
    assert "AGL_STORE_URL must be the store's http(s) URL" in capsys.readouterr().err
