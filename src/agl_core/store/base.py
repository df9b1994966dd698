"""The ``Store`` protocol every backend implements, and the errors it raises."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from ..pipeline.rewards import Reward, RewardRange, StoredReward
from ..records import Attempt, Resource, Rollout, RolloutStatus, Span

__all__ = [
    "NotFoundError",
    "RolloutFilter",
    "RolloutPage",
    "RolloutRequest",
    "Store",
    "StoreError",
    "StoreUnavailableError",
    "validate_merge",
]


class StoreError(Exception):
    """A store operation was refused; the message says why."""


class NotFoundError(StoreError):
    pass


class StoreUnavailableError(StoreError):
    """The store could not be reached or answered "try later" (HTTP 5xx); retrying later may succeed."""


RolloutRequest = dict[str, Any]
"""``{"task_id": str, "input": Any, "group_id"?: str, "rollout_id"?: str, "metadata"?: dict,
"max_attempts"?: int}``"""


#: Most rollouts one page of :meth:`Store.list_rollouts` holds.
MAX_PAGE = 500
#: Matching rollouts are counted up to this many; beyond it the total reads "at least". With an agent
#: filter, which reads span bodies, up to ``AGENT_COUNT_CAP``.
COUNT_CAP = 100_000
AGENT_COUNT_CAP = 1_000
#: Longest text a rollout listing searches span content for.
MAX_SEARCH = 256


#: Longest rollout id a merge names (the store indexes rollout ids of up to 256 characters).
MAX_ROLLOUT_ID = 256


def validate_merge(moves: Mapping[str, str]) -> dict[str, str]:
    """The ``old -> new`` pairs of :meth:`Store.merge_rollouts` that move anything (a rollout merged into
    itself is left out); :class:`StoreError` for an id that is not a non-empty string of at most 256
    characters without NUL, or a rollout that is both merged away and merged into."""
    pairs: dict[str, str] = {}
    for old, new in moves.items():
        for what, value in (("merged rollout", old), ("target rollout", new)):
            if not isinstance(value, str) or not value or len(value) > MAX_ROLLOUT_ID or "\x00" in value:
                raise StoreError(
                    f"{what} id {str(value)[:80]!r}: give a non-empty string of at most {MAX_ROLLOUT_ID}"
                    " characters, without NUL"
                )
        if old != new:
            pairs[old] = new
    both = sorted(set(pairs) & set(pairs.values()))
    if both:
        raise StoreError(f"rollout {both[0]!r} is both merged into another and merged into: merge it once")
    return pairs


@dataclasses.dataclass(frozen=True)
class RolloutFilter:
    """Which rollouts :meth:`Store.list_rollouts` lists; every given field must match.

    ``step``, ``split`` and ``run`` are the trainer's ``metadata["step"]`` / ``["split"]`` / ``["run"]``
    (the run's output folder name); ``agent``
    matches rollouts with a span naming that agent (``gen_ai.agent.name`` or OpenInference's
    ``agent.name``); ``text`` rollouts with a span whose name, an attribute's key or a text value
    contains it (case-sensitive, as stored: after redaction); the reward bounds are inclusive and leave
    out rollouts without a reward.
    """

    statuses: tuple[str, ...] = ()
    task_id: str | None = None
    group_id: str | None = None
    step: int | None = None
    split: str | None = None
    run: str | None = None
    agent: str | None = None
    text: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None

    def __post_init__(self) -> None:
        if self.text is not None and not 0 < len(self.text) <= MAX_SEARCH:
            raise ValueError(f"a search text must be 1 to {MAX_SEARCH} characters")
        if self.reward_min is not None and self.reward_max is not None and self.reward_min > self.reward_max:
            raise ValueError(f"reward_min ({self.reward_min}) is above reward_max ({self.reward_max})")


@dataclasses.dataclass(frozen=True)
class RolloutPage:
    """One page of rollouts, newest first. ``before`` continues the listing (``None`` at its end);
    ``total`` counts every match up to :data:`COUNT_CAP` (:data:`AGENT_COUNT_CAP` with an agent filter;
    ``total_capped`` when there are more)."""

    rollouts: list[Rollout]
    #: store order of each listed rollout, and its stored span count
    seqs: list[int]
    span_counts: dict[str, int]
    before: int | None
    total: int
    total_capped: bool


class Store(Protocol):
    """Spans, rollouts, attempts and resources, shared by every backend.

    Rollout life cycle: ``queued`` -> ``running`` (an attempt holds a lease, kept by heartbeats) ->
    ``succeeded`` | ``failed`` | ``timed_out`` | ``cancelled``. A failed or timed-out attempt with tries
    left puts its rollout back in the queue.
    """

    #: The values a reward may take (``agl store serve --reward-min/--reward-max``); a reward outside it
    #: is refused, with the range in the message.
    reward_range: RewardRange

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
        (:mod:`agl_core.pipeline.rewards`); all or none. Idempotent by reward id: the same reward again
        changes nothing (``created=False``), a different one under a stored id raises :class:`StoreError`; an
        unknown rollout, trace or span raises :class:`NotFoundError`."""

    def reclaim_expired(self, now: float | None = None) -> int: ...

    def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]: ...

    def list_rollouts(
        self, where: RolloutFilter | None = None, *, before: int | None = None, limit: int = 50
    ) -> RolloutPage:
        """A page of the rollouts matching ``where``, newest first, starting below store order
        ``before`` (keyset paging: a page costs the same on a store of any size)."""

    def put_resource(self, name: str, value: Any, *, keep: int | None = None) -> Resource:
        """Publish a new version of a named resource (versions count up from 1); with ``keep``, only the
        latest ``keep`` versions are kept (older ones are deleted in the same transaction)."""

    def get_resource(self, name: str) -> Resource | None: ...

    def mark_consumed(self, rollout_ids: Sequence[str]) -> int: ...

    def merge_rollouts(self, moves: Mapping[str, str]) -> int:
        """Move the spans of each rollout ``old`` into rollout ``new`` (``{old: new}``), rewriting the
        rollout id each span carries, and delete the record of ``old``; all or none. Only rollouts that
        never ran under the queue (observed, imported) can be merged. Returns how many spans moved."""

    def apply_retention(
        self, *, max_age_s: float | None = None, consumed: bool = False, now: float | None = None
    ) -> int: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...
