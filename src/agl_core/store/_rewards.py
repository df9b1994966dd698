"""Placing late rewards in a SQL store: find each target, build the reward's span, check the id ledger.

:class:`RewardPlacer` only reads (through the write transaction's connection, so what the transaction
already wrote is seen); :meth:`SqlStore.add_rewards` writes what it returns. The ``reward_ids`` table
maps each reward id to the reward it names and where its span went: a second post of the same id is
answered from it (same reward) or refused (different one), whichever target it names.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

from .. import semconv
from ..pipeline.rewards import Reward, StoredReward, reward_span, reward_trace_id
from ..records import Span
from .base import NotFoundError, StoreError
from .formats.otlp import row_to_span

__all__ = ["LEDGER_COLUMNS", "RewardConflictError", "RewardPlacer", "ledger_row"]

#: Columns of the ``reward_ids`` table, in the order :func:`ledger_row` gives them.
LEDGER_COLUMNS = "reward_id, request, rollout_id, trace_id, span_id, parent_span_id, time_ns, created_at"

Read = Callable[[str, Sequence[Any]], list[Any]]


class RewardConflictError(StoreError):
    """A reward id already names a different reward (HTTP 409)."""


def ledger_row(stored: StoredReward, created_at: float) -> tuple[Any, ...]:
    request = stored.requested.to_json()
    return (
        stored.reward_id,
        json.dumps(request, separators=(",", ":"), ensure_ascii=False),
        stored.rollout_id,
        bytes.fromhex(stored.trace_id),
        bytes.fromhex(stored.span_id),
        bytes.fromhex(stored.parent_span_id) if stored.parent_span_id else None,
        stored.time_ns,
        created_at,
    )


def _from_ledger(row: Sequence[Any]) -> StoredReward:
    _, request, rollout_id, trace_id, span_id, parent, time_ns, _ = row
    return StoredReward(
        Reward.from_json(json.loads(request)),
        rollout_id,
        bytes(trace_id).hex(),
        bytes(span_id).hex(),
        bytes(parent).hex() if parent is not None else None,
        int(time_ns),
        created=False,
    )


def _conflict(reward: Reward, stored: StoredReward) -> RewardConflictError:
    was = stored.requested
    return RewardConflictError(
        f"reward id {reward.reward_id!r} is already stored as a different reward (value {was.value:g}, name"
        f" {was.name!r}, source {was.source!r}, {was.describe_target()}); a reward id names one reward:"
        " post a changed reward under a new reward_id"
    )


class RewardPlacer:
    """Where each reward of one request goes; see :mod:`agl_core.pipeline.rewards` for the rules."""

    def __init__(self, read: Read, now_ns: int) -> None:
        self._read = read
        self._now_ns = now_ns
        #: Rewards of this request so far, by id (a request may repeat an id).
        self._seen: dict[str, StoredReward] = {}

    def place(self, reward: Reward) -> tuple[StoredReward, Span | None]:
        """The stored form of ``reward`` and its span to write (``None`` when it was stored before).
        Raises :class:`NotFoundError` for a target the store does not hold, :class:`RewardConflictError`
        for a reward id already naming another reward."""
        earlier = self._seen.get(reward.reward_id) or self._ledger(reward.reward_id)
        if earlier is not None:
            if not reward.same_as(earlier):
                raise _conflict(reward, earlier)
            return dataclasses.replace(earlier, created=False), None
        parent: Span | None
        rollout_id: str | None
        if reward.span_id is not None:
            parent = self._span(reward)
            rollout_id = parent.rollout_id or self._trace_rollout(parent.trace_id, reward.rollout_id)
            trace_id, task_id = parent.trace_id, None
        elif reward.trace_id is not None:
            trace_id = reward.trace_id
            rollout_id = self._trace_rollout(trace_id, reward.rollout_id)
            parent = self._trace_root(trace_id)
            task_id = None
        else:
            assert reward.rollout_id is not None  # Reward checks that it has a target
            rollout_id = reward.rollout_id
            parent, task_id = self._rollout_root(rollout_id)
            trace_id = parent.trace_id if parent is not None else reward_trace_id(reward.reward_id)
        time_ns = reward.time_ns if reward.time_ns is not None else self._now_ns
        span = reward_span(
            reward, trace_id=trace_id, parent=parent, rollout_id=rollout_id, time_ns=time_ns, task_id=task_id
        )
        stored = StoredReward(reward, rollout_id, span.trace_id, span.span_id, span.parent_span_id, time_ns)
        self._seen[reward.reward_id] = stored
        return stored, span

    # --- lookups -----------------------------------------------------------------------------------
    def _ledger(self, reward_id: str) -> StoredReward | None:
        rows = self._read(f"SELECT {LEDGER_COLUMNS} FROM reward_ids WHERE reward_id = ?", [reward_id])
        return _from_ledger(rows[0]) if rows else None

    def _one_span(self, where: str, args: Sequence[Any], order: str = "seq") -> Span | None:
        rows = self._read(f"SELECT seq, body FROM spans WHERE {where} ORDER BY {order} LIMIT 1", args)
        return row_to_span(rows[0][0], bytes(rows[0][1]), {}) if rows else None

    def _span(self, reward: Reward) -> Span:
        assert reward.span_id is not None
        where: list[str] = ["span_id = ?"]
        args: list[Any] = [bytes.fromhex(reward.span_id)]
        if reward.trace_id is not None:
            where.append("trace_id = ?")
            args.append(bytes.fromhex(reward.trace_id))
        if reward.rollout_id is not None:
            where.append("rollout_id = ?")
            args.append(reward.rollout_id)
        span = self._one_span(" AND ".join(where), args)
        if span is None:
            raise NotFoundError(f"the store holds no {reward.describe_target()}")
        return span

    def _trace_rollout(self, trace_id: str, rollout_id: str | None) -> str | None:
        """The rollout a trace's spans belong to; ``rollout_id`` when given, which they must carry."""
        raw = bytes.fromhex(trace_id)
        if rollout_id is not None:
            if not self._read(
                "SELECT 1 FROM spans WHERE trace_id = ? AND rollout_id = ? LIMIT 1", [raw, rollout_id]
            ):
                raise NotFoundError(f"the store holds no span of rollout {rollout_id!r} in trace {trace_id}")
            return rollout_id
        rows = self._read(
            "SELECT DISTINCT rollout_id FROM spans WHERE trace_id = ? AND rollout_id IS NOT NULL LIMIT 2",
            [raw],
        )
        if len(rows) > 1:
            raise StoreError(
                f"trace {trace_id} holds spans of several rollouts ({rows[0][0]!r}, {rows[1][0]!r}, ...);"
                " give the rollout_id the reward is for"
            )
        if rows:
            return str(rows[0][0])
        if not self._read("SELECT 1 FROM spans WHERE trace_id = ? LIMIT 1", [raw]):
            raise NotFoundError(f"the store holds no span of trace {trace_id}")
        return None

    def _trace_root(self, trace_id: str) -> Span | None:
        return self._one_span(
            "trace_id = ? AND parent_span_id IS NULL", [bytes.fromhex(trace_id)], "start_ns, seq"
        )

    def _rollout_root(self, rollout_id: str) -> tuple[Span | None, str | None]:
        """The rollout's latest ``agl.rollout`` span and task id. A rollout is known to the store by its
        row (queued through the API) or by spans that carry its id (any sender); else NotFoundError."""
        rows = self._read("SELECT task_id FROM rollouts WHERE rollout_id = ?", [rollout_id])
        task_id = str(rows[0][0]) if rows else None
        root = self._one_span(
            "rollout_id = ? AND name = ?", [rollout_id, semconv.SPAN_ROLLOUT], "start_ns DESC, seq DESC"
        )
        if (
            root is None
            and not rows
            and not self._read("SELECT 1 FROM spans WHERE rollout_id = ? LIMIT 1", [rollout_id])
        ):
            raise NotFoundError(
                f"no rollout {rollout_id!r}: the store has neither queued it nor received a span of it"
            )
        return root, task_id
