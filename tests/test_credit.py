"""Credit assignment with intermediate rewards: explicit per-call rewards, tool errors, malformed tool calls,
timeouts, on top of the episode / last / discounted / per_call strategies and agent selection."""

from __future__ import annotations

import dataclasses
import json

import pytest

from agl_core import semconv
from agl_core.pipeline.credit import (
    EXPLICIT,
    MALFORMED_TOOL_CALL,
    TIMEOUT,
    TOOL_ERROR,
    TOOL_SUCCESS,
    RewardWeights,
    assign_credit,
    assign_rewards,
    reward_events,
)
from agl_core.pipeline.transitions import NO_REWARD, spans_to_transitions
from agl_core.records import Span

from .conftest import make_span

R = semconv
ALL_ON = RewardWeights(explicit=True, tool_error=-0.5, malformed_tool_call=-1.0, timeout=-2.0)


class Rollout:
    """Hand-built spans of one rollout, with explicit times (ns) so the attachment rules can be checked."""

    def __init__(self, rollout_id: str = "ro-1", attempt_id: str = "at-1") -> None:
        self.id = rollout_id
        self.attempt_id = attempt_id
        self.spans: list[Span] = []
        self.root = self.add(R.SPAN_ROLLOUT, {R.TASK_ID: "task-1"}, None, 0, 1_000_000)
        self._calls = 0

    def ids(self) -> dict[str, str]:
        return {R.ROLLOUT_ID: self.id, R.ATTEMPT_ID: self.attempt_id}

    def add(
        self, name: str, attrs: dict, parent: Span | None, start: int, end: int, status: str = "UNSET"
    ) -> Span:
        span = make_span(name, {**self.ids(), **attrs}, parent=parent, start=start, status=status)
        span = dataclasses.replace(
            span, end_ns=end, trace_id=self.spans[0].trace_id if self.spans else span.trace_id
        )
        self.spans.append(span)
        return span

    def agent(self, name: str, start: int, end: int, parent: Span | None = None) -> Span:
        return self.add(
            f"invoke_agent {name}",
            {R.GEN_AI_OPERATION_NAME: R.OP_INVOKE_AGENT, R.GEN_AI_AGENT_NAME: name},
            parent or self.root,
            start,
            end,
        )

    def llm(
        self, parent: Span, start: int, end: int, tool_call_ids: tuple[str, ...] = (), **gateway_extra
    ) -> Span:
        """A framework LLM span under ``parent`` and its gateway span (joined by completion id)."""
        self._calls += 1
        response_id = f"{self.id}-{self.attempt_id}-c{self._calls}"
        output = json.dumps(
            [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": i, "type": "function", "function": {"name": "t", "arguments": "{}"}}
                        for i in tool_call_ids
                    ],
                }
            ]
        )
        framework = self.add(
            "chat m",
            {
                R.GEN_AI_OPERATION_NAME: R.OP_CHAT,
                R.GEN_AI_RESPONSE_ID: response_id,
                R.SOURCE: R.SOURCE_LANGCHAIN,
                R.GEN_AI_OUTPUT_MESSAGES: output,
            },
            parent,
            start,
            end,
        )
        self.add(
            "chat m",
            {
                R.SOURCE: R.SOURCE_GATEWAY,
                R.GEN_AI_OPERATION_NAME: R.OP_CHAT,
                R.GEN_AI_RESPONSE_ID: response_id,
                R.PROMPT_TOKEN_IDS: [1, 2],
                R.RESPONSE_TOKEN_IDS: [3],
                R.RESPONSE_LOGPROBS: [-0.1],
                **gateway_extra,
            },
            None,
            start + 10,
            end - 10,
        )
        return framework

    def tool(
        self,
        parent: Span,
        start: int,
        end: int,
        *,
        error: bool = False,
        call_id: str | None = None,
        source: str = R.SOURCE_LANGCHAIN,
        name: str = "divide",
    ) -> Span:
        attrs = {R.GEN_AI_OPERATION_NAME: R.OP_EXECUTE_TOOL, R.GEN_AI_TOOL_NAME: name}
        if source == R.SOURCE_OPENINFERENCE:
            attrs = {R.OPENINFERENCE_SPAN_KIND: R.OPENINFERENCE_KIND_TOOL, R.OI_TOOL_NAME: name}
        else:
            attrs[R.SOURCE] = source
        if call_id:
            attrs[R.GEN_AI_TOOL_CALL_ID] = call_id
        return self.add(f"execute_tool {name}", attrs, parent, start, end, "ERROR" if error else "UNSET")

    def reward(self, value: float, at: int, parent: Span | None = None, name: str = "episode") -> Span:
        return self.add(
            R.SPAN_REWARD, {R.REWARD_VALUE: value, R.REWARD_NAME: name}, parent or self.root, at, at + 1
        )

    def error(self, error_type: str, at: int) -> Span:
        return self.add(R.SPAN_ERROR, {R.ERROR_TYPE: error_type}, self.root, at, at + 1, "ERROR")


