from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from agl_core import RolloutTimeout, semconv
from agl_core.pipeline.transitions import episode_rewards
from agl_core.records import RolloutStatus
from agl_core.runner import LLM_RESOURCE, Runner, load_agent, resolve_mode, run_command
from agl_core.server import BackgroundServer
from agl_core.store import StoreClient
from agl_core.store.server import create_store_app
from agl_core.tracing import current_rollout, make_otlp_exporter
from tests import _runner_agents


def _provider(url: str) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(make_otlp_exporter(url), schedule_delay_millis=50))
    return provider


@pytest.fixture
def sq_server(sqlite_store) -> Iterator[BackgroundServer]:
    """A store server on SQLite only: these tests are about the runner, not the backends."""
    with BackgroundServer(create_store_app(sqlite_store)) as server:
        yield server


@pytest.fixture
def sq(sq_server) -> Iterator[StoreClient]:
    with StoreClient(sq_server.url) as c:
        c.put_resource(LLM_RESOURCE, {"base_url": "http://127.0.0.1:9", "model": "m"})
        yield c


def _error_spans(client: StoreClient, rollout_id: str) -> list:
    return [s for s in client.query_spans(rollout_ids=[rollout_id]) if s.name == semconv.SPAN_ERROR]


def test_runner_runs_agents_concurrently_and_captures_failures(store_server, client):
    provider = _provider(store_server.url)
    client.put_resource(LLM_RESOURCE, {"base_url": "http://127.0.0.1:9", "model": "m", "policy_version": 4})
    seen = {}
    lock = threading.Lock()

    def agent(task, llm):
        rollout = current_rollout()
        with lock:
            seen[rollout.rollout_id] = (llm.base_url, llm.policy_version, task)
        if task["n"] == 3:
            raise ZeroDivisionError("agent bug")
        if task["n"] == 4:
            return "not a number"
        return task["n"] / 10

    queued = client.enqueue_rollouts([{"task_id": f"t{n}", "input": {"n": n}} for n in range(6)])
    runner = Runner(agent, client, provider, workers=3).start()
    try:
        done = client.wait_for_rollouts([r.rollout_id for r in queued], timeout_s=30)
    finally:
        runner.stop()
    status = {r.input["n"]: r.status for r in done}
    assert status == {
        0: RolloutStatus.SUCCEEDED,
        1: RolloutStatus.SUCCEEDED,
        2: RolloutStatus.SUCCEEDED,
        3: RolloutStatus.FAILED,
        4: RolloutStatus.FAILED,
        5: RolloutStatus.SUCCEEDED,
    }
    failed = next(r for r in done if r.input["n"] == 3)
    assert (
        "ZeroDivisionError: agent bug" in failed.attempts[0].error and "Traceback" in failed.attempts[0].error
    )
    not_a_number = next(r for r in done if r.input["n"] == 4)
    assert "returned 'not a number', which is not a reward" in not_a_number.attempts[0].error
    # each rollout got its own rollout-scoped endpoint and the published policy version
    for r in done:
        base_url, version, task = seen[r.rollout_id]
        assert (
            base_url == f"http://127.0.0.1:9/rollouts/{r.rollout_id}/attempts/{r.attempts[0].attempt_id}/v1"
        )
        assert version == 4 and task == r.input
    spans = client.query_spans(rollout_ids=[r.rollout_id for r in done])
    rewards = episode_rewards(spans)
    assert {next(r.input["n"] for r in done if r.rollout_id == rid): v for rid, v in rewards.items()} == {
        0: 0.0,
        1: 0.1,
        2: 0.2,
        5: 0.5,
    }
    errors = [s for s in spans if s.name == semconv.SPAN_ERROR]
    assert len(errors) == 2 and all(s.is_error for s in errors)
    assert runner.counts.succeeded == 4 and runner.counts.failed == 2 and runner.counts.running == 0
    provider.shutdown()


