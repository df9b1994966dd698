"""``AutoGenInstrumentor``: this adapter as an OpenTelemetry instrumentor, found by
``opentelemetry-instrument`` through its ``opentelemetry_instrumentor`` entry point
(:mod:`agl_core.capture.otel_instrumentor`)."""

from __future__ import annotations

from agl_core.capture.otel_instrumentor import AdapterInstrumentor

__all__ = ["AutoGenInstrumentor"]


class AutoGenInstrumentor(AdapterInstrumentor):
    """agl's AutoGen AgentChat adapter for OpenTelemetry's instrumentation machinery:
    ``instrument(**options)`` calls ``agl_autogen.instrument(**options)``, ``uninstrument()`` calls
    ``agl_autogen.uninstrument()``."""

    adapter = "agl_autogen"
    dependencies = ("autogen-agentchat >= 0.7",)
    options = ("tracer_provider", "capture_content")
