"""The Agents SDK's default model, which speaks the Responses API, trained through the gateway.

The agent is what a user writes: ``agl_openai_agents.instrument()`` and the SDK's default client pointed
at the rollout's gateway URL, nothing else. A triage agent hands over to a solver, which calls ``add``,
then ``divide`` (which raises), then answers. It runs as rollouts of agl's runner (async workers) against
the real store and the real gateway in front of the conformance suite's scripted policy; then the stored
spans go through ``spans_to_transitions`` and credit assignment, as the trainer reads them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agl_core import semconv
from agl_core.pipeline.credit import TOOL_ERROR, TOOL_SUCCESS, RewardWeights, assign_rewards
from agl_core.pipeline.spantree import TOOL, kind_of, source_of
from agl_core.pipeline.transitions import spans_to_transitions
from agl_core.records import RolloutStatus, Span
from agl_core.runner import LLM, LLM_RESOURCE
from agl_core.runner import Runner as AglRunner
from agl_core.testing import AglTestStack, tool_call
from agl_core.tracing import rollout_scope

from ._agents import FINAL_ANSWER, SOLVER_PROMPT, TRIAGE_PROMPT, add, divide, scenario_script

pytest.importorskip("agents")

R = semconv
QUESTION = "What is 2 + 3?"
#: ``(agent, reply)`` of every LLM call of a rollout, in order.
CALLS = [
    ("triage", tool_call("transfer_to_solver", {})),
    ("solver", tool_call("add", {"a": 2, "b": 3})),
    ("solver", tool_call("divide", {"a": 1, "b": 0})),
    ("solver", FINAL_ANSWER),
]
MODES = ("run", "streamed", "chained")


async def sdk_agent(task: dict[str, Any], llm: LLM) -> float:
    """The user's agent: the SDK's default (Responses) model on the client of the rollout's URL."""
    from agents import Agent, Runner, function_tool, set_default_openai_client
    from openai import AsyncOpenAI

    # use_for_tracing=False: the key would otherwise stay set for the SDK's own trace upload, process-wide
    set_default_openai_client(
        AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0), use_for_tracing=False
    )
    solver = Agent(
        name="solver",
        instructions=SOLVER_PROMPT,
        model=llm.model,
        tools=[function_tool(add), function_tool(divide)],
    )
    triage = Agent(name="triage", instructions=TRIAGE_PROMPT, model=llm.model, handoffs=[solver])
    if task["mode"] == "streamed":
        streamed = Runner.run_streamed(triage, task["question"])
        async for _ in streamed.stream_events():
            pass
        output = streamed.final_output
    else:  # "chained": each call sends only its new items, continuing by previous_response_id
        result = await Runner.run(
            triage, task["question"], auto_previous_response_id=task["mode"] == "chained"
        )
        output = result.final_output
    return 1.0 if output == FINAL_ANSWER else 0.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AglTestStack]:
    path: Path = tmp_path_factory.mktemp("sdk-responses") / "store.sqlite"
    with AglTestStack(script=scenario_script, path=path, batch=True) as kit:
        kit.client.put_resource(LLM_RESOURCE, {"base_url": kit.gateway_url, "model": "scripted"})
        yield kit


@pytest.fixture(scope="module")
def rollouts(stack: AglTestStack) -> dict[str, list[Span]]:
    """One rollout per mode, run by agl's runner; ``{mode: the rollout's stored spans}``."""
    from agents.models import _openai_shared

    import agl_openai_agents

    queued = stack.client.enqueue_rollouts(
        [{"task_id": f"t-{mode}", "input": {"mode": mode, "question": QUESTION}} for mode in MODES]
    )
    saved = _openai_shared.get_default_openai_client()
    agl_openai_agents.instrument(tracer_provider=stack.provider)
    runner = AglRunner(sdk_agent, stack.client, stack.provider, workers=1, mode="async").start()
    try:
        done = stack.client.wait_for_rollouts([r.rollout_id for r in queued], timeout_s=120)
    finally:
        runner.stop()
        agl_openai_agents.uninstrument()
        _openai_shared.set_default_openai_client(saved)  # None when none was set: as it was
    assert [r.status for r in done] == [RolloutStatus.SUCCEEDED] * len(MODES), [
        a.error for r in done for a in r.attempts
    ]
    return {r.input["mode"]: stack.spans(r.rollout_id) for r in done}


def _gateway_output_call_ids(span: Span) -> list[str]:
    (message,) = json.loads(span.attributes[R.GEN_AI_OUTPUT_MESSAGES])
    return [c["id"] for c in message.get("tool_calls") or []]


