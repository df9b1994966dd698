"""LangChain / LangGraph adapter: ``agl_langchain.instrument()`` and every run is traced.

``instrument()`` adds agl's handler to every LangChain run through LangChain's configure hook (no
``callbacks`` argument needed); ``uninstrument()`` stops it. ``AglCallbackHandler()`` in ``callbacks``
traces just the runs it is given. LangChain is imported only when one of these is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._callback import AglCallbackHandler, instrument, is_instrumented, uninstrument
    from ._otel import LangChainInstrumentor

__all__ = ["AglCallbackHandler", "instrument", "is_instrumented", "uninstrument", "LangChainInstrumentor"]


def __getattr__(name: str) -> Any:
    if name == "LangChainInstrumentor":  # needs opentelemetry-instrumentation (in this adapter's extra)
        from ._otel import LangChainInstrumentor

        return LangChainInstrumentor
    if name in __all__:
        from . import _callback

        return getattr(_callback, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
