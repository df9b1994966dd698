"""LangChain / LangGraph adapter: add ``AglCallbackHandler()`` to ``callbacks`` and the agent is traced."""

from ._callback import AglCallbackHandler

__all__ = ["AglCallbackHandler"]