@pytest.mark.parametrize("mode", MODES)
def test_a_handoff_with_tools_on_the_default_model_trains(stack, rollouts, mode):
    spans = rollouts[mode]
    by_id = {s.span_id: s for s in spans}
    result = spans_to_transitions(spans)
    assert result.problems == (), result.problems
    transitions = result.transitions

    # one transition per call, with the exact ids: the reply the policy wrote, token for token
    assert [t.agent_name for t in transitions] == [agent for agent, _ in CALLS]
    tokenizer = stack.gateway.backend.tokenizer
    for t, (agent, reply) in zip(transitions, CALLS, strict=True):
        assert list(t.response_ids) == [*tokenizer.encode(reply), tokenizer.eos_token_id]
        assert t.response_logprobs == tuple([-0.5] * len(t.response_ids)) and t.policy_version == 0
        prompt = tokenizer.decode(list(t.prompt_ids))
        assert QUESTION in prompt and f"ROLE={agent}" in prompt
        gateway = by_id[t.span_id or ""]
        assert gateway.attributes[R.GATEWAY_PROTOCOL] == "responses"
        assert gateway.attributes[R.STREAM] is (mode == "streamed")
        messages = json.loads(gateway.attributes[R.GEN_AI_INPUT_MESSAGES])
        backend = stack.gateway.backend
        assert list(t.prompt_ids) == backend.tokenizer.apply_chat_template(backend.render(messages))
    first = transitions[0]
    assert list(first.prompt_ids) == tokenizer.apply_chat_template(
        [{"role": "system", "content": TRIAGE_PROMPT}, {"role": "user", "content": QUESTION}]
    )

    # each SDK response span is joined to its gateway span by the response id, and is its parent too
    framework = {g: by_id[f] for f, g in result.joins.items()}
    for t in transitions:
        sdk = framework[t.span_id or ""]
        assert source_of(sdk) == R.SOURCE_OPENAI_AGENTS
        assert sdk.attributes[R.GEN_AI_RESPONSE_ID] == by_id[t.span_id or ""].attributes[R.GEN_AI_RESPONSE_ID]
        assert by_id[t.span_id or ""].parent_span_id == sdk.span_id

    # the tool spans name the call ids the calls that requested them returned
    tools = {s.name.split(" ")[-1]: s for s in spans if kind_of(s) == TOOL}
    assert set(tools) == {"add", "divide"} and tools["divide"].is_error and not tools["add"].is_error
    for index, name in ((1, "add"), (2, "divide")):
        requested = _gateway_output_call_ids(by_id[transitions[index].span_id or ""])
        assert [tools[name].attributes[R.GEN_AI_TOOL_CALL_ID]] == requested

    # and the tool rewards go to those calls
    credit = assign_rewards(result, spans, weights=RewardWeights(tool_error=-0.5, tool_success=0.1))
    assert [(e.kind, e.call_index, e.label) for e in credit.applied] == [
        (TOOL_SUCCESS, 1, "add"),
        (TOOL_ERROR, 2, "divide"),
    ]
    assert [t.reward for t in credit.transitions] == pytest.approx([1.0, 1.1, 0.5, 1.0])


def test_continuing_by_previous_response_id_prompts_the_policy_as_the_full_input_does(rollouts):
    prompts = {
        mode: [t.prompt_ids for t in spans_to_transitions(spans).transitions]
        for mode, spans in rollouts.items()
    }
    assert prompts["chained"] == prompts["run"] == prompts["streamed"]
    chained = [s for s in rollouts["chained"] if s.attributes.get(R.SOURCE) == R.SOURCE_GATEWAY]
    assert len(chained) == len(CALLS)


# --- the processor on the SDK's own tracing API ------------------------------------------------------------
def test_response_spans_give_their_function_calls_to_the_tool_spans_and_their_traceparent_to_the_request():
    from agents.models.openai_responses import _HEADERS_OVERRIDE
    from agents.tracing import function_span, response_span, trace
    from openai.types.responses import Response, ResponseFunctionToolCall
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import agl_openai_agents

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    call = ResponseFunctionToolCall(
        type="function_call", call_id="call_9", name="lookup", arguments='{"q": 1}', id="fc_1"
    )
    agl_openai_agents.instrument(tracer_provider=provider, capture_content=True)
    try:
        seen: dict[str, str] = {}
        with rollout_scope("ro-sdk-resp", tracer_provider=provider), trace("workflow"):
            with response_span() as resp:
                seen.update(_HEADERS_OVERRIDE.get() or {})
                resp.span_data.response = Response.model_construct(id="resp_9", model="m", output=[call])
            assert _HEADERS_OVERRIDE.get() in (None, {})
            with function_span("lookup", input='{"q": 1}'):
                pass
    finally:
        agl_openai_agents.uninstrument()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    chat = spans["chat"]  # its model is known only when it ends
    assert chat.attributes[R.GEN_AI_RESPONSE_ID] == "resp_9"
    assert seen["traceparent"].startswith(f"00-{chat.context.trace_id:032x}-{chat.context.span_id:016x}-")
    assert spans["execute_tool lookup"].attributes[R.GEN_AI_TOOL_CALL_ID] == "call_9"
    assert json.loads(chat.attributes[R.GEN_AI_OUTPUT_MESSAGES]) == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_9", "type": "function", "function": {"name": "lookup", "arguments": '{"q": 1}'}}
            ],
        }
    ]