def test_runner_without_llm_resource_fails_the_attempt_clearly(sqlite_store):
    with BackgroundServer(create_store_app(sqlite_store)) as server, StoreClient(server.url) as client:
        (queued,) = client.enqueue_rollouts([{"task_id": "t"}])
        runner = Runner(lambda task, llm: 1.0, client, TracerProvider()).start()
        try:
            (done,) = client.wait_for_rollouts([queued.rollout_id], timeout_s=10)
        finally:
            runner.stop()
    assert done.status == RolloutStatus.FAILED
    assert (
        "no usable 'llm' resource" in done.attempts[0].error
        and "trainer publishes it" in done.attempts[0].error
    )


def test_load_agent_errors():
    with pytest.raises(ValueError, match="module:function"):
        load_agent("nocolon")
    with pytest.raises(ValueError, match="cannot import"):
        load_agent("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no callable 'nope'"):
        load_agent("json:nope")
    assert load_agent("json:dumps")([1]) == "[1]"


def test_mode_resolution_and_bad_settings(sq):
    async def async_agent(task, llm):
        return 1.0

    def sync_agent(task, llm):
        return 1.0

    assert resolve_mode(sync_agent) == "thread" and resolve_mode(async_agent) == "async"
    assert resolve_mode(_runner_agents.scripted_async, "process") == "process"
    with pytest.raises(
        ValueError, match="mode 'async' runs 'async def' agents, but .*sync_agent is a plain function"
    ):
        Runner(sync_agent, sq, TracerProvider(), mode="async")
    with pytest.raises(ValueError, match="is an 'async def' agent; run it in mode 'async'"):
        Runner(async_agent, sq, TracerProvider(), mode="thread")
    with pytest.raises(
        ValueError, match="mode 'process' imports the agent by name .* define it at the top level"
    ):
        Runner(sync_agent, sq, TracerProvider(), mode="process")
    with pytest.raises(ValueError, match="unknown runner mode 'fork'"):
        Runner(sync_agent, sq, TracerProvider(), mode="fork")
    with pytest.raises(ValueError, match="rollout_timeout_s must be > 0"):
        Runner(sync_agent, sq, TracerProvider(), rollout_timeout_s=0)
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        Runner(sync_agent, sq, TracerProvider(), workers=0)
    assert run_command(
        "my_agent:run",
        "http://10.0.0.5:4318",
        workers=8,
        mode="process",
        rollout_timeout_s=90.0,
        paths=["/srv/my agents"],
    ) == (
        "agl run my_agent:run --store http://10.0.0.5:4318 --workers 8 --mode process --rollout-timeout 90"
        " --path '/srv/my agents'"
    )


@pytest.mark.timing
def test_thread_timeout_is_recorded_on_time_and_the_late_result_dropped(sq_server, sq, caplog):
    provider = _provider(sq_server.url)
    release = threading.Event()
    returned = threading.Event()

    def agent(task, llm):
        if task.get("hang"):
            release.wait(10)
            returned.set()
            return 1.0
        return 0.5

    hung, quick = sq.enqueue_rollouts(
        [{"task_id": "hang", "input": {"hang": True}}, {"task_id": "quick", "input": {}}]
    )
    runner = Runner(agent, sq, provider, workers=1, rollout_timeout_s=0.3).start()
    try:
        start = time.monotonic()
        (timed_out,) = sq.wait_for_rollouts([hung.rollout_id], timeout_s=10, poll_s=0.02)
        took = time.monotonic() - start
        # the one worker slot was replaced: the next rollout runs while the timed-out thread still hangs
        (served,) = sq.wait_for_rollouts([quick.rollout_id], timeout_s=10, poll_s=0.02)
        assert not returned.is_set()
        with caplog.at_level(logging.WARNING, logger="agl_core.runner"):
            release.set()
            assert returned.wait(5)
            time.sleep(0.2)
    finally:
        release.set()
        runner.stop()
    assert timed_out.status == RolloutStatus.TIMED_OUT and took < 1.5
    error = timed_out.attempts[0].error
    assert "RolloutTimeout" in error and "rollout timeout of 0.3 s" in error
    assert "--rollout-timeout" in error and "runner.rollout_timeout_s" in error
    assert served.status == RolloutStatus.SUCCEEDED and served.reward == 0.5
    (after,) = sq.get_rollouts([hung.rollout_id])
    assert after.status == RolloutStatus.TIMED_OUT and after.reward is None  # the late 1.0 was not recorded
    assert any("returned" in r.message and "its result is dropped" in r.message for r in caplog.records)
    (span,) = _error_spans(sq, hung.rollout_id)
    assert span.attributes[semconv.ERROR_TYPE] == "RolloutTimeout" and span.is_error
    rollout_span = next(
        s for s in sq.query_spans(rollout_ids=[hung.rollout_id]) if s.name == semconv.SPAN_ROLLOUT
    )
    assert span.parent_span_id == rollout_span.span_id and rollout_span.is_error
    assert runner.counts.timed_out == 1 and runner.counts.succeeded == 1
    provider.shutdown()