def _events(spans):
    result = spans_to_transitions(spans)
    assert result.problems == (), result.problems
    return [(e.kind, e.call_index, e.value, e.label) for e in reward_events(spans, result)]


def _rewards(spans, **kwargs):
    result = spans_to_transitions(spans, timeout_reward=kwargs.pop("timeout_reward", None))
    return [t.reward for t in assign_rewards(result, spans, **kwargs).transitions]


# --- explicit per-call rewards ----------------------------------------------------------------------------
def _two_agents_in_parallel():
    """writer and checker run at the same time; each makes one call, checker's ends later."""
    r = Rollout()
    writer = r.agent("writer", 1_000, 90_000)
    checker = r.agent("checker", 1_100, 90_000)
    r.llm(writer, 2_000, 3_000)  # call 0
    r.llm(checker, 2_100, 5_000)  # call 1
    return r, writer, checker


def test_explicit_reward_goes_to_the_last_call_that_ended_before_it_in_its_own_step():
    r, writer, _ = _two_agents_in_parallel()
    r.reward(0.3, 6_000, parent=writer, name="step")  # after both calls ended; writer's step holds call 0
    r.reward(1.0, 99_000)
    assert _events(r.spans) == [(EXPLICIT, 0, 0.3, "step")]
    assert _rewards(r.spans) == [1.3, 1.0]


def test_explicit_reward_outside_any_step_falls_back_to_the_last_call_of_the_rollout():
    r, _, _ = _two_agents_in_parallel()
    r.reward(0.3, 6_000, name="step")  # a child of the rollout span itself
    r.reward(0.2, 4_000, name="step")  # only call 0 had ended by then
    r.reward(1.0, 99_000)
    assert sorted(_events(r.spans)) == [(EXPLICIT, 0, 0.2, "step"), (EXPLICIT, 1, 0.3, "step")]


def test_explicit_reward_in_a_step_whose_calls_have_not_ended_falls_back_too():
    r, writer, checker = _two_agents_in_parallel()
    late = r.agent("late", 5_500, 9_000)
    r.reward(-0.1, 5_600, parent=late, name="step")  # late made no call: the rollout's last call before it
    r.reward(1.0, 99_000)
    assert _events(r.spans) == [(EXPLICIT, 1, -0.1, "step")]


def test_explicit_reward_before_any_call_goes_to_the_first_call():
    r, writer, _ = _two_agents_in_parallel()
    r.reward(0.5, 1_500, parent=writer, name="plan")
    r.reward(1.0, 99_000)
    assert _events(r.spans) == [(EXPLICIT, 0, 0.5, "plan")]


def test_explicit_reward_emitted_during_a_call_goes_to_that_call():
    r, writer, checker = _two_agents_in_parallel()
    checker_call = next(s for s in r.spans if s.start_ns == 2_100)
    r.reward(0.7, 2_500, parent=checker_call, name="stream_check")
    r.reward(1.0, 99_000)
    assert _events(r.spans) == [(EXPLICIT, 1, 0.7, "stream_check")]


def test_episode_rewards_and_invalid_values_are_not_intermediate_rewards():
    r, writer, _ = _two_agents_in_parallel()
    r.reward(1.0, 99_000)
    r.add(R.SPAN_REWARD, {R.REWARD_VALUE: 0.9}, r.root, 99_100, 99_200)  # no name: an episode reward
    r.add(R.SPAN_REWARD, {R.REWARD_VALUE: "high", R.REWARD_NAME: "step"}, r.root, 99_300, 99_400)
    assert _events(r.spans) == []
    assert _rewards(r.spans) == [0.9, 0.9]


