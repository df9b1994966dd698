"""Span structure of the LangChain callback: nesting, tools with status, rollout identity."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agl_core import semconv
from agl_core.tracing import rollout_scope

pytest.importorskip("langchain_core")


def test_tool_spans_nest_under_their_step_and_record_errors():
    from langchain_core.runnables import RunnableLambda
    from langchain_core.tools import tool

    from agl_langchain import AglCallbackHandler

    @tool
    def divide(a: int, b: int) -> float:
        """Divide a by b."""
        return a / b

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    handler = AglCallbackHandler(agent_name="calc", tracer_provider=provider)

    def step(x):
        ok = divide.invoke({"a": x, "b": 2})
        try:
            divide.invoke({"a": x, "b": 0})
        except ZeroDivisionError:
            pass
        return ok

    with rollout_scope("ro-tool", "at-1", tracer_provider=provider):
        assert RunnableLambda(step, name="solve").invoke(6, config={"callbacks": [handler]}) == 3.0
    spans = {(s.name, s.status.status_code.name): s for s in exporter.get_finished_spans()}
    solve = spans[("solve", "UNSET")]  # success leaves the status unset
    good = spans[("execute_tool divide", "UNSET")]
    bad = spans[("execute_tool divide", "ERROR")]
    root = spans[(semconv.SPAN_ROLLOUT, "UNSET")]
    assert solve.parent.span_id == root.context.span_id
    assert good.parent.span_id == solve.context.span_id and bad.parent.span_id == solve.context.span_id
    assert bad.attributes[semconv.ERROR_TYPE] == "ZeroDivisionError"
    assert "division by zero" in bad.status.description
    assert good.attributes[semconv.GEN_AI_TOOL_NAME] == "divide"
    assert solve.attributes[semconv.GEN_AI_AGENT_NAME] == "calc"
    for span in (solve, good, bad):
        assert (
            span.attributes[semconv.ROLLOUT_ID] == "ro-tool" and span.attributes[semconv.ATTEMPT_ID] == "at-1"
        )
        assert span.attributes[semconv.SOURCE] == semconv.SOURCE_LANGCHAIN


def test_concurrent_rollouts_in_threads_do_not_mix():
    from concurrent.futures import ThreadPoolExecutor

    from langchain_core.runnables import RunnableLambda

    from agl_langchain import AglCallbackHandler

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    handler = AglCallbackHandler(tracer_provider=provider)
    chain = RunnableLambda(lambda x: x * 2, name="double") | RunnableLambda(lambda x: x + 1, name="inc")

    def run(i):
        with rollout_scope(f"ro-{i}", tracer_provider=provider):
            return chain.invoke(i, config={"callbacks": [handler]})

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(run, range(16))) == [2 * i + 1 for i in range(16)]
    by_trace = {}
    for span in exporter.get_finished_spans():
        by_trace.setdefault(span.context.trace_id, set()).add(span.attributes[semconv.ROLLOUT_ID])
    assert len(by_trace) == 16 and all(len(ids) == 1 for ids in by_trace.values())


def test_a_tool_error_handed_to_the_model_as_the_result_is_still_an_error():
    from langchain_core.tools import StructuredTool, ToolException

    from agl_langchain import AglCallbackHandler

    def lookup(key: str) -> str:
        """Look a key up."""
        if key == "missing":
            raise ToolException("no such key")
        return "found"

    tool = StructuredTool.from_function(lookup, handle_tool_error=True, handle_validation_error=True)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    handler = AglCallbackHandler(tracer_provider=provider)
    with rollout_scope("ro-handled", tracer_provider=provider):
        for call_id, args in (("c1", {"key": "here"}), ("c2", {"key": "missing"}), ("c3", {"wrong": 1})):
            tool.invoke(
                {"name": "lookup", "args": args, "id": call_id, "type": "tool_call"},
                config={"callbacks": [handler]},
            )
    spans = [s for s in exporter.get_finished_spans() if s.name == "execute_tool lookup"]
    assert [s.status.status_code.name for s in spans] == ["UNSET", "ERROR", "ERROR"]
    assert [s.attributes.get(semconv.ERROR_TYPE) for s in spans] == [None] + [
        semconv.ERROR_TYPE_TOOL_RESULT
    ] * 2
    assert spans[1].status.description == "no such key"
    assert [s.attributes[semconv.GEN_AI_TOOL_CALL_ID] for s in spans] == ["c1", "c2", "c3"]