def test_thread_mode_bounds_abandoned_threads(sq, caplog):
    release = threading.Event()

    def agent(task, llm):
        release.wait(10)
        return 1.0

    first, second = sq.enqueue_rollouts([{"task_id": "a"}, {"task_id": "b"}])
    runner = Runner(agent, sq, TracerProvider(), workers=1, rollout_timeout_s=0.2, max_abandoned_threads=1)
    try:
        with caplog.at_level(logging.WARNING, logger="agl_core.runner"):
            runner.start()
            (done,) = sq.wait_for_rollouts([first.rollout_id], timeout_s=10, poll_s=0.02)
            assert done.status == RolloutStatus.TIMED_OUT
            time.sleep(0.4)
            # one abandoned thread is the limit: the second rollout is not taken while it hangs
            (waiting,) = sq.get_rollouts([second.rollout_id])
            assert waiting.status == RolloutStatus.QUEUED
            assert any(
                "still running (the limit is 1)" in r.message and "mode 'process'" in r.message
                for r in caplog.records
            )
            release.set()
            (later,) = sq.wait_for_rollouts([second.rollout_id], timeout_s=10, poll_s=0.02)
            assert later.status == RolloutStatus.SUCCEEDED
    finally:
        release.set()
        runner.stop()


def test_timed_out_and_failed_attempts_are_retried_up_to_max_attempts(sq):
    tries: dict[str, int] = {}
    lock = threading.Lock()

    def agent(task, llm):
        with lock:
            tries[task["name"]] = n = tries.get(task["name"], 0) + 1
        if task["name"] == "slow-once" and n == 1:
            time.sleep(2)
        if task["name"] == "always-fails":
            raise RuntimeError(f"try {n}")
        return 1.0

    slow, failing = sq.enqueue_rollouts(
        [
            {"task_id": "s", "input": {"name": "slow-once"}, "max_attempts": 2},
            {"task_id": "f", "input": {"name": "always-fails"}, "max_attempts": 3},
        ]
    )
    runner = Runner(agent, sq, TracerProvider(), workers=2, rollout_timeout_s=0.3).start()
    try:
        slow_done, failed = sq.wait_for_rollouts(
            [slow.rollout_id, failing.rollout_id], timeout_s=10, poll_s=0.02
        )
    finally:
        runner.stop()
    assert slow_done.status == RolloutStatus.SUCCEEDED and slow_done.reward == 1.0
    assert [a.status for a in slow_done.attempts] == [RolloutStatus.TIMED_OUT, RolloutStatus.SUCCEEDED]
    assert failed.status == RolloutStatus.FAILED and len(failed.attempts) == 3
    assert [a.error.strip().splitlines()[-1] for a in failed.attempts] == [
        "RuntimeError: try 1",
        "RuntimeError: try 2",
        "RuntimeError: try 3",
    ]


