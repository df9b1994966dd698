"""Agents without a framework: a plain OpenAI client names its agent through ``LLM.for_agent`` (or a
header) and records its tool calls with ``agl_core.tool_call`` / ``@agl_core.tool``; agent selection and
the tool rewards then work as for a framework's agent. The real gateway, store, runner and ``openai``
client, then one real training run."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

import agl_core
from agl_core import LLM, rollout_scope, semconv
from agl_core.pipeline.credit import TOOL_ERROR, TOOL_SUCCESS, RewardWeights, assign_rewards, select_agents
from agl_core.pipeline.spantree import TOOL, SpanTree, kind_of
from agl_core.pipeline.transitions import spans_to_transitions
from agl_core.runner import LLM_RESOURCE, Runner
from agl_core.testing import AglTestStack, tool_call

from ._training import metrics_rows, train_cli

R = semconv
ROOT = Path(__file__).resolve().parent.parent
GATEWAY = "http://127.0.0.1:9"
ROLLOUT_URL = f"{GATEWAY}/rollouts/ro-1/attempts/at-1/v1"


# --- naming the agent ------------------------------------------------------------------------------------
def test_for_agent_names_the_agent_in_the_rollout_url():
    llm = LLM(base_url=ROLLOUT_URL, model="m", policy_version=3, split="train")
    planner = llm.for_agent("planner")
    assert planner.base_url == f"{GATEWAY}/rollouts/ro-1/attempts/at-1/agents/planner/v1"
    assert (planner.model, planner.policy_version, planner.split) == ("m", 3, "train")
    assert llm.base_url == ROLLOUT_URL  # a copy
    assert planner.for_agent("solver").base_url == f"{GATEWAY}/rollouts/ro-1/attempts/at-1/agents/solver/v1"
    assert llm.for_agent("planner v2").base_url.endswith("/agents/planner%20v2/v1")
    assert llm.for_agent("rédacteur").base_url.endswith("/agents/r%C3%A9dacteur/v1")
    assert llm.for_agent("a.b_c-d~").base_url.endswith("/agents/a.b_c-d~/v1")
    assert LLM(base_url=f"{GATEWAY}/v1/", model="m").for_agent("x").base_url == f"{GATEWAY}/agents/x/v1"
    assert planner.anthropic_base_url == f"{GATEWAY}/rollouts/ro-1/attempts/at-1/agents/planner"
    assert llm.anthropic_base_url == f"{GATEWAY}/rollouts/ro-1/attempts/at-1"


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "it is empty"),
        ("x" * 129, "129 characters long, more than 128"),
        (" planner", "starts or ends with whitespace"),
        ("a/b", "contains '/', which cannot be inside one URL path segment"),
        ("a\\b", "contains '\\\\'"),
        ("..", "path steps"),
        ("a\nb", "control character"),
        (7, "must be a string, got int"),
    ],
)
def test_for_agent_rejects_a_name_that_cannot_be_a_path_segment(name, why):
    with pytest.raises(ValueError, match="agent name") as caught:
        LLM(base_url=ROLLOUT_URL, model="m").for_agent(name)
    assert why in str(caught.value)


def test_for_agent_needs_a_gateway_base_url():
    with pytest.raises(ValueError, match="a gateway base URL ends in '/v1'"):
        LLM(base_url="http://127.0.0.1:9/rollouts/ro-1", model="m").for_agent("planner")


def _gateway_attrs(stack: AglTestStack, response_id: str) -> dict[str, Any]:
    (span,) = stack.gateway.spans(response_id)
    return dict(span.attributes or {})


def _ask(base_url: str, text: str, **client: Any) -> str:
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, **client) as oa:
        reply = oa.chat.completions.create(model="scripted", messages=[{"role": "user", "content": text}])
    return reply.id


def test_the_gateway_records_the_agent_of_the_url_or_the_header(agl_stack):
    stack = agl_stack
    llm = LLM(base_url=stack.base_url("ro-h", "at-h"), model="scripted")
    cases = {
        "planner v2": _ask(llm.for_agent("planner v2").base_url, "hi"),  # percent-encoded in the URL
        "rédacteur": _ask(llm.for_agent("rédacteur").base_url, "hi"),
        "critic": _ask(llm.base_url, "hi", default_headers={R.HEADER_AGENT_NAME: "critic"}),
        "solver": _ask(  # the URL wins over the header
            llm.for_agent("solver").base_url, "hi", default_headers={R.HEADER_AGENT_NAME: "critic"}
        ),
        None: _ask(llm.base_url, "hi"),
    }
    for agent, response_id in cases.items():
        attrs = _gateway_attrs(stack, response_id)
        assert attrs.get(R.GEN_AI_AGENT_NAME) == agent
        assert (attrs[R.ROLLOUT_ID], attrs[R.ATTEMPT_ID]) == ("ro-h", "at-h")
    # the unscoped prefix names an agent too; the rollout comes from its header
    response_id = _ask(
        LLM(base_url=stack.gateway.v1, model="scripted").for_agent("judge").base_url,
        "hi",
        default_headers={R.HEADER_ROLLOUT_ID: "ro-u"},
    )
    attrs = _gateway_attrs(stack, response_id)
    assert (attrs[R.GEN_AI_AGENT_NAME], attrs[R.ROLLOUT_ID]) == ("judge", "ro-u")
    # and the rollout-only one
    response_id = _ask(LLM(base_url=stack.base_url("ro-r"), model="scripted").for_agent("a1").base_url, "hi")
    attrs = _gateway_attrs(stack, response_id)
    assert (attrs[R.GEN_AI_AGENT_NAME], attrs[R.ROLLOUT_ID], attrs.get(R.ATTEMPT_ID)) == ("a1", "ro-r", None)


def test_a_bad_agent_name_is_refused_in_the_protocols_error_shape(agl_stack):
    """A call that names its agent badly is refused (400 naming the header or URL segment) rather than
    recorded without the agent it was meant for; the gateway serves on."""
    with pytest.raises(openai.BadRequestError) as refused:
        _ask(agl_stack.base_url("ro-bad"), "hi", default_headers={R.HEADER_AGENT_NAME: "x" * 200})
    assert "x-agl-agent-name" in str(refused.value) and "128" in str(refused.value)
    bad_url = agl_stack.base_url("ro-bad").removesuffix("/v1") + "/agents/%20lead/v1"
    with pytest.raises(openai.BadRequestError, match="agents/"):
        _ask(bad_url, "hi")
    attrs = _gateway_attrs(agl_stack, _ask(agl_stack.base_url("ro-bad"), "hi"))
    assert R.GEN_AI_AGENT_NAME not in attrs and attrs[R.ROLLOUT_ID] == "ro-bad"


# --- recording tool calls ----------------------------------------------------------------------------------
def _attrs(span: Any) -> dict[str, Any]:
    return dict(span.attributes or {})


def test_tool_call_records_an_execute_tool_span_in_the_rollout(agl_memory):
    with rollout_scope("ro-t", "at-t", "task-t", tracer_provider=agl_memory.provider):
        with agl_core.tool_call(
            "weather", call_id="call_7", arguments={"city": "Paris"}, tracer_provider=agl_memory.provider
        ) as recorded:
            assert agl_core.current_tool_call() is recorded
        assert agl_core.current_tool_call() is None
    (span,) = agl_memory.spans("execute_tool weather")
    (root,) = agl_memory.spans(R.SPAN_ROLLOUT)
    assert span.parent is not None and span.parent.span_id == root.context.span_id
    assert _attrs(span) == {
        R.ROLLOUT_ID: "ro-t",
        R.ATTEMPT_ID: "at-t",
        R.TASK_ID: "task-t",
        R.SOURCE: R.SOURCE_USER,
        R.GEN_AI_OPERATION_NAME: R.OP_EXECUTE_TOOL,
        R.GEN_AI_TOOL_NAME: "weather",
        R.GEN_AI_TOOL_CALL_ID: "call_7",
        R.GEN_AI_TOOL_CALL_ARGUMENTS: '{"city": "Paris"}',
    }
    assert span.status.status_code == trace.StatusCode.UNSET and not recorded.failed


def test_fail_marks_a_failure_handed_back_to_the_model(agl_memory):
    with agl_core.tool_call("search", call_id="c1", tracer_provider=agl_memory.provider) as recorded:
        recorded.fail("no results for 'agl'")
    recorded.fail("too late: the span has ended")  # changes nothing
    (span,) = agl_memory.spans("execute_tool search")
    assert span.status.status_code == trace.StatusCode.ERROR
    assert span.status.description == "no results for 'agl'"
    assert _attrs(span)[R.ERROR_TYPE] == R.ERROR_TYPE_TOOL_RESULT and recorded.failed


class _Unknown(KeyError):
    pass


def test_the_tool_decorator_records_sync_and_async_functions(agl_memory):
    provider = agl_memory.provider
    raised: list[BaseException] = []

    @agl_core.tool(tracer_provider=provider)
    def add(a: int, b: int) -> int:
        return a + b

    @agl_core.tool(name="lookup", tracer_provider=provider)
    async def find(city: str) -> str:
        await asyncio.sleep(0)
        if city == "Atlantis":
            raised.append(_Unknown(city))
            raise raised[-1]
        if city == "Nowhere":
            tool = agl_core.current_tool_call()
            assert tool is not None and tool.name == "lookup"
            tool.fail("no such city")
            return "error: no such city"
        return f"sunny in {city}"

    assert add.__name__ == "add" and find.__name__ == "find"  # still the user's functions
    with rollout_scope("ro-d", tracer_provider=provider):
        assert add(2, 3) == 5
        assert add.for_call("call_1")(a=1, b=1) == 2
        assert asyncio.run(find.for_call("call_2")("Paris")) == "sunny in Paris"
        assert asyncio.run(find.for_call("call_3")("Nowhere")) == "error: no such city"
        with pytest.raises(_Unknown) as caught:
            asyncio.run(find.for_call("call_4")("Atlantis"))
    assert [caught.value] == raised  # unchanged: the very exception the tool raised

    spans = [s for s in agl_memory.spans() if _attrs(s).get(R.GEN_AI_OPERATION_NAME) == R.OP_EXECUTE_TOOL]
    got = [
        (
            s.name,
            _attrs(s).get(R.GEN_AI_TOOL_CALL_ID),
            _attrs(s)[R.ROLLOUT_ID],
            s.status.status_code.name,
            _attrs(s).get(R.ERROR_TYPE),
        )
        for s in spans
    ]
    assert got == [
        ("execute_tool add", None, "ro-d", "UNSET", None),
        ("execute_tool add", "call_1", "ro-d", "UNSET", None),
        ("execute_tool lookup", "call_2", "ro-d", "UNSET", None),
        ("execute_tool lookup", "call_3", "ro-d", "ERROR", R.ERROR_TYPE_TOOL_RESULT),
        ("execute_tool lookup", "call_4", "ro-d", "ERROR", "_Unknown"),
    ]
    assert [e.name for e in spans[-1].events] == ["exception"]


def test_a_raised_exception_propagates_unchanged_and_marks_the_span(agl_memory):
    error = ConnectionError("weather service down")
    with pytest.raises(ConnectionError) as caught:
        with agl_core.tool_call("weather", call_id="c9", tracer_provider=agl_memory.provider):
            raise error
    assert caught.value is error and caught.value.__context__ is None
    (span,) = agl_memory.spans("execute_tool weather")
    assert span.status.status_code == trace.StatusCode.ERROR
    assert _attrs(span)[R.ERROR_TYPE] == "ConnectionError"


def test_outside_a_rollout_the_tool_span_is_recorded_without_a_rollout(agl_memory):
    with agl_core.tool_call("weather", tracer_provider=agl_memory.provider):
        pass
    (span,) = agl_memory.spans("execute_tool weather")
    assert R.ROLLOUT_ID not in _attrs(span) and _attrs(span)[R.SOURCE] == R.SOURCE_USER

    # no tracing set up (what the global provider of a bare process is): nothing recorded, nothing breaks
    untraced = trace.NoOpTracerProvider()

    @agl_core.tool(tracer_provider=untraced)
    def double(x: int) -> int:
        return 2 * x

    with agl_core.tool_call("weather", call_id="c1", tracer_provider=untraced) as recorded:
        recorded.fail("down")
    assert double(4) == 8 and recorded.failed


class _BrokenProvider(trace.TracerProvider):
    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        raise RuntimeError("tracer provider broken")


def test_a_failing_recorder_never_breaks_the_agent_and_is_logged_once(caplog):
    broken = _BrokenProvider()

    @agl_core.tool(tracer_provider=broken)
    def add(a: int, b: int) -> int:
        return a + b

    with caplog.at_level(logging.ERROR, logger="agl.adapters"):
        assert [add(1, 2), add(2, 2)] == [3, 4]
        with agl_core.tool_call("x", tracer_provider=broken) as recorded:
            recorded.fail("still no crash")
        with agl_core.agent_span("solver", tracer_provider=broken) as span:
            assert not span.is_recording()
    logged = [r for r in caplog.records if r.exc_info and "tracer provider broken" in str(r.exc_info[1])]
    assert [r.getMessage() for r in logged] == [
        "agl: agl_core hook tool_call start failed; the agent continues untraced there",
        "agl: agl_core hook agent_span start failed; the agent continues untraced there",
    ]


# --- a two-agent plain-client agent, run by the runner -------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "clock", "description": "The time.", "parameters": {"type": "object"}},
}
PLAN = "Check the weather in Paris and Atlantis."
FINAL = "Sunny in Paris at noon; Atlantis is unknown."
TWO_CALLS = tool_call("weather", {"city": "Paris"}) + "\n" + tool_call("weather", {"city": "Atlantis"})
CLOCK_CALL = tool_call("clock", {})


def _policy(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> str:
    """Planner (no tools): a plan, then an approval; solver: two weather calls, then a clock call, then the
    answer. Anything else is echoed."""
    last = messages[-1]
    if tools is None:
        text = str(last.get("content") or "")
        return PLAN if text.startswith("Plan:") else "Approved." if text.startswith("Approve") else text
    if last["role"] == "user":
        return TWO_CALLS
    called = [c["function"]["name"] for m in messages for c in m.get("tool_calls") or []]
    return FINAL if "clock" in called else CLOCK_CALL


@pytest.fixture
def agl_script():
    return _policy


def _agent(provider: TracerProvider) -> Any:
    """The agent under test: a planner and a solver, each an ``AsyncOpenAI`` client on its own
    ``llm.for_agent`` URL; the solver's tools recorded with ``@agl_core.tool`` and ``agl_core.tool_call``.
    Before running the weather calls it asks the planner for approval, so the call that requested them
    is not the one that ended last: only the call id ties them together."""

    @agl_core.tool(tracer_provider=provider)
    async def weather(city: str) -> str:
        if city != "Paris":
            raise _Unknown(city)
        return "sunny"

    async def solve(task: dict[str, Any], llm: LLM) -> float:
        planner = openai.AsyncOpenAI(base_url=llm.for_agent("planner").base_url, api_key="x", max_retries=0)
        solver = openai.AsyncOpenAI(base_url=llm.for_agent("solver").base_url, api_key="x", max_retries=0)
        async with planner, solver:
            plan = await planner.chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": f"Plan: {task['q']}"}]
            )
            messages: list[Any] = [{"role": "user", "content": plan.choices[0].message.content}]
            with agl_core.agent_span("solver", tracer_provider=provider):
                for _ in range(3):
                    reply = await solver.chat.completions.create(
                        model=llm.model, messages=messages, tools=[WEATHER, CLOCK]
                    )
                    message = reply.choices[0].message
                    if not message.tool_calls:
                        return 1.0 if message.content == FINAL else 0.0
                    messages.append(message.model_dump(exclude_none=True))
                    if message.tool_calls[0].function.name == "weather":
                        await planner.chat.completions.create(
                            model=llm.model, messages=[{"role": "user", "content": "Approve the calls?"}]
                        )
                    for call in message.tool_calls:
                        arguments = json.loads(call.function.arguments)
                        if call.function.name == "weather":
                            try:
                                result = await weather.for_call(call.id)(**arguments)
                            except _Unknown as exc:
                                result = f"error: unknown city {exc}"
                        else:
                            with agl_core.tool_call(
                                "clock", call_id=call.id, arguments=arguments, tracer_provider=provider
                            ):
                                result = "12:00"
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return 0.0

    return solve


def _run(stack: AglTestStack) -> str:
    """One rollout of the agent, run by the runner against the stack's store and gateway."""
    client = stack.client
    client.put_resource(LLM_RESOURCE, {"base_url": stack.gateway_url, "model": "scripted"})
    (queued,) = client.enqueue_rollouts([{"task_id": "t0", "input": {"q": "weather?"}}])
    runner = Runner(_agent(stack.provider), client, stack.provider).start()
    try:
        (done,) = client.wait_for_rollouts([queued.rollout_id], timeout_s=30)
    finally:
        runner.stop()
    assert done.status.value == "succeeded", done.attempts[-1].error
    return done.rollout_id


