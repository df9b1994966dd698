"""agl's framework adapters as OpenTelemetry instrumentors, for ``opentelemetry-instrument``.

Each adapter package exports a subclass of :class:`AdapterInstrumentor` (``agl_langchain.
LangChainInstrumentor``, ``agl_openai_agents.OpenAIAgentsInstrumentor``, ``agl_autogen.
AutoGenInstrumentor``) and registers it under the ``opentelemetry_instrumentor`` entry point, as every
OpenTelemetry and OpenInference instrumentation does. So ``opentelemetry-instrument python agent.py``
turns agl's capture on with no change to the agent, and ``XInstrumentor().instrument(...)`` is the
OpenTelemetry way of calling the adapter's ``instrument(...)``. Where the spans go is the environment's
(``AGL_STORE_URL`` or ``OTEL_EXPORTER_OTLP_*``, :func:`agl_core.tracing.export_from_environment`), or
the ``tracer_provider`` given.

This module needs ``opentelemetry-instrumentation`` (in each adapter's extra); ``agl_core`` itself does
not import it.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection
from typing import Any, ClassVar

from opentelemetry.instrumentation.instrumentor import (  # type: ignore[attr-defined]
    BaseInstrumentor,
)

__all__ = ["AdapterInstrumentor"]


class AdapterInstrumentor(BaseInstrumentor):  # type: ignore[misc]  # the base class has no types
    """An adapter as an OpenTelemetry instrumentor: :meth:`instrument` calls the adapter module's
    ``instrument()`` with the options it takes (``tracer_provider``, ``capture_content``...), and
    :meth:`uninstrument` its ``uninstrument()``. A subclass names the adapter module, the framework
    packages it needs (checked by OpenTelemetry before instrumenting) and the options it passes on."""

    adapter: ClassVar[str]
    dependencies: ClassVar[tuple[str, ...]]
    options: ClassVar[tuple[str, ...]] = ("tracer_provider", "capture_content")

    def instrumentation_dependencies(self) -> Collection[str]:
        return self.dependencies

    def _instrument(self, **kwargs: Any) -> None:
        module = importlib.import_module(self.adapter)
        module.instrument(**{k: v for k, v in kwargs.items() if k in self.options and v is not None})

    def _uninstrument(self, **kwargs: Any) -> None:
        importlib.import_module(self.adapter).uninstrument()
