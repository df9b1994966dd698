"""Intermediate rewards end to end: real frameworks, the real gateway, spans over OTLP into the real store,
then transitions and credit (the pure parts are tested in ``test_credit.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from agl_core import semconv
from agl_core.pipeline.credit import MALFORMED_TOOL_CALL, TOOL_ERROR, RewardWeights, assign_rewards
from agl_core.pipeline.report import format_rollout
from agl_core.pipeline.spantree import TOOL, kind_of
from agl_core.pipeline.transitions import spans_to_transitions
from agl_core.testing import AglTestStack

from .gateway_helpers import Script
from .test_conformance import FRAMEWORKS, fixture_stack, instrumented, run_rollout  # noqa: F401 (fixture "stack")

R = semconv
WEIGHTS = RewardWeights(tool_error=-0.5, malformed_tool_call=-1.0)


def _output_tool_call_ids(span) -> set[str]:
    messages = json.loads(span.attributes.get(R.GEN_AI_OUTPUT_MESSAGES, "[]"))
    return {c.get("id") for m in messages for c in m.get("tool_calls") or []}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_tool_that_raises_costs_the_call_that_requested_it(stack, framework):
    """Each framework's solver calls add(2, 3), then divide(1, 0), which raises, then answers (the scripted
    policy of the conformance suite); with ``tool_error: -0.5`` the divide call, and only it, pays."""
    rollout_id = f"ro-credit-tool-{framework}"
    with instrumented(framework, "agl", stack.provider):
        run_rollout(stack, framework, "single", rollout_id)
    spans = stack.spans(rollout_id)
    result = spans_to_transitions(spans)
    assert result.problems == () and len(result.transitions) == 3
    credit = assign_rewards(result, spans, weights=WEIGHTS)
    assert [t.reward for t in credit.transitions] == [1.0, 0.5, 1.0]
    (event,) = credit.applied
    assert (event.kind, event.call_index, event.label) == (TOOL_ERROR, 1, "divide")
    assert credit.summary() == ["1 tool error (-0.5 each)"]
    # matched by the tool call id that the framework's record of call 1 holds
    tool = next(s for s in spans if s.span_id == event.span_id)
    framework_calls = [s for s in spans if result.joins.get(s.span_id) == credit.transitions[1].span_id]
    assert tool.is_error and tool.attributes[R.GEN_AI_TOOL_CALL_ID] in set().union(
        *map(_output_tool_call_ids, framework_calls)
    )


# --- malformed tool calls: the tiny model steered to write them, the gateway parsing its output ------------
ANSWER = "The answer is 5."
UNKNOWN_TOOL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
UNPARSEABLE = '<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>'
BAD_ARGUMENTS = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 2,"}\n</tool_call>'
RULES = [
    ("<tool_response>", ANSWER),
    ("Use multiply", UNKNOWN_TOOL),
    ("Be sloppy", UNPARSEABLE),
    ("Pass bad arguments", BAD_ARGUMENTS),
]


@pytest.fixture(scope="module")
def policy_stack(tmp_path_factory: pytest.TempPathFactory, tiny_policy) -> Iterator[AglTestStack]:
    """The tiny model behind the real gateway (which parses its tool calls), steered by :data:`RULES`."""
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    backend = HFBackend(
        model, tokenizer, model_name="tiny", default_max_tokens=64, logits_processor=Script(tokenizer, RULES)
    )
    with AglTestStack(backend, path=tmp_path_factory.mktemp("credit") / "store.sqlite", batch=True) as kit:
        yield kit
    backend.close()


@pytest.mark.parametrize(
    ("framework", "question", "reason", "output", "rewards"),
    [
        # LangGraph's ToolNode answers an unknown tool with an error message and runs no tool
        ("langchain", "Use multiply: 2 * 3?", R.TOOL_CALL_UNKNOWN_TOOL, ANSWER, [0.0, 1.0]),
        # the client gets the text as it is: no tool call, the agent stops
        ("langchain", "Be sloppy: 2 + 3?", R.TOOL_CALL_UNPARSEABLE, UNPARSEABLE, [0.0]),
        # AutoGen answers arguments that are not JSON with an error result and runs no tool
        ("autogen", "Pass bad arguments: 2 + 3?", R.TOOL_CALL_INVALID_ARGUMENTS, ANSWER, [0.0, 1.0]),
    ],
    ids=["unknown-tool", "unparseable", "invalid-arguments"],
)
def test_a_malformed_tool_call_costs_the_call_that_wrote_it(
    policy_stack, framework, question, reason, output, rewards
):
    rollout_id = f"ro-credit-malformed-{reason}"
    with instrumented(framework, "agl", policy_stack.provider):
        assert run_rollout(policy_stack, framework, "single", rollout_id, question=question) == output
    spans = policy_stack.spans(rollout_id)
    result = spans_to_transitions(spans)
    assert result.problems == ()
    first = next(s for s in spans if s.span_id == result.transitions[0].span_id)
    assert first.attributes[R.TOOL_CALL_MALFORMED] is True
    assert list(first.attributes[R.TOOL_CALL_MALFORMED_REASONS]) == [reason]
    if reason != R.TOOL_CALL_UNPARSEABLE:  # the framework got the call, under the id the span names
        framework_calls = [s for s in spans if result.joins.get(s.span_id) == first.span_id]
        assert set(first.attributes[R.TOOL_CALL_MALFORMED_IDS]) <= set().union(
            *map(_output_tool_call_ids, framework_calls)
        )
    for later in result.transitions[1:]:
        assert (
            next(s for s in spans if s.span_id == later.span_id).attributes.get(R.TOOL_CALL_MALFORMED)
            is not True
        )
    assert not any(kind_of(s) == TOOL for s in spans)  # no tool ran: nothing else reports the mistake
    assert f"malformed tool call ({reason})" in format_rollout(rollout_id, spans)  # agl inspect shows it

    credit = assign_rewards(result, spans, weights=WEIGHTS)
    assert [t.reward for t in credit.transitions] == rewards
    assert [(e.kind, e.call_index, e.label) for e in credit.applied] == [(MALFORMED_TOOL_CALL, 0, reason)]
    assert credit.summary() == ["1 malformed tool call (-1 each)"]
