"""Agents on the Anthropic Messages API train: a plain ``anthropic`` SDK agent, LangChain's
``ChatAnthropic`` in a LangGraph ReAct agent and AutoGen's ``AnthropicChatCompletionClient`` in an
``AssistantAgent``, each run by the real runner as rollouts through the real gateway (scripted policy) into
the real store. Each yields one transition per LLM call with the exact token ids, names its agent, and its
failing tool call costs the call that requested it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

import agl_core
from agl_core import LLM, semconv
from agl_core.pipeline.credit import TOOL_ERROR, TOOL_SUCCESS, RewardWeights, assign_rewards
from agl_core.pipeline.spantree import TOOL, SpanTree, kind_of
from agl_core.pipeline.transitions import spans_to_transitions
from agl_core.records import Span
from agl_core.runner import LLM_RESOURCE, Runner
from agl_core.testing import AglTestStack, tool_call

from ._agents import AUTOGEN_MODEL_INFO, FINAL_ANSWER, SOLVER_PROMPT, add, divide, scenario_script

anthropic = pytest.importorskip("anthropic")

R = semconv
QUESTION = "What is 2 + 3?"
#: The solver's replies, in order (``scenario_script``): add(2, 3), divide(1, 0) (which raises), the answer.
REPLIES = [tool_call("add", {"a": 2, "b": 3}), tool_call("divide", {"a": 1, "b": 0}), FINAL_ANSWER]
WEIGHTS = RewardWeights(tool_error=-0.5, tool_success=0.1)
TOOLS = [
    {
        "name": fn.__name__,
        "description": fn.__doc__,
        "input_schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    }
    for fn in (add, divide)
]


@pytest.fixture
def agl_script():
    return scenario_script


def _run(stack: AglTestStack, agent: Callable[..., Any]) -> tuple[str, list[Span]]:
    """One rollout of ``agent`` by the runner; its id and spans."""
    client = stack.client
    client.put_resource(LLM_RESOURCE, {"base_url": stack.gateway_url, "model": "scripted"})
    (queued,) = client.enqueue_rollouts([{"task_id": "t-add", "input": {"question": QUESTION}}])
    runner = Runner(agent, client, stack.provider).start()
    try:
        (done,) = client.wait_for_rollouts([queued.rollout_id], timeout_s=60)
    finally:
        runner.stop()
    assert done.status.value == "succeeded", done.attempts[-1].error
    return done.rollout_id, stack.spans(done.rollout_id)


def _check_trains(stack: AglTestStack, spans: list[Span]) -> None:
    """Three transitions with the gateway's exact token ids, all the solver's; the divide call, and only
    it, pays for its failing tool, the add call earns its success."""
    result = spans_to_transitions(spans)
    assert result.problems == (), result.problems
    transitions = result.transitions
    backend: Any = stack.backend
    tokenizer = backend.tokenizer
    assert [t.response_ids for t in transitions] == [
        (*tokenizer.encode(r), tokenizer.eos_token_id) for r in REPLIES
    ]
    gateway = {s.span_id: s for s in spans if s.attributes.get(R.SOURCE) == R.SOURCE_GATEWAY}
    for t in transitions:
        attrs = gateway[t.span_id].attributes
        assert attrs[R.GATEWAY_PROTOCOL] == "messages"
        messages = json.loads(attrs[R.GEN_AI_INPUT_MESSAGES])
        assert list(t.prompt_ids) == tokenizer.apply_chat_template(backend.render(messages))
        assert messages[0] == {"role": "system", "content": SOLVER_PROMPT}
        assert t.response_logprobs == tuple(-0.5 for _ in t.response_ids) and t.policy_version == 0
    assert [t.agent_name for t in transitions] == ["solver"] * 3

    # the tool spans carry the ids of the model's tool calls, as the gateway handed them out
    first, second = (gateway[t.span_id] for t in transitions[:2])
    requested = [
        c["id"]
        for s in (first, second)
        for c in json.loads(s.attributes[R.GEN_AI_OUTPUT_MESSAGES])[0]["tool_calls"]
    ]
    assert requested == ["call_1", "call_2"]
    tree = SpanTree(spans)
    tools = sorted(
        (s.attributes[R.GEN_AI_TOOL_CALL_ID], s.attributes[R.GEN_AI_TOOL_NAME], s.is_error)
        for s in tree.spans
        if kind_of(s) == TOOL
    )
    assert tools == [("call_1", "add", False), ("call_2", "divide", True)]

    credit = assign_rewards(result, spans, weights=WEIGHTS)
    assert [round(t.reward, 6) for t in credit.transitions] == [1.1, 0.5, 1.0]
    assert sorted((e.kind, e.call_index, e.label) for e in credit.applied) == [
        (TOOL_ERROR, 1, "divide"),
        (TOOL_SUCCESS, 0, "add"),
    ]


# --- (a) the anthropic SDK, no framework ------------------------------------------------------------------
def _sdk_agent(provider: Any, streamed: bool) -> Callable[..., Any]:
    @agl_core.tool(name="add", tracer_provider=provider)
    def add_tool(a: int, b: int) -> int:
        return add(a, b)

    @agl_core.tool(name="divide", tracer_provider=provider)
    def divide_tool(a: int, b: int) -> float:
        return divide(a, b)

    run = {"add": add_tool, "divide": divide_tool}

    async def solve(task: dict[str, Any], llm: LLM) -> float:
        solver = llm.for_agent("solver")
        async with anthropic.AsyncAnthropic(
            base_url=solver.anthropic_base_url, api_key="x", max_retries=0
        ) as c:
            messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
            for _ in range(4):
                options = {"model": llm.model, "max_tokens": 256, "system": SOLVER_PROMPT, "tools": TOOLS}
                if streamed:
                    async with c.messages.stream(messages=messages, **options) as stream:
                        reply = await stream.get_final_message()
                else:
                    reply = await c.messages.create(messages=messages, **options)
                uses = [b for b in reply.content if b.type == "tool_use"]
                if reply.stop_reason != "tool_use":
                    return 1.0 if [b.text for b in reply.content] == [FINAL_ANSWER] else 0.0
                messages.append(
                    {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]}
                )
                results = []
                for use in uses:
                    try:
                        output, failed = str(run[use.name].for_call(use.id)(**use.input)), False
                    except ZeroDivisionError as exc:
                        output, failed = f"error: {exc}", True
                    results.append(
                        {"type": "tool_result", "tool_use_id": use.id, "content": output, "is_error": failed}
                    )
                messages.append({"role": "user", "content": results})
        return 0.0

    return solve


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_plain_anthropic_sdk_agent_trains(agl_stack, streamed):
    _, spans = _run(agl_stack, _sdk_agent(agl_stack.provider, streamed))
    _check_trains(agl_stack, spans)
    assert {s.attributes[R.SOURCE] for s in spans if kind_of(s) == TOOL} == {R.SOURCE_USER}


# --- (b) LangChain's ChatAnthropic in a LangGraph ReAct agent -----------------------------------------------
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_langchain_chat_anthropic_in_a_react_agent_trains(agl_stack, streamed):
    pytest.importorskip("langchain_anthropic")
    pytest.importorskip("langgraph")
    from langchain_anthropic import ChatAnthropic
    from langchain_core.tools import tool
    from langgraph.prebuilt import ToolNode, create_react_agent

    import agl_langchain

    def solve(task: dict[str, Any], llm: LLM) -> float:
        model = ChatAnthropic(
            model=llm.model,
            base_url=llm.anthropic_base_url,
            api_key="x",
            max_retries=0,
            max_tokens=256,
            streaming=streamed,
        )
        tools = ToolNode([tool(add), tool(divide)], handle_tool_errors=True)
        agent = create_react_agent(model, tools, prompt=SOLVER_PROMPT, name="solver")
        out = agent.invoke({"messages": [("user", task["question"])]})
        return 1.0 if out["messages"][-1].text == FINAL_ANSWER else 0.0  # streamed: a list of blocks

    agl_langchain.instrument(tracer_provider=agl_stack.provider, capture_content=True)
    try:
        _, spans = _run(agl_stack, solve)
    finally:
        agl_langchain.uninstrument()
    _check_trains(agl_stack, spans)
    framework = [
        s
        for s in spans
        if s.attributes.get(R.SOURCE) == R.SOURCE_LANGCHAIN and R.GEN_AI_USAGE_INPUT_TOKENS in s.attributes
    ]
    assert len(framework) == 3
    if not streamed:  # joined by the message id, which LangChain keeps from a whole answer only
        gateway_ids = {
            s.attributes[R.GEN_AI_RESPONSE_ID]
            for s in spans
            if s.attributes.get(R.SOURCE) == R.SOURCE_GATEWAY
        }
        assert {s.attributes[R.GEN_AI_RESPONSE_ID] for s in framework} == gateway_ids
        assert all(i.startswith("msg_") for i in gateway_ids)


# --- (c) AutoGen's AnthropicChatCompletionClient in an AssistantAgent -------------------------------------
class _SamplingInExtraBody:
    """An ``AsyncAnthropic`` as autogen-ext 0.7.5 calls it. That client passes ``temperature`` (and
    ``top_p`` / ``top_k``) to ``messages.create`` as arguments, which anthropic >= 1.0 no longer takes
    (a ``TypeError`` before any request); they go in ``extra_body`` instead, as the SDK asks. The wire
    request is the same."""

    _SAMPLING = ("temperature", "top_p", "top_k")

    def __init__(self, client: Any) -> None:
        self._client = client
        self.messages = self

    def create(self, **kwargs: Any) -> Any:
        extra = {k: kwargs.pop(k) for k in self._SAMPLING if k in kwargs}
        return self._client.messages.create(**kwargs, extra_body={**kwargs.pop("extra_body", {}), **extra})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_autogen_anthropic_client_in_an_assistant_agent_trains(agl_stack, streamed):
    pytest.importorskip("autogen_agentchat")
    pytest.importorskip("autogen_ext.models.anthropic")
    from autogen_agentchat.agents import AssistantAgent
    from autogen_ext.models.anthropic import AnthropicChatCompletionClient, BaseAnthropicChatCompletionClient

    import agl_autogen

    async def solve(task: dict[str, Any], llm: LLM) -> float:
        client = AnthropicChatCompletionClient(
            model=llm.model,
            base_url=llm.anthropic_base_url,
            api_key="x",
            max_retries=0,
            max_tokens=256,
            model_info=AUTOGEN_MODEL_INFO,
        )
        client._client = _SamplingInExtraBody(client._client)
        solver = AssistantAgent(
            "solver",
            client,
            tools=[add, divide],
            system_message=SOLVER_PROMPT,
            reflect_on_tool_use=True,
            max_tool_iterations=3,
            model_client_stream=streamed,
        )
        result = await solver.run(task=task["question"])
        await client.close()
        return 1.0 if result.messages[-1].content == FINAL_ANSWER else 0.0

    originals = {
        name: BaseAnthropicChatCompletionClient.__dict__[name] for name in ("create", "create_stream")
    }
    agl_autogen.instrument(tracer_provider=agl_stack.provider, capture_content=True)
    try:
        patched = {name: BaseAnthropicChatCompletionClient.__dict__[name] for name in originals}
        assert all(patched[name] is not originals[name] for name in originals)
        _, spans = _run(agl_stack, solve)
    finally:
        agl_autogen.uninstrument()
    assert {name: BaseAnthropicChatCompletionClient.__dict__[name] for name in originals} == originals
    _check_trains(agl_stack, spans)
    framework = [s for s in spans if s.attributes.get(R.SOURCE) == R.SOURCE_AUTOGEN and kind_of(s) != TOOL]
    calls = [s for s in framework if s.attributes.get(R.GEN_AI_OPERATION_NAME) == R.OP_CHAT]
    assert len(calls) == 3 and all(s.attributes[R.GEN_AI_USAGE_INPUT_TOKENS] > 0 for s in calls)
