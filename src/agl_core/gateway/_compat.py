"""Adapting backends written against the first, blocking interface (``chat(model, request) -> Completion``)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from .backend import Backend, ChatRequest, Event

__all__ = ["as_backend"]


class _BlockingChatBackend:
    """Runs a blocking ``chat`` on a worker thread once per choice; no streaming deltas."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.kind = getattr(inner, "kind", type(inner).__name__)

    @property
    def model_names(self) -> Sequence[str]:
        return self.inner.model_names

    @property
    def trainable(self) -> bool:
        return bool(self.inner.trainable)

    @property
    def policy_version(self) -> int | None:
        return getattr(self.inner, "policy_version", None)

    async def generate(self, model: str, request: ChatRequest) -> AsyncIterator[Event]:
        for index in range(request.n):
            result = await asyncio.to_thread(self.inner.chat, model, request)
            yield dataclasses.replace(result, index=index)


def as_backend(backend: Any) -> Backend:
    """``backend`` itself when it has ``generate``; a blocking ``chat`` backend wrapped; else TypeError."""
    if callable(getattr(backend, "generate", None)):
        return backend  # type: ignore[no-any-return]
    if callable(getattr(backend, "chat", None)):
        return _BlockingChatBackend(backend)  # type: ignore[return-value]
    raise TypeError(
        f"{type(backend).__name__} is not a gateway backend: it has neither generate() nor chat()"
    )
