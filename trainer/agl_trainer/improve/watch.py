"""Watching the store for ``agl improve``: the spans read so far, kept in memory and extended at each look
by the spans stored since (by their ``seq``), the rollout records, and what the service asks of them: the
rollouts the filter matches that carry a reward, and each policy version's live reward.

Late rewards are spans too, so a rollout rewarded after the last look arrives with the next page.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from agl_core import semconv, settings
from agl_core.pipeline.spantree import GATEWAY, kind_of
from agl_core.pipeline.transitions import episode_rewards
from agl_core.records import Rollout, Span
from agl_core.store import SpanReader, connect

from ..config import TracesConfig
from ..run.traces import Selection, select

__all__ = ["StoreWatcher"]


class StoreWatcher:
    """The store ``traces.store`` names, read incrementally. :meth:`refresh` raises what the store raises
    when it cannot be reached (``StoreUnavailableError``, ``StoreError``, ``OSError``); nothing read is
    lost then, and the next refresh goes on from the same point."""

    def __init__(
        self, traces: TracesConfig, *, timed_out_too: bool = False, owner: str | None = None
    ) -> None:
        self.traces = traces
        self.timed_out_too = timed_out_too
        #: The service whose versions count: a gateway call another service's version served (its
        #: ``agl.policy.owner``) is no session of this one's versions, whatever its number.
        self.owner = owner
        #: The spans and records read so far (:attr:`spans`, :attr:`records`).
        self.reader = SpanReader()
        self._backend: Any = None
        #: Version -> live rewards :meth:`live_rewards` left out (not finite, or outside the range).
        self.ignored_rewards: dict[int, int] = {}

    def backend(self) -> Any:
        """The store's client (opened on first use; reopened after a failed look)."""
        if self._backend is None:
            self._backend = connect(self.traces.store, settings.store_token())
        return self._backend

    @property
    def spans(self) -> list[Span]:
        """Every span read so far, in the order the store keeps them."""
        return self.reader.spans

    @property
    def records(self) -> dict[str, Rollout]:
        """Rollout id -> its record, for the rollouts the spans name that have one."""
        return self.reader.records

    def close(self) -> None:
        if self._backend is not None:
            backend, self._backend = self._backend, None
            backend.close()

    def refresh(self) -> int:
        """Read the spans stored since the last look, and the records of rollouts still without one;
        how many new spans came."""
        try:
            return self.reader.read(self.backend())
        except BaseException:
            self.close()  # a store that went away: reconnect at the next look
            raise

    def selection(self, exclude: Iterable[str] = (), *, any_reward: bool = False) -> Selection:
        """The finished, rewarded rollouts ``traces.filter`` matches, less ``exclude``; ``any_reward``:
        whatever their reward (``reward_min`` not applied)."""
        wanted = self.traces.filter.model_copy(update={"has_reward": True})
        if any_reward:
            wanted = wanted.model_copy(update={"reward_min": None})
        traces = self.traces.model_copy(update={"filter": wanted})
        chosen = select(traces, self.spans, self.records, timed_out_too=self.timed_out_too)
        # only rollouts the store holds a record of: spans can name any rollout id
        known = tuple(r for r in chosen.rollouts if r.rollout_id in self.records)
        narrowing = (*chosen.narrowing, ("known to the store", len(known)))
        skip = set(exclude)
        kept = tuple(r for r in known if r.rollout_id not in skip)
        if skip:
            narrowing = (*narrowing, ("not trained on by an earlier round", len(kept)))
        ids = {r.rollout_id for r in kept}
        spans = tuple(s for s in chosen.spans if s.rollout_id in ids)
        return Selection(kept, spans, chosen.total, narrowing)

    def versions_of_rollouts(self) -> dict[str, set[int]]:
        """Rollout id -> the policy versions of this service (``owner``) that served its gateway calls; a
        session another service's version served in part is left out."""
        versions: dict[str, set[int]] = defaultdict(set)
        foreign: set[str] = set()
        for span in self.spans:
            if span.rollout_id is None or kind_of(span) != GATEWAY:
                continue
            owner = span.attributes.get(semconv.POLICY_OWNER)
            if self.owner is not None and owner is not None and owner != self.owner:
                foreign.add(span.rollout_id)  # another service's version served it: not a session of ours
                continue
            version = span.attributes.get(semconv.POLICY_VERSION)
            if isinstance(version, int) and not isinstance(version, bool):
                versions[span.rollout_id].add(version)
        return {rollout: served for rollout, served in versions.items() if rollout not in foreign}

    def live_rewards(
        self, reward_range: tuple[float, float] = (-math.inf, math.inf)
    ) -> dict[int, list[float]]:
        """Policy version -> the episode rewards of the rollouts the filter matches (whatever their reward)
        whose every gateway call that version served (a session served by two versions counts for
        neither). A reward that is not a finite number within ``reward_range`` is left out, and counted
        in :attr:`ignored_rewards` (version -> how many)."""
        versions = self.versions_of_rollouts()
        matched = {r.rollout_id for r in self.selection(any_reward=True).rollouts}
        low, high = reward_range
        out: dict[int, list[float]] = defaultdict(list)
        ignored: dict[int, int] = defaultdict(int)
        for rollout, reward in episode_rewards(self.spans).items():
            served = versions.get(rollout)
            if rollout in matched and served is not None and len(served) == 1:
                version = next(iter(served))
                if low <= reward <= high:  # NaN and the infinities fail too
                    out[version].append(reward)
                else:
                    ignored[version] += 1
        self.ignored_rewards = dict(ignored)
        return dict(out)

    def calls_by_version(self) -> list[tuple[int, int]]:
        """``(start time in ns, policy version)`` of every gateway call, in time order."""
        calls = []
        for span in self.spans:
            version = span.attributes.get(semconv.POLICY_VERSION)
            if kind_of(span) == GATEWAY and isinstance(version, int) and not isinstance(version, bool):
                calls.append((span.start_ns, version))
        return sorted(calls)