@pytest.mark.timing
def test_thread_graceful_stop_finishes_running_rollouts_and_ends_the_rest(sq):
    def agent(task, llm):
        time.sleep(task["sleep"])
        return 1.0

    short, long = sq.enqueue_rollouts(
        [{"task_id": "s", "input": {"sleep": 0.3}}, {"task_id": "l", "input": {"sleep": 5}}]
    )
    runner = Runner(agent, sq, TracerProvider(), workers=2).start()
    while runner.counts.running < 2:
        time.sleep(0.01)
    (later,) = sq.enqueue_rollouts([{"task_id": "later", "input": {"sleep": 0}}])
    start = time.monotonic()
    runner.stop(timeout_s=1.5)
    assert time.monotonic() - start < 3.5
    short_done, long_done, not_taken = sq.get_rollouts([short.rollout_id, long.rollout_id, later.rollout_id])
    assert short_done.status == RolloutStatus.SUCCEEDED
    assert (
        long_done.status == RolloutStatus.FAILED
        and "runner was stopped before the agent finished" in long_done.attempts[0].error
    )
    assert not_taken.status == RolloutStatus.QUEUED


class _CountingStore:
    """The store client with its dequeue requests counted."""

    def __init__(self, client: StoreClient) -> None:
        self._client = client
        self.dequeues = 0

    def dequeue_rollout(self, worker_id: str, *, lease_s: float = 60.0):
        self.dequeues += 1
        return self._client.dequeue_rollout(worker_id, lease_s=lease_s)

    def __getattr__(self, name: str):
        return getattr(self._client, name)


@pytest.mark.timing
def test_idle_workers_take_turns_to_poll_and_a_burst_is_taken_at_once(sq):
    """64 idle workers ask the store about once per poll interval between them, not once each (they did:
    about 1,300 requests a second, which starved the agents of CPU); 64 rollouts queued at once still all
    start together."""
    store = _CountingStore(sq)
    running = threading.Semaphore(0)
    release = threading.Event()

    def agent(task, llm):
        running.release()
        release.wait(10)
        return 1.0

    runner = Runner(agent, store, TracerProvider(), workers=64, poll_s=0.05).start()
    try:
        time.sleep(0.3)  # every worker has asked once by now (or is waiting for its turn)
        before = store.dequeues
        time.sleep(1.0)
        idle = store.dequeues - before
        assert idle <= 30, f"{idle} dequeue requests in 1 s from an idle runner polling every 50 ms"
        queued = sq.enqueue_rollouts([{"task_id": f"t{i}"} for i in range(64)])
        start = time.monotonic()
        for _ in range(64):
            assert running.acquire(timeout=10), "not every queued rollout started"
        assert time.monotonic() - start < 5
        release.set()
        done = sq.wait_for_rollouts([r.rollout_id for r in queued], timeout_s=20, poll_s=0.05)
    finally:
        release.set()
        runner.stop()
    assert all(r.status == RolloutStatus.SUCCEEDED for r in done)


def test_runner_waits_out_a_store_outage(sqlite_store, caplog):
    """Workers started while the store is down back off and retry; they serve work once it is up."""
    app = create_store_app(sqlite_store)
    probe = BackgroundServer(app)
    url, port = probe.url, probe.port
    probe._sock.close()  # reserve a port, then leave it closed: the store is "down"
    client = StoreClient(url, timeout_s=2)
    runner = Runner(lambda task, llm: 2.0, client, TracerProvider(), workers=2, poll_s=0.02)
    with caplog.at_level(logging.WARNING, logger="agl_core.runner"):
        runner.start()
        time.sleep(0.8)
        assert any("retrying with back-off" in r.message for r in caplog.records)
        with BackgroundServer(app, port=port):
            client.put_resource(LLM_RESOURCE, {"base_url": "http://127.0.0.1:9", "model": "m"})
            (queued,) = client.enqueue_rollouts([{"task_id": "t"}])
            (done,) = client.wait_for_rollouts([queued.rollout_id], timeout_s=15, poll_s=0.02)
            runner.stop()
    client.close()
    assert done.status == RolloutStatus.SUCCEEDED and done.reward == 2.0
    assert any("the store answers again" in r.message for r in caplog.records)


