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


class _IngestRecorder:
    """A local stand-in for OpenAI's trace ingest endpoint, counting the uploads it receives."""

    def __init__(self) -> None:
        import http.server
        import threading

        bodies: list[bytes] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                bodies.append(self.rfile.read(int(self.headers.get("content-length", 0))))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.bodies = bodies
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces/ingest"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("keep", [False, True])
def test_the_sdks_upload_to_openai_is_off_unless_kept(keep, caplog):
    """The SDK's default processor uploads traces to OpenAI; instrument() switches it off (and no
    'OPENAI_API_KEY is not set' warning is logged), keep_openai_export=True leaves it on, and
    uninstrument() puts it back."""
    from agents.tracing import custom_span, set_trace_processors, trace
    from agents.tracing.processors import BackendSpanExporter, BatchTraceProcessor

    import agl_openai_agents
    from agl_openai_agents._processor import _sdk_processors

    ingest = _IngestRecorder()
    uploader = BatchTraceProcessor(BackendSpanExporter(api_key="sk-test", endpoint=ingest.url))
    before = _sdk_processors()
    set_trace_processors([uploader])  # the SDK's default, aimed at a local "OpenAI"
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        agl_openai_agents.instrument(tracer_provider=provider, keep_openai_export=keep)
        with rollout_scope("ro-upload", tracer_provider=provider), trace("workflow"):
            with custom_span("step", data={"secret": "user data"}):
                pass
        uploader.force_flush()
        assert exporter.get_finished_spans(), "agl's own processor records the run"
        assert bool(ingest.bodies) is keep
        assert (uploader in (_sdk_processors() or ())) is keep
        agl_openai_agents.uninstrument()
        assert uploader in (_sdk_processors() or ())
    finally:
        if agl_openai_agents.is_instrumented():
            agl_openai_agents.uninstrument()
        uploader.shutdown()
        set_trace_processors(list(before or ()))
        ingest.close()
    assert "OPENAI_API_KEY is not set" not in caplog.text


def test_by_default_no_processor_uploads_to_openai():
    from agents.tracing import get_trace_provider

    import agl_openai_agents
    from agl_openai_agents._processor import _sdk_processors, _uploads_to_openai

    get_trace_provider()  # the SDK's default set-up, its upload processor included
    assert any(_uploads_to_openai(p) for p in _sdk_processors() or ())
    agl_openai_agents.instrument()
    try:
        assert not any(_uploads_to_openai(p) for p in _sdk_processors() or ())
    finally:
        agl_openai_agents.uninstrument()