# --- tool errors ------------------------------------------------------------------------------------------
def _solver_with_tools(call_ids=True):
    """solver: call 0 requests tools a and b, both run (b fails) after call 1 has already been made."""
    r = Rollout()
    solver = r.agent("solver", 1_000, 90_000)
    r.llm(solver, 2_000, 3_000, tool_call_ids=("tc-a", "tc-b") if call_ids else ())
    r.llm(solver, 3_100, 4_000)
    r.tool(solver, 5_000, 5_500, call_id="tc-a" if call_ids else None, name="add")
    r.tool(solver, 6_000, 6_500, error=True, call_id="tc-b" if call_ids else None)
    r.reward(1.0, 99_000)
    return r, solver


def test_tool_error_goes_to_the_call_that_requested_it_by_tool_call_id():
    r, _ = _solver_with_tools(call_ids=True)
    assert _events(r.spans) == [(TOOL_SUCCESS, 0, 1.0, "add"), (TOOL_ERROR, 0, 1.0, "divide")]
    assert _rewards(r.spans, weights=ALL_ON) == [0.5, 1.0]


def test_tool_error_without_call_id_goes_to_the_last_call_before_the_tool_in_its_step():
    r, _ = _solver_with_tools(call_ids=False)
    other = r.agent("other", 5_000, 9_000)
    r.llm(other, 5_100, 5_900)  # ends after solver's calls, before the tool, but in another agent's step
    assert _events(r.spans) == [(TOOL_SUCCESS, 1, 1.0, "add"), (TOOL_ERROR, 1, 1.0, "divide")]


def test_call_id_found_in_openinference_output_attributes():
    r = Rollout()
    solver = r.agent("solver", 1_000, 90_000)
    first = r.llm(solver, 2_000, 3_000)
    r.llm(solver, 3_100, 4_000)
    r.spans[r.spans.index(first)] = dataclasses.replace(
        first,
        attributes={
            **first.attributes,
            R.GEN_AI_OUTPUT_MESSAGES: "[]",
            "llm.output_messages.0.message.tool_calls.0.tool_call.id": "oi-1",
        },
    )
    r.tool(solver, 5_000, 5_500, error=True, call_id="oi-1")
    r.reward(1.0, 99_000)
    assert _events(r.spans) == [(TOOL_ERROR, 0, 1.0, "divide")]


def test_one_failed_tool_call_described_by_several_spans_counts_once():
    r, solver = _solver_with_tools(call_ids=True)
    agl_tool = next(s for s in r.spans if s.is_error)
    r.add(
        "execute_tool divide",
        {R.GEN_AI_OPERATION_NAME: R.OP_EXECUTE_TOOL, R.GEN_AI_TOOL_CALL_ID: "tc-b"},
        agl_tool,
        6_100,
        6_400,
        "ERROR",
    )  # the framework's own span, nested in agl's
    r.tool(solver, 6_000, 6_500, error=True, call_id="tc-b", source=R.SOURCE_OPENINFERENCE)
    r.tool(solver, 6_000, 6_500, error=True, call_id="tc-b", source=R.SOURCE_AUTOGEN)
    assert _events(r.spans) == [(TOOL_SUCCESS, 0, 1.0, "add"), (TOOL_ERROR, 0, 1.0, "divide")]


def test_successful_tool_calls_are_rewarded_once_on_the_requesting_call():
    r, solver = _solver_with_tools(call_ids=True)
    r.tool(
        solver, 5_000, 5_500, call_id="tc-a", name="add", source=R.SOURCE_AUTOGEN
    )  # a second span, same call
    weights = RewardWeights(tool_success=0.2, tool_error=-0.5)
    assert _rewards(r.spans, weights=weights) == [pytest.approx(0.7), 1.0]
    result = spans_to_transitions(r.spans)
    credit = assign_rewards(result, r.spans, weights=weights)
    assert credit.counts() == {"tool_error": 1, "tool_success": 1}
    assert "1 successful tool call (+0.2 each)" in credit.summary()
    assert _rewards(r.spans, weights=RewardWeights(tool_success=0.2)) == [1.2, 1.0]


