"""``OpenAIAgentsInstrumentor``: this adapter as an OpenTelemetry instrumentor, found by
``opentelemetry-instrument`` through its ``opentelemetry_instrumentor`` entry point
(:mod:`agl_core.capture.otel_instrumentor`)."""

from __future__ import annotations

from agl_core.capture.otel_instrumentor import AdapterInstrumentor

__all__ = ["OpenAIAgentsInstrumentor"]


class OpenAIAgentsInstrumentor(AdapterInstrumentor):
    """agl's OpenAI Agents SDK adapter for OpenTelemetry's instrumentation machinery:
    ``instrument(**options)`` calls ``agl_openai_agents.instrument(**options)``, ``uninstrument()`` calls
    ``agl_openai_agents.uninstrument()``."""

    adapter = "agl_openai_agents"
    dependencies = ("openai-agents >= 0.2",)
    options = ("tracer_provider", "capture_content", "replace_processors", "keep_openai_export")
