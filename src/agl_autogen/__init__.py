"""AutoGen AgentChat adapter: ``agl_autogen.instrument()`` and every agent, team, tool call and model
call is traced; ``agl_autogen.uninstrument()`` restores AutoGen exactly. AutoGen is imported only when
one of these is called."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._instrument import instrument, is_instrumented, uninstrument
    from ._otel import AutoGenInstrumentor

__all__ = ["instrument", "is_instrumented", "uninstrument", "AutoGenInstrumentor"]


def __getattr__(name: str) -> Any:
    if name == "AutoGenInstrumentor":  # needs opentelemetry-instrumentation (in this adapter's extra)
        from ._otel import AutoGenInstrumentor

        return AutoGenInstrumentor
    if name in __all__:
        from . import _instrument

        return getattr(_instrument, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