def test_a_plain_client_agent_names_its_agents_and_its_tool_calls_earn_their_rewards(agl_stack):
    rollout_id = _run(agl_stack)
    spans = agl_stack.spans(rollout_id)
    result = spans_to_transitions(spans)
    assert result.problems == ()
    transitions = result.transitions
    assert [t.agent_name for t in transitions] == ["planner", "solver", "planner", "solver", "solver"]
    # exact token ids: the scripted replies as the tokenizer encodes them, plus the end-of-turn token
    tokenizer = agl_stack.backend.tokenizer
    replies = [PLAN, TWO_CALLS, "Approved.", CLOCK_CALL, FINAL]
    assert [t.response_ids for t in transitions] == [
        (*tokenizer.encode(r), tokenizer.eos_token_id) for r in replies
    ]
    first_prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Plan: weather?"}])
    assert transitions[0].prompt_ids == tuple(first_prompt)
    assert all(t.reward == 1.0 and t.rollout_id == rollout_id for t in transitions)

    # the tool spans: the ids of the model's tool calls, under the solver's agent span
    tree = SpanTree(spans)
    tools = [s for s in tree.spans if kind_of(s) == TOOL]
    first = next(s for s in spans if s.span_id == transitions[1].span_id)
    requested = [c["id"] for c in json.loads(first.attributes[R.GEN_AI_OUTPUT_MESSAGES])[0]["tool_calls"]]
    assert requested == ["call_1", "call_2"]  # the scripted backend's ids, in order
    assert [(s.name, s.attributes[R.GEN_AI_TOOL_CALL_ID], s.is_error) for s in tools] == [
        ("execute_tool weather", "call_1", False),
        ("execute_tool weather", "call_2", True),
        ("execute_tool clock", "call_3", False),
    ]
    assert tools[1].attributes[R.ERROR_TYPE] == "_Unknown"
    assert tools[2].attributes[R.GEN_AI_TOOL_CALL_ARGUMENTS] == "{}"
    assert {tree.agent_name(s) for s in tools} == {"solver"}
    assert all(s.attributes[R.SOURCE] == R.SOURCE_USER and s.rollout_id == rollout_id for s in tools)

    # only the solver's calls are trained
    assert [t.call_index for t in select_agents(transitions, ["solver"])] == [1, 3, 4]
    assert [t.call_index for t in select_agents(transitions, ["plan*"])] == [0, 2]

    # the rewards land on the call that requested the tool, not on the planner's call that ended later
    weights = RewardWeights(tool_error=-0.5, tool_success=0.1)
    credit = assign_rewards(result, spans, weights=weights, agents=["solver"])
    assert [(t.call_index, round(t.reward, 6)) for t in credit.transitions] == [(1, 0.6), (3, 1.1), (4, 1.0)]
    assert sorted((e.kind, e.call_index, e.label) for e in credit.applied) == [
        (TOOL_ERROR, 1, "weather"),
        (TOOL_SUCCESS, 1, "weather"),
        (TOOL_SUCCESS, 3, "clock"),
    ]
    assert credit.dropped == ()


