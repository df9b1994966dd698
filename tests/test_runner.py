from __future__ import annotations

import threading
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from agl_core import semconv
from agl_core.records import RolloutStatus
from agl_core.runner import LLM_RESOURCE, Runner, load_agent
from agl_core.store import StoreError
from agl_core.tracing import current_rollout, make_otlp_exporter
from agl_core.transitions import episode_rewards


def test_runner_runs_agents_concurrently_and_captures_failures(store_server, client):
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(make_otlp_exporter(store_server.url)))
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
    assert status == {0: RolloutStatus.SUCCEEDED, 1: RolloutStatus.SUCCEEDED, 2: RolloutStatus.SUCCEEDED,
                      3: RolloutStatus.FAILED, 4: RolloutStatus.FAILED, 5: RolloutStatus.SUCCEEDED}
    failed = next(r for r in done if r.input["n"] == 3)
    assert "ZeroDivisionError: agent bug" in failed.attempts[0].error and "Traceback" in failed.attempts[0].error
    # each rollout got its own rollout-scoped endpoint and the published policy version
    for r in done:
        base_url, version, task = seen[r.rollout_id]
        assert base_url == f"http://127.0.0.1:9/rollouts/{r.rollout_id}/attempts/{r.attempts[0].attempt_id}/v1"
        assert version == 4 and task == r.input
    spans = client.query_spans(rollout_ids=[r.rollout_id for r in done])
    rewards = episode_rewards(spans)
    assert {next(r.input["n"] for r in done if r.rollout_id == rid): v for rid, v in rewards.items()} == {
        0: 0.0, 1: 0.1, 2: 0.2, 5: 0.5
    }
    errors = [s for s in spans if s.name == semconv.SPAN_ERROR]
    assert len(errors) == 2 and all(s.is_error for s in errors)
    provider.shutdown()


def test_runner_without_llm_resource_fails_clearly(client):
    provider = TracerProvider()
    runner = Runner(lambda task, llm: 1.0, client, provider)
    (queued,) = client.enqueue_rollouts([{"task_id": "t"}])
    rollout, attempt = client.dequeue_rollout("w")
    with pytest.raises(StoreError, match="no 'llm' resource"):
        runner.run_one(rollout, attempt)


def test_load_agent_errors():
    with pytest.raises(ValueError, match="module:function"):
        load_agent("nocolon")
    with pytest.raises(ValueError, match="cannot import"):
        load_agent("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no callable 'nope'"):
        load_agent("json:nope")
    assert load_agent("json:dumps")([1]) == "[1]"


def test_runner_heartbeats_keep_long_rollouts_and_cancel_drops_the_result(store_server, client):
    provider = TracerProvider()
    client.put_resource(LLM_RESOURCE, {"base_url": "http://127.0.0.1:9", "model": "m"})
    release = threading.Event()
    started = threading.Event()

    def slow_agent(task, llm):
        started.set()
        release.wait(10)
        return 1.0

    (long_one,) = client.enqueue_rollouts([{"task_id": "long"}])
    runner = Runner(slow_agent, client, provider, workers=1, lease_s=0.3).start()
    try:
        assert started.wait(10)
        time.sleep(1.0)  # three lease lengths: only heartbeats keep it alive
        (state,) = client.get_rollouts([long_one.rollout_id])
        assert state.status == RolloutStatus.RUNNING
        release.set()
        (done,) = client.wait_for_rollouts([long_one.rollout_id], timeout_s=10)
        assert done.status == RolloutStatus.SUCCEEDED and done.reward == 1.0

        release.clear()
        started.clear()
        (cancel_me,) = client.enqueue_rollouts([{"task_id": "cancel"}])
        assert started.wait(10)
        client.cancel_rollouts([cancel_me.rollout_id])
        time.sleep(0.5)  # the next heartbeat sees the cancellation
        release.set()
        time.sleep(0.5)
        (after,) = client.get_rollouts([cancel_me.rollout_id])
        assert after.status == RolloutStatus.CANCELLED and after.reward is None
    finally:
        release.set()
        runner.stop()
    provider.shutdown()
