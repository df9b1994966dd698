"""examples/import_openinference: an agent traced only by OpenInference, its calls captured by the gateway,
its OTLP file imported into the same store: the joins, transitions, calls not joined and late reward."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from agl_core import semconv
from agl_core.importer import session_rollout_id
from agl_core.pipeline.spantree import LLM, kind_of, source_of
from agl_core.pipeline.transitions import COUNT_MISMATCH, NO_LLM_CALL, NO_REWARD, episode_rewards
from agl_core.store import SqliteStore

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "import_openinference" / "run.py"

pytest.importorskip("openinference.instrumentation.langchain")
pytest.importorskip("langgraph")


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("_import_openinference_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[str]]:
    from agl_trainer.model import load_tokenizer

    printed: list[str] = []
    result = _example().main(
        tmp_path_factory.mktemp("oi"), tokenizer=load_tokenizer("tiny"), echo=printed.append
    )
    return result, printed


def _stored(result: Any) -> list[Any]:
    store = SqliteStore(result.store)
    try:
        return store.query_spans(limit=100_000)
    finally:
        store.close()


def test_the_session_id_decides_the_rollout_of_both_the_gateway_and_the_imported_spans(run):
    result, _ = run
    rollouts = {s: session_rollout_id(s) for s in ("support-1", "support-2", "support-3")}
    assert result.rollouts == rollouts
    # the gateway served the two episodes sent to it, two calls each; the third went elsewhere
    assert [c.rollout_id for c in result.gateway_calls] == [rollouts["support-1"]] * 2 + [
        rollouts["support-2"]
    ] * 2
    lines = result.trace_file.read_text().splitlines()
    assert lines and all("resourceSpans" in json.loads(line) for line in lines)
    by_rollout: dict[str, set[str]] = {}
    for span in _stored(result):
        by_rollout.setdefault(span.rollout_id, set()).add(source_of(span))
    assert by_rollout == {
        rollouts["support-1"]: {semconv.SOURCE_GATEWAY, semconv.SOURCE_OPENINFERENCE, ""},  # "": agl.reward
        rollouts["support-2"]: {semconv.SOURCE_GATEWAY, semconv.SOURCE_OPENINFERENCE},
        rollouts["support-3"]: {semconv.SOURCE_OPENINFERENCE},
    }


def test_the_openinference_llm_spans_join_the_gateway_calls(run):
    result, _ = run
    spans = _stored(result)
    for session in ("support-1", "support-2"):
        rollout_id = session_rollout_id(session)
        mine = [s for s in spans if s.rollout_id == rollout_id]
        oi_calls = [s for s in mine if kind_of(s) == LLM and source_of(s) == semconv.SOURCE_OPENINFERENCE]
        gateway = [s for s in mine if s.attributes.get(semconv.SOURCE) == semconv.SOURCE_GATEWAY]
        assert len(oi_calls) == len(gateway) == 2
        assert all(s.attributes[semconv.SESSION_ID] == session for s in oi_calls + gateway)
        joined = [result.transitions.joins[s.span_id] for s in oi_calls]
        assert sorted(joined) == sorted(g.span_id for g in gateway)


def test_the_rated_episode_makes_transitions_with_the_gateways_exact_ids(run):
    result, printed = run
    rated = session_rollout_id("support-1")
    transitions = result.transitions.transitions
    calls = [c for c in result.gateway_calls if c.rollout_id == rated]
    assert len(transitions) == 2
    assert [(t.rollout_id, t.call_index, t.agent_name, t.reward) for t in transitions] == [
        (rated, 0, "solver", 1.0),
        (rated, 1, "checker", 1.0),
    ]
    for transition, call in zip(transitions, calls, strict=True):
        assert transition.prompt_ids == call.prompt_ids
        assert transition.response_ids == call.response_ids
        assert transition.response_logprobs == (-0.5,) * len(call.response_ids)
    inspect = next(out for argv, out in result.commands if argv[:2] == ["inspect", rated])
    assert "2 LLM calls through the gateway, 2 transitions" in inspect
    assert "agent=solver, -> transition 0" in inspect and "agent=checker, -> transition 1" in inspect
    assert "2 transitions" in printed


def test_the_call_outside_the_gateway_is_reported_with_its_reason(run):
    result, _ = run
    elsewhere = session_rollout_id("support-3")
    problems = [p for p in result.transitions.problems if p.rollout_id == elsewhere]
    assert sorted(p.reason for p in problems) == sorted([COUNT_MISMATCH, COUNT_MISMATCH, NO_LLM_CALL])
    assert {p.detail for p in problems if p.reason == COUNT_MISMATCH} == {
        "2 unmatched framework calls, 0 unmatched gateway calls"
    }
    inspect = next(out for argv, out in result.commands if argv[:2] == ["inspect", elsewhere])
    assert "0 LLM calls through the gateway, 0 transitions" in inspect
    assert inspect.count(f"no transition: {COUNT_MISMATCH}") == 2
    assert NO_LLM_CALL in inspect


def test_the_late_reward_reaches_only_the_rated_rollout(run):
    result, _ = run
    spans = _stored(result)
    assert episode_rewards(spans) == {session_rollout_id("support-1"): 1.0}
    (reward,) = [s for s in spans if s.name == semconv.SPAN_REWARD]
    assert reward.rollout_id == session_rollout_id("support-1")
    assert reward.attributes[semconv.REWARD_ID] == "thumbs-up-1"
    assert reward.attributes[semconv.REWARD_SOURCE] == "user"
    unrated = [
        p.reason for p in result.transitions.problems if p.rollout_id == session_rollout_id("support-2")
    ]
    assert unrated == [NO_REWARD]