# --- training it -------------------------------------------------------------------------------------------
TRAINED_AGENT = """
import itertools
import json

import openai

import agl_core

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# a different episode reward for every rollout: no group of rollouts ties
REWARDS = itertools.count(1)


@agl_core.tool
def weather(city, broken=False):
    if broken:
        raise ConnectionError("weather service down")
    return f"sunny in {city}"


def solve(task, llm):
    planner = openai.OpenAI(base_url=llm.for_agent("planner").base_url, api_key=llm.api_key, max_retries=0)
    solver = openai.OpenAI(base_url=llm.for_agent("solver").base_url, api_key=llm.api_key, max_retries=0)
    with planner, solver:
        plan = planner.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=8
        )
        messages = [{"role": "user", "content": plan.choices[0].message.content}]
        reply = solver.chat.completions.create(model=llm.model, messages=messages, tools=[WEATHER])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            try:
                arguments = json.loads(call.function.arguments)
                result = weather.for_call(call.id)(**arguments, broken=task["broken"])
            except ConnectionError as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        solver.chat.completions.create(model=llm.model, messages=messages, tools=[WEATHER])
    return next(REWARDS) / 100
"""


def test_training_a_plain_client_agent_trains_only_the_selected_agent_with_its_tool_rewards(tmp_path):
    """``agl train`` on the agent above (the tiny model updated, served through the fake vLLM, which calls
    the first tool offered): only the solver's calls are trained, and each failed tool call is a
    ``tool_error`` event."""
    (tmp_path / "agent.py").write_text(TRAINED_AGENT)
    tasks = [{"id": "ok", "q": "weather?", "broken": False}, {"id": "down", "q": "weather?", "broken": True}]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    paths = os.pathsep.join([str(ROOT), str(ROOT / "src"), str(ROOT / "trainer")])
    (tmp_path / "config.yaml").write_text(
        f"""agent: agent:solve
tasks: tasks.jsonl
output_dir: {tmp_path / "run"}
logging: {{plot: false, tensorboard: false}}
model: {{source: tiny, lora: {{r: 4, alpha: 8}}}}
serving:
  backend: vllm
  vllm:
    launch: {{model: {tmp_path / "base"}, command: [{sys.executable}, -m, tests.fake_vllm, serve],
              env: {{PYTHONPATH: "{paths}"}}, startup_timeout_s: 120}}
algorithm: {{agents: [solver], rewards: {{tool_error: -0.5}}}}
train: {{steps: 1, tasks_per_step: 2, rollouts_per_task: 3}}
"""
    )
    done = train_cli(tmp_path / "config.yaml")
    assert "  3 tool errors (-0.5 each)" in done.stdout.splitlines()
    (row,) = metrics_rows(tmp_path / "run", "train")
    assert row["agents"] == {"planner": {"calls": 6, "trained": 0}, "solver": {"calls": 12, "trained": 12}}
    assert row["trained_transitions"] == 12
    assert row["reward_events"] == {TOOL_ERROR: 3}  # one per rollout of the task whose tool fails
    assert row["policy_version"] == 1 and row["loss"] is not None  # the tiny model was updated

    from agl_core.store import SqliteStore

    store = SqliteStore(tmp_path / "run" / "store.sqlite")
    try:
        spans = store.query_spans(limit=100_000)
    finally:
        store.close()
    tools = [s for s in spans if kind_of(s) == TOOL]
    assert len(tools) == 6 and sum(s.is_error for s in tools) == 3
    assert all(s.attributes[R.SOURCE] == R.SOURCE_USER and s.rollout_id for s in tools)
    requested = {
        c["id"]
        for s in spans
        if s.attributes.get(R.SOURCE) == R.SOURCE_GATEWAY
        and "tool_calls" in s.attributes.get(R.GEN_AI_OUTPUT_MESSAGES, "")
        for c in json.loads(s.attributes[R.GEN_AI_OUTPUT_MESSAGES])[0].get("tool_calls") or []
    }
    assert {s.attributes[R.GEN_AI_TOOL_CALL_ID] for s in tools} <= requested and len(requested) == 6
