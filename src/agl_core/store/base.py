"""The ``Store`` protocol every backend implements, and the errors it raises."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from ..records import Attempt, Resource, Rollout, RolloutStatus, Span
from ..rewards import Reward, StoredReward

__all__ = ["NotFoundError", "RolloutRequest", "Store", "StoreError", "StoreUnavailableError"]


class StoreError(Exception):
    """A store operation was refused; the message says why."""


class NotFoundError(StoreError):
    pass


class StoreUnavailableError(StoreError):
    """The store could not be reached or answered "try later" (HTTP 5xx); retrying later may succeed."""


RolloutRequest = dict[str, Any]
"""``{"task_id": str, "input": Any, "group_id"?: str, "rollout_id"?: str, "metadata"?: dict,
"max_attempts"?: int}``"""


class Store(Protocol):
    """Spans, rollouts, attempts and resources, shared by every backend.

    Rollout life cycle: ``queued`` -> ``running`` (an attempt holds a lease, kept by heartbeats) ->
    ``succeeded`` | ``failed`` | ``timed_out`` | ``cancelled``. A failed or timed-out attempt with tries
    left puts its rollout back in the queue.
    """

    def add_span_rows(self, rows: Sequence[Any], scopes: dict[bytes, tuple[bytes, bytes]]) -> int:
        """Write decoded OTLP spans (idempotent on trace id + span id). Returns how many were new."""

    def add_spans(self, spans: Sequence[Span]) -> int:
        """Write span records (idempotent on trace id + span id). Returns how many were new."""

    def query_spans(
        self,
        *,
        rollout_ids: Sequence[str] | None = None,
        attempt_id: str | None = None,
        trace_id: str | None = None,
        start_after_ns: int | None = None,
        start_before_ns: int | None = None,
        after_seq: int = 0,
        limit: int = 10_000,
    ) -> list[Span]:
        """Spans matching every given filter, in store order (``seq``)."""

    def enqueue_rollouts(self, requests: Iterable[RolloutRequest]) -> list[Rollout]: ...

    def add_observed_rollouts(self, requests: Iterable[RolloutRequest]) -> list[Rollout]:
        """Record rollouts that ran outside the queue (imported traces), already finished: stored as
        ``succeeded`` with no attempt. Every request needs a ``rollout_id``; one that exists already is
        left as it is, so recording the same rollouts again changes nothing. Returns them as stored."""

    def dequeue_rollout(self, worker_id: str, *, lease_s: float = 60.0) -> tuple[Rollout, Attempt] | None:
        """Claim the oldest queued rollout and start a new attempt of it, or ``None`` if none is queued."""

    def heartbeat(self, attempt_id: str, *, lease_s: float = 60.0) -> Attempt:
        """Extend a running attempt's lease; the returned status says whether to go on."""

    def complete_attempt(
        self,
        attempt_id: str,
        status: RolloutStatus,
        *,
        reward: float | None = None,
        error: str | None = None,
    ) -> Rollout:
        """Finish an attempt. A failed attempt with tries left puts its rollout back in the queue."""

    def cancel_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]: ...

    def add_rewards(self, rewards: Sequence[Reward]) -> list[StoredReward]:
        """Attach rewards to rollouts, traces or spans after the fact, as ``agl.reward`` spans
        (:mod:`agl_core.rewards`); all or none. Idempotent by reward id: the same reward again changes
        nothing (``created=False``), a different one under a stored id raises :class:`StoreError`; an
        unknown rollout, trace or span raises :class:`NotFoundError`."""

    def reclaim_expired(self, now: float | None = None) -> int: ...

    def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]: ...

    def put_resource(self, name: str, value: Any) -> Resource:
        """Publish a new version of a named resource (versions count up from 1)."""

    def get_resource(self, name: str) -> Resource | None: ...

    def mark_consumed(self, rollout_ids: Sequence[str]) -> int: ...

    def apply_retention(
        self, *, max_age_s: float | None = None, consumed: bool = False, now: float | None = None
    ) -> int: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...
