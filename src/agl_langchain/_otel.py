"""``LangChainInstrumentor``: this adapter as an OpenTelemetry instrumentor, found by
``opentelemetry-instrument`` through its ``opentelemetry_instrumentor`` entry point
(:mod:`agl_core.capture.otel_instrumentor`)."""

from __future__ import annotations

from agl_core.capture.otel_instrumentor import AdapterInstrumentor

__all__ = ["LangChainInstrumentor"]


class LangChainInstrumentor(AdapterInstrumentor):
    """agl's LangChain / LangGraph adapter for OpenTelemetry's instrumentation machinery:
    ``instrument(**options)`` calls ``agl_langchain.instrument(**options)``, ``uninstrument()`` calls
    ``agl_langchain.uninstrument()``."""

    adapter = "agl_langchain"
    dependencies = ("langchain-core >= 0.3",)
    options = ("tracer_provider", "capture_content", "agent_name")
