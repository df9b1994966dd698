"""The ``Store`` protocol every backend implements, and the errors it raises."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from ..records import Attempt, Resource, Rollout, RolloutStatus, Span

__all__ = ["NotFoundError", "RolloutRequest", "Store", "StoreError"]


class StoreError(Exception):
    """A store operation was refused; the message says why."""


class NotFoundError(StoreError):
    pass


RolloutRequest = dict[str, Any]
"""``{"task_id": str, "input": Any, "group_id"?: str, "metadata"?: dict, "max_attempts"?: int}``"""


class Store(Protocol):
    """Spans, rollouts, attempts and resources; shared by every backend."""

    def add_spans(self, spans: Sequence[Span]) -> int:
        """Store spans once each (idempotent on trace id + span id). Returns how many were new."""

    def query_spans(
        self,
        *,
        rollout_ids: Sequence[str] | None = None,
        trace_id: str | None = None,
        after_seq: int = 0,
        limit: int = 10_000,
    ) -> list[Span]:
        """Spans matching every given filter, in store order (``seq``)."""

    def enqueue_rollouts(self, requests: Iterable[RolloutRequest]) -> list[Rollout]: ...

    def dequeue_rollout(self, worker_id: str) -> tuple[Rollout, Attempt] | None:
        """Claim the oldest queued rollout and start a new attempt of it, or ``None`` if none is queued."""

    def complete_attempt(
        self,
        attempt_id: str,
        status: RolloutStatus,
        *,
        reward: float | None = None,
        error: str | None = None,
    ) -> Rollout:
        """Finish an attempt. A failed attempt with tries left puts its rollout back in the queue."""

    def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]: ...

    def put_resource(self, name: str, value: Any) -> Resource:
        """Publish a new version of a named resource (versions count up from 1)."""

    def get_resource(self, name: str) -> Resource | None: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...