def test_a_tool_call_that_any_of_its_spans_says_failed_is_not_a_success():
    r = Rollout()
    solver = r.agent("solver", 1_000, 90_000)
    r.llm(solver, 2_000, 3_000, tool_call_ids=("tc-a",))
    r.tool(solver, 5_000, 5_500, call_id="tc-a", source=R.SOURCE_AUTOGEN)  # the framework's span: OK
    r.tool(solver, 5_000, 5_600, error=True, call_id="tc-a")  # agl's adapter saw the exception
    r.reward(1.0, 99_000)
    assert _events(r.spans) == [(TOOL_ERROR, 0, 1.0, "divide")]


def test_openinference_tool_spans_count_when_no_agl_adapter_describes_tools():
    r = Rollout()
    solver = r.agent("solver", 1_000, 90_000)
    r.llm(solver, 2_000, 3_000)
    r.tool(solver, 5_000, 5_500, error=True, source=R.SOURCE_OPENINFERENCE)
    r.tool(solver, 6_000, 6_500, error=True, source=R.SOURCE_OPENINFERENCE)  # a second failing call
    r.reward(1.0, 99_000)
    assert _events(r.spans) == [(TOOL_ERROR, 0, 1.0, "divide")] * 2
    assert _rewards(r.spans, weights=RewardWeights(tool_error=-0.25)) == [0.5]


# --- malformed tool calls -----------------------------------------------------------------------------------
def test_malformed_tool_calls_flagged_by_the_gateway():
    r = Rollout()
    solver = r.agent("solver", 1_000, 90_000)
    r.llm(
        solver,
        2_000,
        3_000,
        **{R.TOOL_CALL_MALFORMED: True, R.TOOL_CALL_MALFORMED_REASONS: [R.TOOL_CALL_UNPARSEABLE]},
    )
    r.llm(
        solver,
        3_100,
        4_000,
        tool_call_ids=("tc-1", "tc-2"),
        **{
            R.TOOL_CALL_MALFORMED: True,
            R.TOOL_CALL_MALFORMED_REASONS: [R.TOOL_CALL_UNKNOWN_TOOL, R.TOOL_CALL_INVALID_ARGUMENTS],
            R.TOOL_CALL_MALFORMED_IDS: ["tc-1", "tc-2"],
        },
    )
    r.llm(solver, 5_000, 6_000, **{R.TOOL_CALL_MALFORMED: False})
    r.tool(solver, 4_500, 4_600, error=True, call_id="tc-2")  # the framework ran it and failed: counted once
    r.reward(1.0, 99_000)
    assert _events(r.spans) == [
        (MALFORMED_TOOL_CALL, 0, 1.0, R.TOOL_CALL_UNPARSEABLE),
        (MALFORMED_TOOL_CALL, 1, 1.0, R.TOOL_CALL_UNKNOWN_TOOL),
        (MALFORMED_TOOL_CALL, 1, 1.0, R.TOOL_CALL_INVALID_ARGUMENTS),
    ]
    assert _rewards(r.spans, weights=ALL_ON) == [0.0, -1.0, 1.0]


# --- timeouts -----------------------------------------------------------------------------------------------
def _timed_out(error_type="RolloutTimeout", reward=None):
    r = Rollout()
    solver = r.agent("solver", 1_000, 90_000)
    r.llm(solver, 2_000, 3_000)
    r.llm(solver, 3_100, 4_000)
    r.error(error_type, 95_000)
    if reward is not None:
        r.reward(reward, 99_000)
    return r


def test_a_timed_out_rollout_is_trained_only_when_a_timeout_episode_reward_is_given():
    spans = _timed_out().spans
    assert spans_to_transitions(spans).reasons() == {NO_REWARD: 1}
    result = spans_to_transitions(spans, timeout_reward=0.0)
    assert result.problems == () and result.timeout_rewarded == ("ro-1",)
    assert [t.reward for t in result.transitions] == [0.0, 0.0]
    credit = assign_rewards(result, spans, weights=ALL_ON)
    assert [t.reward for t in credit.transitions] == [0.0, -2.0]  # the penalty on the last call
    assert credit.timeout_rewarded == ("ro-1",)
    assert credit.summary() == [
        "1 timeout (-2 each)",
        "1 timed-out rollouts trained with the timeout episode reward",
    ]
    with pytest.raises(ValueError, match="finite"):
        spans_to_transitions(spans, timeout_reward=float("nan"))