def test_runner_heartbeats_keep_long_rollouts_and_cancel_drops_the_result(sq):
    provider = TracerProvider()
    release = threading.Event()
    started = threading.Event()

    def slow_agent(task, llm):
        started.set()
        release.wait(10)
        return 1.0

    (long_one,) = sq.enqueue_rollouts([{"task_id": "long"}])
    runner = Runner(slow_agent, sq, provider, workers=1, lease_s=0.3).start()
    try:
        assert started.wait(10)
        time.sleep(0.8)  # more than two lease lengths: only heartbeats keep it alive
        (state,) = sq.get_rollouts([long_one.rollout_id])
        assert state.status == RolloutStatus.RUNNING
        release.set()
        (done,) = sq.wait_for_rollouts([long_one.rollout_id], timeout_s=10, poll_s=0.02)
        assert done.status == RolloutStatus.SUCCEEDED and done.reward == 1.0

        release.clear()
        started.clear()
        (cancel_me,) = sq.enqueue_rollouts([{"task_id": "cancel"}])
        assert started.wait(10)
        sq.cancel_rollouts([cancel_me.rollout_id])
        time.sleep(0.3)  # the next heartbeat sees the cancellation
        release.set()
        deadline = time.monotonic() + 5
        while runner.counts.dropped < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        (after,) = sq.get_rollouts([cancel_me.rollout_id])
        assert after.status == RolloutStatus.CANCELLED and after.reward is None and runner.counts.dropped == 1
    finally:
        release.set()
        runner.stop()


# --- process mode ---------------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_process_timeout_kills_the_hung_worker_and_a_new_one_serves_on(sq_server, sq, tmp_path):
    provider = _provider(sq_server.url)
    pids = tmp_path / "pids"
    hung, after = sq.enqueue_rollouts(
        [
            {"task_id": "hang", "input": {"hang": True, "pid_file": str(pids)}},
            {"task_id": "next", "input": {"reward": 0.25, "pid_file": str(pids)}},
        ]
    )
    runner = Runner(
        _runner_agents.scripted, sq, provider, workers=1, mode="process", rollout_timeout_s=0.5
    ).start()
    try:
        timed_out, served = sq.wait_for_rollouts(
            [hung.rollout_id, after.rollout_id], timeout_s=20, poll_s=0.02
        )
    finally:
        runner.stop()
    assert timed_out.status == RolloutStatus.TIMED_OUT
    assert "rollout timeout of 0.5 s and its worker process was killed" in timed_out.attempts[0].error
    hung_pid, next_pid = (int(line) for line in pids.read_text().split())
    assert hung_pid != next_pid and not _pid_alive(hung_pid)  # really stopped, and replaced
    assert served.status == RolloutStatus.SUCCEEDED and served.reward == 0.25
    (span,) = _error_spans(sq, hung.rollout_id)
    assert span.attributes[semconv.ERROR_TYPE] == "RolloutTimeout"
    # the reward span the worker process wrote hangs under the rollout span the runner opened
    spans = sq.query_spans(rollout_ids=[after.rollout_id])
    root = next(s for s in spans if s.name == semconv.SPAN_ROLLOUT)
    reward = next(s for s in spans if s.name == semconv.SPAN_REWARD)
    assert reward.parent_span_id == root.span_id and reward.trace_id == root.trace_id
    assert reward.attributes[semconv.ATTEMPT_ID] == served.attempts[0].attempt_id
    provider.shutdown()


