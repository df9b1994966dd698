"""Late rewards: attached to a rollout, trace or span after it ran, through the real store (SQLite and
PostgreSQL), its HTTP API, ``StoreClient``, ``agl reward`` and ``emit_reward``; credit reads them exactly as
rewards emitted during the rollout."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agl_core
from agl_core import emit_reward, rollout_scope, semconv
from agl_core.pipeline.credit import EXPLICIT, assign_rewards
from agl_core.pipeline.rewards import (
    Reward,
    StoredReward,
    format_time,
    parse_time,
    reward_span_id,
    reward_trace_id,
)
from agl_core.pipeline.spantree import TOOL, is_gateway_llm, kind_of
from agl_core.pipeline.transitions import episode_rewards, spans_to_transitions
from agl_core.records import Span, Transition
from agl_core.runner import LLM_RESOURCE, Runner
from agl_core.server import BackgroundServer
from agl_core.store import AsyncStoreClient, NotFoundError, SqliteStore, StoreClient, StoreError
from agl_core.store.redact import parse_rules
from agl_core.store.server import create_store_app
from agl_core.testing import AglTestStack, Collector, tool_call
from agl_trainer.learning.algo import compute_advantages

from .conftest import make_span

R = semconv
TASK = "t-late"


def _rollout(store: Any, rollout_id: str = "ro-1") -> tuple[Span, Span]:
    """A queued rollout with a root span and one LLM-ish child span, stored directly."""
    store.enqueue_rollouts([{"task_id": TASK, "input": None, "rollout_id": rollout_id}])
    identity = {R.ROLLOUT_ID: rollout_id, R.ATTEMPT_ID: f"{rollout_id}-a1", R.TASK_ID: TASK}
    root = make_span(R.SPAN_ROLLOUT, identity)
    child = make_span("step", identity, parent=root)
    store.add_spans([root, child])
    return root, child


# --- the store's API, on SQLite and PostgreSQL --------------------------------------------------------
def test_a_late_episode_reward_joins_the_rollout_trace_once_and_a_changed_one_is_refused(store, client):
    root, _ = _rollout(store)
    when = datetime(2025, 1, 31, 12, tzinfo=timezone.utc)
    first = client.add_reward(0.7, rollout_id="ro-1", reward_id="thumbs-1", source="user", time=when)
    assert first.created and first.rollout_id == "ro-1"
    assert (first.trace_id, first.parent_span_id) == (root.trace_id, root.span_id)
    assert first.span_id == reward_span_id("thumbs-1")
    assert format_time(first.time_ns) == "2025-01-31T12:00:00.000000Z"

    again = client.add_reward(0.7, rollout_id="ro-1", reward_id="thumbs-1", source="user")
    assert not again.created and again.time_ns == first.time_ns  # the first one's time stays
    (span,) = [s for s in client.query_spans(rollout_ids=["ro-1"]) if s.name == R.SPAN_REWARD]
    assert (span.trace_id, span.span_id, span.parent_span_id) == (root.trace_id, first.span_id, root.span_id)
    assert (span.start_ns, span.end_ns) == (first.time_ns, first.time_ns)
    assert dict(span.attributes) == {
        R.ROLLOUT_ID: "ro-1",
        R.ATTEMPT_ID: "ro-1-a1",
        R.TASK_ID: TASK,
        R.REWARD_VALUE: 0.7,
        R.REWARD_NAME: "episode",
        R.REWARD_SOURCE: "user",
        R.REWARD_ID: "thumbs-1",
    }
    assert client.get_rollouts(["ro-1"])[0].reward == 0.7

    with pytest.raises(StoreError, match=r"HTTP 409: reward id 'thumbs-1' is already stored as a different"):
        client.add_reward(0.8, rollout_id="ro-1", reward_id="thumbs-1", source="user")
    with pytest.raises(StoreError, match="409"):  # another target is another reward too
        client.add_reward(0.7, trace_id=root.trace_id, reward_id="thumbs-1", source="user")
    # all or none: the batch with the conflict stored nothing
    with pytest.raises(StoreError, match="409"):
        client.add_rewards(
            [Reward("new-1", 1.0, rollout_id="ro-1"), Reward("thumbs-1", 0.1, rollout_id="ro-1")]
        )
    assert len([s for s in client.query_spans(rollout_ids=["ro-1"]) if s.name == R.SPAN_REWARD]) == 1


def test_the_latest_episode_reward_by_time_wins(store, client):
    _rollout(store)
    t0 = parse_time("2025-01-31T12:00:00Z")
    client.add_rewards([Reward("r-noon", 1.0, time_ns=t0, rollout_id="ro-1")])
    client.add_rewards([Reward("r-earlier", 0.0, time_ns=t0 - 10**9, rollout_id="ro-1")])  # posted later
    spans = client.query_spans(rollout_ids=["ro-1"])
    assert episode_rewards(spans) == {"ro-1": 1.0}
    assert client.get_rollouts(["ro-1"])[0].reward == 1.0
    client.add_rewards([Reward("r-later", 0.25, time_ns=t0 + 10**9, rollout_id="ro-1")])
    assert episode_rewards(client.query_spans(rollout_ids=["ro-1"])) == {"ro-1": 0.25}
    assert client.get_rollouts(["ro-1"])[0].reward == 0.25


def test_trace_and_span_targets_and_unknown_ones(store, client):
    root, child = _rollout(store)
    on_trace = client.add_reward(0.5, trace_id=root.trace_id, name="judge", reward_id="r-trace")
    assert (on_trace.rollout_id, on_trace.parent_span_id) == ("ro-1", root.span_id)
    on_span = client.add_reward(
        -1.0, span_id=child.span_id, rollout_id="ro-1", name="step", reward_id="r-span"
    )
    assert (on_span.trace_id, on_span.parent_span_id) == (child.trace_id, child.span_id)
    by_trace = client.add_reward(
        2.0, span_id=child.span_id, trace_id=child.trace_id, name="s", reward_id="r-s2"
    )
    assert by_trace.parent_span_id == child.span_id

    # a rollout known only by its spans (no queue row) is a rollout too
    stray = make_span("x", {R.ROLLOUT_ID: "ro-spans-only"})
    store.add_spans([stray])
    alone = client.add_reward(1.0, rollout_id="ro-spans-only", reward_id="r-alone")
    assert (alone.trace_id, alone.parent_span_id) == (reward_trace_id("r-alone"), None)
    # a queued rollout without spans yet: its reward starts a trace of its own
    store.enqueue_rollouts([{"task_id": TASK, "input": None, "rollout_id": "ro-queued"}])
    assert client.add_reward(1.0, rollout_id="ro-queued", reward_id="r-q").parent_span_id is None

    missing = [
        (
            {"rollout_id": "ro-nope"},
            "no rollout 'ro-nope': the store has neither queued it nor received a span",
        ),
        ({"trace_id": "f" * 32}, f"the store holds no span of trace {'f' * 32}"),
        ({"span_id": "e" * 16, "rollout_id": "ro-1"}, f"holds no span {'e' * 16} of rollout 'ro-1'"),
        ({"span_id": child.span_id, "trace_id": "f" * 32}, f"no span {child.span_id} in trace {'f' * 32}"),
        ({"trace_id": root.trace_id, "rollout_id": "ro-other"}, "no span of rollout 'ro-other' in trace"),
    ]
    for n, (target, message) in enumerate(missing):
        with pytest.raises(NotFoundError, match="HTTP 404: .*" + re.escape(message)):
            client.add_reward(1.0, reward_id=f"r-missing-{n}", **target)
    assert not any(s.attributes.get(R.REWARD_ID, "").startswith("r-missing") for s in store.query_spans())


def test_retention_takes_a_late_rewards_id_with_its_span(sqlite_store):
    _rollout(sqlite_store)
    old = parse_time("2001-01-01T00:00:00Z")
    sqlite_store.add_rewards([Reward("r-old", 1.0, time_ns=old, rollout_id="ro-1")])
    assert sqlite_store.apply_retention(max_age_s=86_400) >= 1
    again = sqlite_store.add_rewards([Reward("r-old", 2.0, time_ns=old, rollout_id="ro-1")])
    assert again[0].created  # the id went with its span


@pytest.fixture
def api(tmp_path) -> Iterator[Collector]:
    with Collector(path=tmp_path / "api.sqlite", token="s3cret") as collector:
        _rollout(collector.store)
        yield collector


def _post(collector: Collector, body: Any, token: str | None = "s3cret") -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.post(collector.url + "/api/rewards", json=body, headers=headers)


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ({"value": 1.0, "rollout_id": "ro-1"}, "rewards.0.reward_id: Field required"),
        (
            {"reward_id": "r", "value": "1", "rollout_id": "ro-1"},
            "rewards.0.value: must be a number, got str",
        ),
        (
            {"reward_id": "r", "value": True, "rollout_id": "ro-1"},
            "rewards.0.value: must be a number, got bool",
        ),
        ({"reward_id": "r", "value": 1.0}, "rewards.0.target: give rollout_id, trace_id, or span_id"),
        (
            {"reward_id": "r", "value": 1.0, "span_id": "a" * 16},
            "rewards.0.span_id: a span id is unique only",
        ),
        (
            {"reward_id": "r", "value": 1.0, "rollout_id": "ro-1", "name": "thumbs up"},
            "rewards.0.name: 'thumbs up'",
        ),
        (
            {"reward_id": "r", "value": 1.0, "rollout_id": "ro-1", "name": "é"},
            "rewards.0.name: 'é' is not a reward",
        ),
        (
            {"reward_id": "r" * 129, "value": 1.0, "rollout_id": "ro-1"},
            "rewards.0.reward_id: String should have at",
        ),
        ({"reward_id": "r\x00", "value": 1.0, "rollout_id": "ro-1"}, "rewards.0.reward_id: contains a NUL"),
        ({"reward_id": "r", "value": 1.0, "rollout_id": "ro\x001"}, "rewards.0.rollout_id: contains a NUL"),
        (
            {"reward_id": "r", "value": 1.0, "rollout_id": "r" * 513},
            "rewards.0.rollout_id: String should have",
        ),
        (
            {"reward_id": "r", "value": 1.0, "trace_id": "xyz"},
            "rewards.0.trace_id: must be 32 hex characters",
        ),
        ({"reward_id": "r", "value": 1.0, "trace_id": "0" * 32}, "rewards.0.trace_id: must not be all zeros"),
        (
            {"reward_id": "r", "value": 1.0, "rollout_id": "ro-1", "time": "yesterday"},
            "rewards.0.time: 'yesterday'",
        ),
        (
            {"reward_id": "r", "value": 1.0, "rollout_id": "ro-1", "time": "2025-01-31T12:00:00"},
            "has no timezone",
        ),
        (
            {"reward_id": "r", "value": 1.0, "rollout_id": "ro-1", "time": "2200-01-01T00:00:00Z"},
            "in the future",
        ),
        ({"reward_id": "r", "value": 1.0, "rollout_id": "ro-1", "colour": "red"}, "rewards.0.colour: Extra"),
    ],
)
def test_bad_rewards_are_refused_with_400_naming_the_field(api, reward, message):
    response = _post(api, {"rewards": [reward]})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


_FIELDS = ["reward_id", "value", "name", "source", "time", "rollout_id", "trace_id", "span_id", "x"]
_ids = st.one_of(st.sampled_from(["ro-1", "r-1", "a" * 32, "b" * 16]), st.text(max_size=40))
_reward_items = st.dictionaries(
    st.sampled_from(_FIELDS),
    st.one_of(
        _ids, st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.none()
    ),
    max_size=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(_reward_items, min_size=1, max_size=3))
def test_any_rewards_body_gets_an_answer_not_a_server_error(api, items):
    response = _post(api, {"rewards": items})
    assert response.status_code in (200, 400, 404, 409), response.text[:300]


def test_the_endpoint_needs_the_token_and_a_body(api):
    good = {"rewards": [{"reward_id": "r-tok", "value": 1, "rollout_id": "ro-1"}]}
    assert _post(api, good, token=None).status_code == 401
    assert _post(api, good, token="wrong").status_code == 401
    assert _post(api, {"rewards": []}).status_code == 400
    for value, message in [(b"NaN", "NaN is not a JSON number"), (b"1e999", "out of range for a number")]:
        response = httpx.post(
            api.url + "/api/rewards",
            content=b'{"rewards": [{"reward_id": "r", "value": %s, "rollout_id": "ro-1"}]}' % value,
            headers={"authorization": "Bearer s3cret", "content-type": "application/json"},
        )
        assert response.status_code == 400 and message in response.json()["error"]["message"]
    response = _post(api, good)
    assert response.status_code == 200
    (answer,) = response.json()["rewards"]
    assert answer["created"] and answer["attached_to"]["rollout_id"] == "ro-1"
    assert _post(api, good).json()["rewards"][0]["created"] is False
    assert _post(api, {"rewards": [{**good["rewards"][0], "value": 2}]}).status_code == 409


def test_redaction_rules_apply_to_the_source_and_name(tmp_path):
    store = SqliteStore(tmp_path / "r.sqlite")
    _rollout(store)
    server = BackgroundServer(
        create_store_app(store, redactor=parse_rules(["email", "regex:secret[0-9]+"]))
    ).start()
    try:
        with StoreClient(server.url) as client:
            stored = client.add_reward(
                1.0, rollout_id="ro-1", source="grader ann@example.com", reward_id="r-e"
            )
            assert stored.requested.source == "grader [REDACTED]"
            with pytest.raises(
                StoreError, match="HTTP 400: .*rewards.0.name: .* matches the store's redaction"
            ):
                client.add_reward(1.0, rollout_id="ro-1", name="secret42", reward_id="r-n")
        (span,) = [s for s in store.query_spans(rollout_ids=["ro-1"]) if s.name == R.SPAN_REWARD]
        assert span.attributes[R.REWARD_SOURCE] == "grader [REDACTED]"
    finally:
        server.stop()
        store.close()


def test_the_async_client_adds_rewards(api):
    async def post() -> StoredReward:
        async with AsyncStoreClient(api.url, token="s3cret") as client:
            return await client.add_reward(0.5, rollout_id="ro-1", reward_id="r-async", source="grader")

    stored = asyncio.run(post())
    assert stored.created and stored.requested.source == "grader"


# --- emit_reward outside a rollout ---------------------------------------------------------------------
def test_emit_reward_outside_a_rollout_needs_a_target(api, monkeypatch, caplog):
    # without a target the agent keeps running: a warning says how to attach the reward
    monkeypatch.setattr(agl_core.tracing, "_warned_outside_rollout", False)
    with caplog.at_level("WARNING", logger="agl_core.tracing"):
        assert emit_reward(1.0) is None
    assert "outside a rollout" in caplog.text and "pass rollout_id=..." in caplog.text
    stored = emit_reward(0.9, rollout_id="ro-1", reward_id="r-emit", store=api.url, token="s3cret")
    assert stored is not None and stored.created and stored.rollout_id == "ro-1"
    monkeypatch.setenv("AGL_STORE_URL", api.url)
    monkeypatch.setenv("AGL_STORE_TOKEN", "s3cret")
    again = emit_reward(0.9, rollout_id="ro-1", reward_id="r-emit")
    assert again is not None and not again.created
    with StoreClient(api.url, token="s3cret") as client:
        on_store = emit_reward(0.1, name="late", rollout_id="ro-1", store=client, source="tests")
    assert on_store is not None and on_store.requested.source == "tests"
    direct = emit_reward(0.2, rollout_id="ro-1", reward_id="r-direct", store=api.store)  # a store backend
    assert direct is not None and direct.created
    with pytest.raises(ValueError, match="value: must be a finite number"):
        emit_reward(float("nan"), rollout_id="ro-1", store=api.url)
    with pytest.raises(ValueError, match="attributes are recorded only"):
        emit_reward(1.0, rollout_id="ro-1", attributes={"a": 1}, store=api.url)
    with pytest.raises(NotFoundError, match="ro-unknown"):
        emit_reward(1.0, rollout_id="ro-unknown", store=api.url, token="s3cret")


def test_emit_reward_inside_a_rollout_is_unchanged(agl_collector):
    provider = agl_collector.tracer_provider()
    with rollout_scope("ro-in", "at-1", "task", tracer_provider=provider):
        assert emit_reward(0.5, tracer_provider=provider) is None
    (span,) = [s for s in agl_collector.spans("ro-in") if s.name == R.SPAN_REWARD]
    assert dict(span.attributes) == {
        R.ROLLOUT_ID: "ro-in",
        R.ATTEMPT_ID: "at-1",
        R.TASK_ID: "task",
        R.REWARD_VALUE: 0.5,
        R.REWARD_NAME: "episode",
    }


# --- agl reward -----------------------------------------------------------------------------------------
def _cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AGL_STORE")}
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "agl_core.cli", "reward", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
    )


def test_agl_reward_on_a_sqlite_file(tmp_path):
    path = tmp_path / "cli.sqlite"
    store = SqliteStore(path)
    root, child = _rollout(store)
    store.close()

    done = _cli(
        "ro-1",
        "1",
        "--id",
        "r-cli",
        "--source",
        "tests",
        "--time",
        "2025-01-31T12:00:00Z",
        "--store",
        str(path),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "attached reward r-cli (episode = 1, source 'tests') to rollout 'ro-1':"
        f" span {reward_span_id('r-cli')} in trace {root.trace_id} under span {root.span_id},"
        " at 2025-01-31T12:00:00.000000Z"
    )
    again = _cli("ro-1", "1", "--id", "r-cli", "--source", "tests", "--store", str(path))
    assert again.returncode == 0 and again.stdout.startswith("already stored, unchanged: reward r-cli")
    changed = _cli("ro-1", "0", "--id", "r-cli", "--source", "tests", "--store", str(path))
    assert (
        changed.returncode == 1
        and "reward id 'r-cli' is already stored as a different reward" in changed.stderr
    )
    on_span = _cli("ro-1", "-0.5", "--name", "step", "--span", child.span_id, "--store", str(path))
    assert on_span.returncode == 0, on_span.stderr
    assert (
        f"to span {child.span_id} of rollout 'ro-1'" in on_span.stdout
        and "attached reward rw-" in on_span.stdout
    )

    unknown = _cli("ro-nope", "1", "--store", str(path))
    assert unknown.returncode == 1 and "no rollout 'ro-nope'" in unknown.stderr
    store = SqliteStore(path)
    try:
        assert store.get_rollouts(["ro-1"])[0].reward == 1.0
        assert len([s for s in store.query_spans(rollout_ids=["ro-1"]) if s.name == R.SPAN_REWARD]) == 2
    finally:
        store.close()


def _three_rollouts(path: Path) -> Path:
    """A SQLite store at ``path`` holding rollouts ro-0, ro-1 and ro-2."""
    store = SqliteStore(path)
    for i in range(3):
        _rollout(store, f"ro-{i}")
    store.close()
    return path


def test_agl_reward_file_attaches_many_once_and_reports_each_bad_line(tmp_path):
    path = _three_rollouts(tmp_path / "cli.sqlite")
    feedback = tmp_path / "feedback.jsonl"
    feedback.write_text(
        "\n".join(
            [
                '{"rollout_id": "ro-0", "value": 1}',
                '{"rollout_id": "ro-1", "value": 0.5, "source": "reviewer", "time": "2025-01-31T12:00:00Z"}',
                "",
                "{not json",
                '{"rollout_id": "ro-2"}',
                '{"rollout_id": "ro-2", "value": 1, "colour": "red"}',
                '{"rollout_id": "ro-nope", "value": 1}',
                '{"rollout_id": "ro-2", "value": "high"}',
                '{"rollout_id": "ro-2", "value": 0, "id": "mine"}',
            ]
        )
        + "\n"
    )
    first = _cli("--file", str(feedback), "--source", "app", "--store", str(path))
    assert first.returncode == 1  # some lines skipped, the rest attached
    assert (
        first.stdout.strip()
        == "attached 3 reward(s) from " + str(feedback) + " (0 already stored, unchanged); skipped 5 line(s)"
    )
    for number, why in (
        (4, "not JSON"),
        (5, "no 'value'"),
        (6, "unknown field 'colour'"),
        (7, "no rollout 'ro-nope'"),
        (8, "value: must be a number"),
    ):
        assert f"{feedback}:{number}: {why}" in first.stderr, first.stderr
    again = _cli("--file", str(feedback), "--source", "app", "--store", str(path))
    assert again.stdout.startswith("attached 0 reward(s)") and "(3 already stored, unchanged)" in again.stdout
    both = _cli("ro-0", "1", "--file", str(feedback), "--store", str(path))
    assert both.returncode == 2 and "--file gives every reward's fields; drop ROLLOUT_ID" in both.stderr
    neither = _cli("--store", str(path))
    assert neither.returncode == 2 and "give ROLLOUT_ID and VALUE, or --file PATH" in neither.stderr
    store = SqliteStore(path)
    try:
        assert [r.reward for r in store.get_rollouts(["ro-0", "ro-1", "ro-2"])] == [1.0, 0.5, 0.0]
        sources = {
            s.attributes.get(R.REWARD_SOURCE)
            for s in store.query_spans(limit=1000)
            if s.name == R.SPAN_REWARD
        }
        assert sources == {"app", "reviewer"}
    finally:
        store.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("ro-1", "nan"), "agl reward: VALUE: must be a finite number"),
        (("ro-1", "one"), "agl reward: VALUE 'one' is not a number"),
        (("ro-1", "1", "--time", "noon"), "agl reward: --time: 'noon' is not an ISO 8601 time"),
        (
            ("ro-1", "1", "--time", "2025-01-31T12:00"),
            "agl reward: --time: '2025-01-31T12:00' has no timezone",
        ),
        (("ro-1", "1", "--span", "xyz"), "agl reward: --span: must be 16 hex characters"),
        (("ro-1", "1", "--trace", "0" * 32), "agl reward: --trace: must not be all zeros"),
        (("ro-1", "1", "--name", "a b"), "agl reward: --name: 'a b' is not a reward name"),
        (("ro-1", "1", "--id", "x" * 129), "agl reward: --id: 129 characters long, more than 128"),
        (("ro-1", "1", "--store", "missing.sqlite"), "missing.sqlite is neither a store URL"),
    ],
)
def test_agl_reward_refuses_bad_input_with_exit_2(args, message, capsys, tmp_path, monkeypatch):
    from agl_core.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["reward", *args]) == 2
    assert message in capsys.readouterr().err


def test_agl_reward_against_a_served_store_with_a_token(api):
    env = {"AGL_STORE_URL": api.url}
    refused = _cli("ro-1", "0.5", "--id", "r-served", env=env)
    assert refused.returncode == 1 and "HTTP 401" in refused.stderr
    done = _cli("ro-1", "0.5", "--id", "r-served", "--token", "s3cret", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("attached reward r-served (episode = 0.5, source 'cli') to rollout 'ro-1'")
    by_env = _cli("ro-1", "0.5", "--id", "r-served", env={**env, "AGL_STORE_TOKEN": "s3cret"})
    assert by_env.returncode == 0 and by_env.stdout.startswith("already stored, unchanged")
    assert api.store.get_rollouts(["ro-1"])[0].reward == 0.5


# --- end to end: the real gateway and runner, credit and advantages ------------------------------------
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look something up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}
TOOL_REWARD, STYLE_REWARD = 0.3, -0.1


def _policy(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> str:
    return "It is a library." if messages[-1]["role"] == "tool" else tool_call("lookup", {"q": "agl"})


def _agent(provider: Any) -> Any:
    """Two LLM calls around one tool call. During the rollout (``late`` false) it emits a named reward
    inside the tool call, one after the second call, and returns its episode reward; with ``late`` it
    emits nothing and returns None, and the test attaches the same rewards afterwards."""

    def solve(task: dict[str, Any], llm: Any) -> float | None:
        client = openai.OpenAI(base_url=llm.base_url, api_key="x", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "What is agl?"}]
        first = client.chat.completions.create(model=llm.model, messages=messages, tools=[LOOKUP])
        message = first.choices[0].message
        assert message.tool_calls
        messages.append(message.model_dump(exclude_none=True))
        call = message.tool_calls[0]
        with agl_core.tool_call("lookup", call_id=call.id, tracer_provider=provider):
            if not task["late"]:
                emit_reward(TOOL_REWARD, name="lookup_quality", tracer_provider=provider)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "a library"})
        client.chat.completions.create(model=llm.model, messages=messages, tools=[LOOKUP])
        if not task["late"]:
            emit_reward(STYLE_REWARD, name="style", tracer_provider=provider)
        return None if task["late"] else float(task["reward"])

    return solve


def _plain(t: Transition) -> Transition:
    return dataclasses.replace(t, rollout_id="", attempt_id=None, span_id=None)


def test_late_rewards_give_the_same_transitions_credit_and_advantages_as_rewards_during_the_rollout(store):
    with AglTestStack(script=_policy, store=store) as stack:
        client = stack.client
        client.put_resource(LLM_RESOURCE, {"base_url": stack.gateway_url, "model": "scripted"})
        requests = [
            {"task_id": TASK, "input": {"late": late, "reward": reward}, "group_id": f"g-{late}"}
            for late in (False, True)
            for reward in (1.0, 0.0)
        ]
        queued = client.enqueue_rollouts(requests)
        runner = Runner(_agent(stack.provider), client, stack.provider).start()
        try:
            done = client.wait_for_rollouts([r.rollout_id for r in queued], timeout_s=60)
        finally:
            runner.stop()
        assert [r.status.value for r in done] == ["succeeded"] * 4, [r.attempts[-1].error for r in done]
        during, late = [r.rollout_id for r in done[:2]], [r.rollout_id for r in done[2:]]

        before = stack.spans(late[0])
        assert spans_to_transitions(before).reasons() == {"rollout has no episode reward": 1}
        for rollout_id, reward in zip(late, (1.0, 0.0), strict=True):
            spans = stack.spans(rollout_id)
            tool = next(s for s in spans if kind_of(s) == TOOL)
            second = sorted((s for s in spans if is_gateway_llm(s)), key=lambda s: s.start_ns)[1]
            stored = client.add_rewards(
                [
                    Reward(f"{rollout_id}-ep", reward, source="tests", rollout_id=rollout_id),
                    Reward(
                        f"{rollout_id}-tool",
                        TOOL_REWARD,
                        "lookup_quality",
                        span_id=tool.span_id,
                        rollout_id=rollout_id,
                    ),
                    Reward(
                        f"{rollout_id}-style",
                        STYLE_REWARD,
                        "style",
                        span_id=second.span_id,
                        trace_id=second.trace_id,
                    ),
                ]
            )
            assert [s.parent_span_id for s in stored[1:]] == [tool.span_id, second.span_id]
            assert client.get_rollouts([rollout_id])[0].reward == reward
        spans_of = {rid: stack.spans(rid) for rid in during + late}

    def credit(rollout_ids: list[str]) -> tuple[list[Transition], list[Any], list[tuple[Any, float]]]:
        spans = [s for rid in rollout_ids for s in spans_of[rid]]
        result = spans_to_transitions(spans)
        assert result.problems == ()
        rewarded = assign_rewards(result, spans)
        group = {rid: "g" for rid in rollout_ids}
        advantages, _ = compute_advantages(rewarded.transitions, group, scores=rewarded.scores)
        events = [(e.kind, e.call_index, e.value, e.label) for e in rewarded.applied]
        return (
            [_plain(t) for t in result.transitions],
            [(_plain(t), events) for t in rewarded.transitions],
            [(_plain(a.transition), a.advantage) for a in advantages],
        )

    assert credit(late) == credit(during)
    transitions, rewarded, advantages = credit(late)
    assert [t.reward for t in transitions] == [1.0, 1.0, 0.0, 0.0]
    # the tool's reward on the call that requested the tool, the style reward on the second call
    assert [t.reward for t, _ in rewarded] == [
        1.0 + TOOL_REWARD,
        1.0 + STYLE_REWARD,
        TOOL_REWARD,
        STYLE_REWARD,
    ]
    assert rewarded[0][1][:2] == [
        (EXPLICIT, 0, TOOL_REWARD, "lookup_quality"),
        (EXPLICIT, 1, STYLE_REWARD, "style"),
    ]
    assert advantages[0][1] > 0 > advantages[2][1]


def test_agl_reward_file_skips_a_nesting_bomb_and_an_overlong_line_and_keeps_the_rest(tmp_path):
    path = _three_rollouts(tmp_path / "cli.sqlite")
    feedback = tmp_path / "feedback.jsonl"
    feedback.write_text(
        '{"rollout_id": "ro-0", "value": 1}\n'
        + "[" * 100_000
        + "\n"
        + '{"rollout_id": "ro-1", "value": 1, "source": "'
        + "s" * 2_000_000
        + '"}\n'
        + '{"rollout_id": "ro-2", "value": 0.5}\n'
    )
    result = _cli("--file", str(feedback), "--store", str(path))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"{feedback}:2: not JSON this reader takes: nested too deeply" in result.stderr
    assert f"{feedback}:3: longer than 1048576 characters" in result.stderr
    assert result.stdout.startswith("attached 2 reward(s)") and "skipped 2 line(s)" in result.stdout