@pytest.mark.parametrize(
    "error_type, is_timeout",
    [("RolloutTimeout", True), ("ReadTimeout", True), ("TimeoutError", True), ("ValueError", False)],
)
def test_which_errors_are_timeouts(error_type, is_timeout):
    spans = _timed_out(error_type, reward=1.0).spans
    assert _events(spans) == ([(TIMEOUT, 1, 1.0, error_type)] if is_timeout else [])
    result = spans_to_transitions(_timed_out(error_type).spans, timeout_reward=0.0)
    assert result.timeout_rewarded == (("ro-1",) if is_timeout else ())


def test_timeout_goes_to_the_last_call_of_its_attempt():
    r = _timed_out(reward=1.0)  # attempt at-1 timed out after calls 0 and 1
    r.attempt_id = "at-2"  # the retry makes call 2
    r.llm(r.agent("solver", 100_000, 190_000), 101_000, 102_000)
    assert _events(r.spans) == [(TIMEOUT, 1, 1.0, "RolloutTimeout")]


# --- how the pieces combine -------------------------------------------------------------------------------
def _combined():
    """Three calls; call 0 requested a failing tool, call 1 got an explicit +0.25, the rollout timed out
    (penalty on call 2) with episode reward 1."""
    r = Rollout()
    solver = r.agent("solver", 1_000, 90_000)
    r.llm(solver, 2_000, 3_000, tool_call_ids=("tc-1",))
    r.tool(solver, 3_100, 3_200, error=True, call_id="tc-1")
    r.llm(solver, 4_000, 5_000)
    r.reward(0.25, 5_100, parent=solver, name="progress")
    r.llm(solver, 6_000, 7_000)
    r.error("RolloutTimeout", 95_000)
    r.reward(1.0, 99_000)
    return r.spans


@pytest.mark.parametrize(
    "strategy, expected",
    [
        ("episode", [1.0 - 0.5, 1.0 + 0.25, 1.0 - 2.0]),
        ("last", [-0.5, 0.25, 1.0 - 2.0]),
        ("discounted", [0.25 - 0.5, 0.5 + 0.25, 1.0 - 2.0]),
        ("per_call", [-0.5, 0.25, -2.0]),
    ],
)
def test_base_strategy_then_intermediate_rewards(strategy, expected):
    assert _rewards(_combined(), strategy=strategy, gamma=0.5, weights=ALL_ON) == pytest.approx(expected)


@pytest.mark.parametrize("strategy", ["episode", "last", "discounted", "per_call"])
def test_zero_weights_change_nothing(strategy):
    spans = _combined()
    result = spans_to_transitions(spans)
    credit = assign_rewards(
        result, spans, strategy=strategy, gamma=0.5, weights=RewardWeights(explicit=False)
    )
    assert list(credit.transitions) == assign_credit(result.transitions, strategy, gamma=0.5)
    assert credit.applied == () and credit.counts() == {} and credit.summary() == []


def test_per_call_strategy_trains_on_explicit_rewards_only_by_default():
    assert _rewards(_combined(), strategy="per_call") == [0.0, 0.25, 0.0]


@pytest.mark.parametrize(
    "strategy, weights, score",
    [
        ("episode", ALL_ON, 1.0 + (-0.5 + 0.25 - 2.0) / 3),
        ("last", ALL_ON, 1.0 + (-0.5 + 0.25 - 2.0) / 3),
        ("per_call", ALL_ON, (-0.5 + 0.25 - 2.0) / 3),
        ("episode", RewardWeights(explicit=False), 1.0),  # nothing added: the last call's reward
        ("per_call", RewardWeights(), 0.25 / 3),
    ],
)
def test_rollout_scores_count_the_mean_intermediate_reward_per_call(strategy, weights, score):
    spans = _combined()
    credit = assign_rewards(spans_to_transitions(spans), spans, strategy=strategy, weights=weights)
    assert credit.scores == {"ro-1": pytest.approx(score)}