def test_process_crash_and_exception_fail_the_attempt_and_the_runner_goes_on(sq_server, sq):
    provider = _provider(sq_server.url)
    crash, segfault, boom, fine = sq.enqueue_rollouts(
        [
            {"task_id": "crash", "input": {"exit": 3}},
            {"task_id": "segfault", "input": {"segfault": True}},
            {"task_id": "boom", "input": {"raise": "agent bug in a process"}},
            {"task_id": "fine", "input": {"reward": 1.0}},
        ]
    )
    runner = Runner(_runner_agents.scripted, sq, provider, workers=1, mode="process").start()
    try:
        crashed, segfaulted, raised, served = sq.wait_for_rollouts(
            [crash.rollout_id, segfault.rollout_id, boom.rollout_id, fine.rollout_id],
            timeout_s=30,
            poll_s=0.02,
        )
    finally:
        runner.stop()
    assert crashed.status == RolloutStatus.FAILED
    assert "exited with code 3 before the agent returned" in crashed.attempts[0].error
    assert segfaulted.status == RolloutStatus.FAILED
    assert "was killed by SIGSEGV before the agent returned" in segfaulted.attempts[0].error
    assert raised.status == RolloutStatus.FAILED
    assert (
        "Traceback" in raised.attempts[0].error
        and "ValueError: agent bug in a process" in raised.attempts[0].error
    )
    assert served.status == RolloutStatus.SUCCEEDED and served.reward == 1.0
    (crash_span,) = _error_spans(sq, crash.rollout_id)
    (boom_span,) = _error_spans(sq, boom.rollout_id)
    assert crash_span.attributes[semconv.ERROR_TYPE] == "ChildProcessError"
    assert boom_span.attributes[semconv.ERROR_TYPE] == "ValueError"
    provider.shutdown()


def test_process_cancel_and_stop_kill_the_running_worker(sq, tmp_path):
    pids = tmp_path / "pids"
    runner = Runner(
        _runner_agents.scripted, sq, TracerProvider(), workers=1, mode="process", lease_s=0.3
    ).start()
    try:
        (cancelled,) = sq.enqueue_rollouts([{"task_id": "c", "input": {"hang": True, "pid_file": str(pids)}}])
        deadline = time.monotonic() + 20
        while not pids.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        sq.cancel_rollouts([cancelled.rollout_id])
        while runner.counts.dropped < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert runner.counts.dropped == 1 and not _pid_alive(int(pids.read_text()))
        pids.unlink()
        (stopped,) = sq.enqueue_rollouts([{"task_id": "s", "input": {"hang": True, "pid_file": str(pids)}}])
        while not pids.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        runner.stop(timeout_s=0.3)
    (after,) = sq.get_rollouts([stopped.rollout_id])
    assert after.status == RolloutStatus.FAILED and "its worker process was killed" in after.attempts[0].error
    assert not _pid_alive(int(pids.read_text()))


def test_async_cancel_in_the_store_cancels_the_task(sq):
    started, cancelled = threading.Event(), threading.Event()

    async def agent(task, llm):
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    (queued,) = sq.enqueue_rollouts([{"task_id": "c"}])
    runner = Runner(agent, sq, TracerProvider(), workers=1, lease_s=0.3).start()
    try:
        assert started.wait(10)
        sq.cancel_rollouts([queued.rollout_id])
        assert cancelled.wait(5)
        deadline = time.monotonic() + 5
        while runner.counts.dropped < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        runner.stop()
    assert runner.counts.dropped == 1
    assert sq.get_rollouts([queued.rollout_id])[0].status == RolloutStatus.CANCELLED


def test_process_mode_runs_async_agents_too(sq_server, sq):
    (queued,) = sq.enqueue_rollouts([{"task_id": "a", "input": {"reward": 0.75, "sleep": 0.01}}])
    runner = Runner(_runner_agents.scripted_async, sq, TracerProvider(), workers=1, mode="process").start()
    try:
        (done,) = sq.wait_for_rollouts([queued.rollout_id], timeout_s=20, poll_s=0.02)
    finally:
        runner.stop()
    assert done.status == RolloutStatus.SUCCEEDED and done.reward == 0.75


