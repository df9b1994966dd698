"""The Agents SDK trace processor on spans made through the SDK's own tracing API (no model needed)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agl_core import semconv
from agl_core.tracing import rollout_scope

pytest.importorskip("agents")


@pytest.fixture
def recorded():
    import agl_openai_agents

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    agl_openai_agents.instrument(tracer_provider=provider)
    yield provider, exporter
    agl_openai_agents.uninstrument()


def test_agents_guardrails_handoffs_responses_and_tool_errors_become_spans(recorded):
    from agents.tracing import (
        SpanError,
        agent_span,
        function_span,
        generation_span,
        guardrail_span,
        handoff_span,
        response_span,
        trace,
    )
    from openai.types.responses import Response, ResponseUsage

    provider, exporter = recorded
    with rollout_scope("ro-sdk", "at-1", tracer_provider=provider):
        with trace("workflow"):
            with agent_span("triage") as agent:
                with guardrail_span("no-pii", triggered=False) as guard:
                    guard.span_data.triggered = True
                with generation_span(model="m") as gen:
                    gen.span_data.output = [
                        {
                            "role": "assistant",
                            "tool_calls": [
                                {
                                    "id": "call-7",
                                    "type": "function",
                                    "function": {"name": "lookup", "arguments": '{"q": 1}'},
                                }
                            ],
                        }
                    ]
                    gen.span_data.usage = {"input_tokens": 11, "output_tokens": 3}
                with function_span("lookup", input='{"q": 1}') as fn:
                    fn.set_error(SpanError(message="Error running tool", data={"error": "boom"}))
                with handoff_span(from_agent="triage") as handoff:
                    handoff.span_data.to_agent = "solver"
                with response_span() as resp:
                    resp.span_data.response = Response.model_construct(
                        id="resp_1",
                        model="m",
                        output=[],
                        usage=ResponseUsage.model_construct(input_tokens=5, output_tokens=2),
                    )
    spans = {s.name: s for s in exporter.get_finished_spans()}
    agent = spans["invoke_agent triage"]
    assert agent.attributes[semconv.GEN_AI_OPERATION_NAME] == semconv.OP_INVOKE_AGENT
    assert agent.parent.span_id == spans[semconv.SPAN_ROLLOUT].context.span_id  # an SDK trace gets no span
    guard = spans["guardrail no-pii"]
    assert (
        guard.attributes[semconv.GUARDRAIL_TRIGGERED] is True
        and guard.attributes[semconv.GEN_AI_AGENT_NAME] == "triage"
    )
    gen = spans["chat m"]
    assert (
        gen.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 11
        and gen.parent.span_id == agent.context.span_id
    )
    tool = spans["execute_tool lookup"]
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call-7"
    assert tool.status.status_code.name == "ERROR" and "boom" in tool.status.description
    handoff = spans["handoff triage -> solver"]
    assert handoff.attributes[semconv.HANDOFF_TO_AGENT] == "solver"
    response = [
        s for s in exporter.get_finished_spans() if s.attributes.get(semconv.GEN_AI_RESPONSE_ID) == "resp_1"
    ]
    assert len(response) == 1 and response[0].attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 2
    for span in exporter.get_finished_spans():
        if span.name != semconv.SPAN_ROLLOUT:
            assert span.attributes[semconv.ROLLOUT_ID] == "ro-sdk"
            assert span.attributes[semconv.SOURCE] == semconv.SOURCE_OPENAI_AGENTS


def test_generation_spans_put_their_traceparent_on_the_request_headers(recorded):
    from agents.models.chatcmpl_helpers import HEADERS_OVERRIDE
    from agents.tracing import generation_span, trace

    _, exporter = recorded
    seen = {}
    with trace("workflow"):
        with generation_span(model="m"):
            seen.update(HEADERS_OVERRIDE.get() or {})
    assert HEADERS_OVERRIDE.get() in (None, {})
    (gen,) = [s for s in exporter.get_finished_spans() if s.name == "chat m"]
    assert seen["traceparent"].startswith(f"00-{gen.context.trace_id:032x}-{gen.context.span_id:016x}-")