def test_report_counts_each_kind():
    spans = _combined()
    credit = assign_rewards(spans_to_transitions(spans), spans, weights=ALL_ON)
    assert credit.counts() == {EXPLICIT: 1, TOOL_ERROR: 1, TIMEOUT: 1}
    assert credit.added() == {EXPLICIT: 0.25, TOOL_ERROR: -0.5, TIMEOUT: -2.0}
    assert credit.summary() == [
        "1 explicit reward (+0.25 in all)",
        "1 tool error (-0.5 each)",
        "1 timeout (-2 each)",
    ]


# --- agent selection --------------------------------------------------------------------------------------
def _writer_then_checker():
    """writer's call 0 requests a failing tool; checker's calls 1 and 2 each get an explicit reward;
    timeout."""
    r = Rollout()
    writer = r.agent("writer", 1_000, 10_000)
    r.llm(writer, 2_000, 3_000, tool_call_ids=("tc-w",))
    r.tool(writer, 3_100, 3_200, error=True, call_id="tc-w")
    checker = r.agent("checker", 11_000, 20_000)
    r.llm(checker, 12_000, 13_000)
    r.reward(0.1, 13_100, parent=checker, name="check")
    r.llm(checker, 14_000, 15_000)
    r.reward(0.2, 15_100, parent=checker, name="check")
    writer2 = r.agent("writer", 21_000, 30_000)
    r.llm(writer2, 22_000, 23_000)  # the rollout's last call is writer's
    r.error("RolloutTimeout", 95_000)
    r.reward(1.0, 99_000)
    return r.spans


def test_agent_selection_keeps_events_of_trained_calls_and_moves_the_timeout_to_the_last_trained_call():
    spans = _writer_then_checker()
    result = spans_to_transitions(spans)
    assert [t.agent_name for t in result.transitions] == ["writer", "checker", "checker", "writer"]

    everyone = assign_rewards(result, spans, strategy="last", weights=ALL_ON)
    assert [t.reward for t in everyone.transitions] == pytest.approx([-0.5, 0.1, 0.2, 1.0 - 2.0])

    checker = assign_rewards(result, spans, strategy="last", weights=ALL_ON, agents=["check*"])
    assert [t.call_index for t in checker.transitions] == [1, 2]
    assert [t.reward for t in checker.transitions] == pytest.approx([0.1, 0.2 + 1.0 - 2.0])
    assert [(e.kind, e.call_index) for e in checker.dropped] == [(TOOL_ERROR, 0)]
    assert checker.counts() == {EXPLICIT: 2, TIMEOUT: 1}
    assert "1 intermediate rewards on calls of agents not trained, not added" in checker.summary()

    writer = assign_rewards(result, spans, strategy="episode", weights=ALL_ON, agents=["writer"])
    assert [t.call_index for t in writer.transitions] == [0, 3]
    assert [t.reward for t in writer.transitions] == pytest.approx([0.5, -1.0])
    assert sorted((e.kind, e.call_index) for e in writer.dropped) == [(EXPLICIT, 1), (EXPLICIT, 2)]


def test_selecting_after_assignment_differs_for_last():
    """Selection comes first: ``last`` rewards the last *trained* call; selecting afterwards would lose it."""
    spans = _writer_then_checker()
    result = spans_to_transitions(spans)
    weights = RewardWeights(explicit=False)
    selected_first = assign_rewards(result, spans, strategy="last", weights=weights, agents=["checker"])
    assert [t.reward for t in selected_first.transitions] == [0.0, 1.0]
    from agl_core.pipeline.credit import select_agents

    selected_after = select_agents(assign_credit(result.transitions, "last"), ["checker"])
    assert [t.reward for t in selected_after] == [0.0, 0.0]


# --- validation ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        {"tool_error": float("nan")},
        {"timeout": float("inf")},
        {"malformed_tool_call": "x"},
        {"tool_error": True},
    ],
)
def test_weights_must_be_finite_numbers(bad):
    with pytest.raises(ValueError, match="must be a finite number"):
        RewardWeights(**bad)


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="per_call"):
        assign_credit([], "bogus")