# --- async mode -----------------------------------------------------------------------------------------
def test_async_mode_runs_concurrently_cancels_on_timeout_and_captures_errors(sq_server, sq):
    provider = _provider(sq_server.url)
    cancelled = threading.Event()
    together = 0  # the "ok" rollouts running at once

    async def agent(task, llm):
        nonlocal together
        assert current_rollout() is not None
        try:
            if "reward" in task:
                together += 1
                deadline = time.monotonic() + 3
                while together < 4 and time.monotonic() < deadline:  # all four overlap, or this fails below
                    await asyncio.sleep(0.01)
                assert together == 4, "the rollouts did not run concurrently"
            if task.get("hang"):
                await asyncio.sleep(60)
            if task.get("raise"):
                raise KeyError(task["raise"])
            return task.get("reward")
        except asyncio.CancelledError:
            cancelled.set()
            raise

    queued = sq.enqueue_rollouts(
        [{"task_id": f"ok{i}", "input": {"reward": i}} for i in range(4)]
        + [
            {"task_id": "hang", "input": {"hang": True}},
            {"task_id": "raise", "input": {"raise": "missing key"}},
        ]
    )
    runner = Runner(agent, sq, provider, workers=6, rollout_timeout_s=1.0)
    assert runner.mode == "async"
    runner.start()
    try:
        done = sq.wait_for_rollouts([r.rollout_id for r in queued], timeout_s=10, poll_s=0.02)
    finally:
        runner.stop()
    by_task = {r.task_id: r for r in done}
    assert [by_task[f"ok{i}"].reward for i in range(4)] == [0.0, 1.0, 2.0, 3.0]
    assert by_task["hang"].status == RolloutStatus.TIMED_OUT and cancelled.is_set()
    assert "its task was cancelled" in by_task["hang"].attempts[0].error
    assert by_task["raise"].status == RolloutStatus.FAILED
    assert (
        "Traceback" in by_task["raise"].attempts[0].error
        and "KeyError: 'missing key'" in by_task["raise"].attempts[0].error
    )
    (span,) = _error_spans(sq, by_task["hang"].rollout_id)
    assert span.attributes[semconv.ERROR_TYPE] == "RolloutTimeout"
    assert issubclass(RolloutTimeout, TimeoutError)
    provider.shutdown()


def test_async_graceful_stop_cancels_what_outlives_the_grace_period(sq):
    async def agent(task, llm):
        await asyncio.sleep(task["sleep"])
        return 1.0

    short, long = sq.enqueue_rollouts(
        [{"task_id": "s", "input": {"sleep": 0.2}}, {"task_id": "l", "input": {"sleep": 30}}]
    )
    runner = Runner(agent, sq, TracerProvider(), workers=2).start()
    while runner.counts.running < 2:
        time.sleep(0.01)
    runner.stop(timeout_s=1.5)
    short_done, long_done = sq.get_rollouts([short.rollout_id, long.rollout_id])
    assert short_done.status == RolloutStatus.SUCCEEDED
    assert (
        long_done.status == RolloutStatus.FAILED and "its task was cancelled" in long_done.attempts[0].error
    )


