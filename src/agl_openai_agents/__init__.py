"""OpenAI Agents SDK adapter: ``agl_openai_agents.instrument()`` and every agent run is traced.

``instrument()`` adds a trace processor to the SDK (keeping the processors already there unless
``replace_processors=True``) and switches off the SDK's default upload of traces to OpenAI's servers
(``keep_openai_export=True`` keeps it); ``uninstrument()`` restores what was there. The SDK is imported
only when one of these is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._otel import OpenAIAgentsInstrumentor
    from ._processor import AglTracingProcessor, instrument, is_instrumented, uninstrument

__all__ = ["AglTracingProcessor", "instrument", "is_instrumented", "uninstrument", "OpenAIAgentsInstrumentor"]


def __getattr__(name: str) -> Any:
    if name == "OpenAIAgentsInstrumentor":  # needs opentelemetry-instrumentation (in this adapter's extra)
        from ._otel import OpenAIAgentsInstrumentor

        return OpenAIAgentsInstrumentor
    if name in __all__:
        from . import _processor

        return getattr(_processor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