@pytest.mark.parametrize("mode", ["async", "thread"])
def test_a_stop_with_a_reason_cancels_what_still_runs_and_says_so_without_a_warning(sq, mode, caplog):
    """A training run that ends with rollouts in flight (async training draws ahead) stops its runner on
    purpose: those rollouts are cancelled, not failed, and no warning follows the run's end."""
    if mode == "async":

        async def agent(task, llm):
            await asyncio.sleep(task["sleep"])
            return 1.0

    else:
        release = threading.Event()

        def agent(task, llm):
            release.wait(task["sleep"])
            return 1.0

    (long,) = sq.enqueue_rollouts([{"task_id": "l", "input": {"sleep": 30}}])
    runner = Runner(agent, sq, TracerProvider(), workers=1).start()
    while runner.counts.running < 1:
        time.sleep(0.01)
    with caplog.at_level(logging.INFO, logger="agl_core.runner"):
        runner.stop(timeout_s=0.3, reason="the training run is over")
    (done,) = sq.get_rollouts([long.rollout_id])
    assert done.status == RolloutStatus.CANCELLED
    assert "cancelled: the training run is over" in done.attempts[0].error
    assert "cancelling 1 rollout(s) still running: the training run is over" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    if mode == "thread":
        release.set()


def test_worker_processes_import_neither_the_store_nor_the_gateway():
    """A fresh worker process (started at each timeout or crash) must be ready quickly."""
    import subprocess
    import sys

    code = (
        "import sys, agl_core.runner._worker\n"
        "print([m for m in ('agl_core.store', 'agl_core.gateway', 'httpx', 'starlette') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_agents_are_told_which_split_a_rollout_is_for(store_server, client, mode):
    client.put_resource(LLM_RESOURCE, {"base_url": "http://127.0.0.1:9", "model": "m"})
    queued = client.enqueue_rollouts(
        [
            {"task_id": "a", "input": {"n": 0}, "metadata": {"split": "val", "step": 0}},
            {"task_id": "b", "input": {"n": 1}, "metadata": {"split": "train", "step": 1}},
            {"task_id": "c", "input": {"n": 2}},
            {"task_id": "d", "input": {"n": 3}, "metadata": {"split": 7}},  # not a name: no split
        ]
    )
    provider = _provider(store_server.url)
    runner = Runner(_runner_agents.split_reward, client, provider, workers=2, mode=mode).start()
    try:
        done = client.wait_for_rollouts([r.rollout_id for r in queued], timeout_s=60)
    finally:
        runner.stop()
    assert all(r.status == RolloutStatus.SUCCEEDED for r in done), [r.attempts[-1].error for r in done]
    # the agent encodes what it saw in its reward: 1 = evaluating on "val", 0.5 = "train", 0 = no split
    rewards = episode_rewards(client.query_spans(rollout_ids=[r.rollout_id for r in done]))
    assert {r.task_id: rewards[r.rollout_id] for r in done} == {"a": 1.0, "b": 0.5, "c": 0.0, "d": 0.0}
    provider.shutdown()


class _SlowFlushes:
    """A tracer provider whose force_flush takes 50 ms and records when each one began and ended."""

    def __init__(self) -> None:
        self.flushes: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        began = time.monotonic()
        time.sleep(0.05)
        with self._lock:
            self.flushes.append((began, time.monotonic()))
        return True


def test_workers_finishing_together_share_span_exports_and_each_waits_for_one_begun_after_it():
    from agl_core.runner._state import RunState

    provider = _SlowFlushes()
    state = RunState(
        lambda task, llm: 1.0,
        StoreClient("http://127.0.0.1:9"),  # never called here
        provider,  # type: ignore[arg-type]
        workers=12,
        rollout_timeout_s=None,
        poll_s=0.1,
        lease_s=30.0,
    )
    calls: list[tuple[float, float]] = []
    lock = threading.Lock()

    def finish() -> None:
        asked = time.monotonic()
        state.flush()
        with lock:
            calls.append((asked, time.monotonic()))

    threads = [threading.Thread(target=finish) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)

    assert len(calls) == 12
    # one export per worker would take 12 x 50 ms; together they need at most two
    assert len(provider.flushes) <= 3, provider.flushes
    # each worker's spans were exported by a flush that began after it asked
    for asked, returned in calls:
        covered = [(b, e) for b, e in provider.flushes if asked <= b and e <= returned]
        assert covered, (asked, returned, provider.flushes)
