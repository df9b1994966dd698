"""Rewards attached after the fact: to a rollout, a trace or a span, at any time.

A late reward is stored as what every reward already is, an ``agl.reward`` span
(:data:`~agl_core.semconv.SPAN_REWARD`, with ``agl.reward.value`` and ``agl.reward.name``), so
:func:`~agl_core.pipeline.transitions.spans_to_transitions` and :mod:`agl_core.pipeline.credit` read it
exactly as one emitted during the rollout. It also carries ``agl.reward.id`` and ``agl.reward.source``. Where
it goes:

* a rollout: a child of the rollout's latest ``agl.rollout`` span (in its trace), with the rollout's
  identity attributes; when the store holds no such span, a trace of its own named by the reward id;
* a trace: a child of the trace's root span, with the identity of the rollout the trace belongs to;
* a span: a child of that span, so credit gives a named reward to the LLM call that span is or belongs
  to (a reward is placed in time no later than the end of the span it hangs under).

Its time is the one given (default: when the store received it). Its span id, and its trace id when it
needs one of its own, are derived from the reward id, so the same reward posted twice is stored once.

This module is pure: the records, their validation and the span a reward becomes. The store places them
(:meth:`agl_core.store.Store.add_rewards`); ``POST /api/rewards``, ``StoreClient.add_rewards``,
``agl reward`` and ``emit_reward(..., rollout_id=...)`` send them.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from .. import semconv
from ..records import Span

__all__ = [
    "DEFAULT_SOURCE",
    "EPISODE",
    "DEFAULT_REWARD_RANGE",
    "Reward",
    "RewardRange",
    "RewardSink",
    "StoredReward",
    "format_time",
    "make_reward",
    "new_reward_id",
    "parse_time",
    "reward_span",
    "reward_span_id",
    "reward_trace_id",
]

#: The name of the episode reward; any other name is an intermediate reward of one LLM call.
EPISODE = "episode"
#: ``agl.reward.source`` of a reward posted without one.
DEFAULT_SOURCE = "api"
MAX_REWARD_ID = 128
MAX_ROLLOUT_ID = 512
MAX_SOURCE = 256
#: How far past the clock of the machine checking it a reward's time may lie (clock skew).
MAX_FUTURE_S = 3600.0
_MAX_TIME_NS = 2**63 - 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_TRACE_ID = re.compile(r"[0-9a-f]{32}")
_SPAN_ID = re.compile(r"[0-9a-f]{16}")


@dataclasses.dataclass(frozen=True)
class RewardRange:
    """The rewards a store (``agl store serve --reward-range``), ``agl reward`` and ``agl improve``
    (``improve.reward_range``) take: finite numbers from ``low`` to ``high`` inclusive. One absurd value
    (1e308, or an infinity sent over OTLP) would otherwise decide a mean, a gate or a rollback alone."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.low) and math.isfinite(self.high)) or self.low >= self.high:
            raise ValueError(f"a reward range needs finite MIN < MAX, got {self.low:g}:{self.high:g}")
        if max(abs(self.low), abs(self.high)) > 1e15:
            raise ValueError(f"a reward range must lie within ±1e15, got {self.low:g}:{self.high:g}")

    @classmethod
    def parse(cls, text: str) -> RewardRange:
        """``MIN:MAX`` (``-1e6:1e6``, ``0:1``)."""
        low, sep, high = text.partition(":")
        try:
            if not sep:
                raise ValueError
            return cls(float(low), float(high))
        except ValueError as exc:
            detail = f" ({exc})" if str(exc) else ""
            raise ValueError(f"reward range {text!r}: give MIN:MAX, e.g. -1:1 or 0:100{detail}") from None

    def problem(self, value: Any) -> str:
        """Why ``value`` is not a reward this range takes ('' when it is)."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"a reward must be a number, got {type(value).__name__}"
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an int beyond a double
            finite = False
        if not finite:
            return f"must be a finite number, got {str(value)[:40]}"
        if not self.low <= value <= self.high:
            return (
                f"reward {str(value)[:40]} is outside the accepted range {self.low:g} to {self.high:g}"
                " (--reward-range MIN:MAX widens it)"
            )
        return ""

    def __str__(self) -> str:
        return f"{self.low:g}:{self.high:g}"


#: What is taken unless the user says otherwise: any sane scale of reward, nothing that breaks a mean.
DEFAULT_REWARD_RANGE = RewardRange(-1e6, 1e6)


def _text(field: str, value: Any, max_length: int, *, control: bool = False) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{field}: must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{field}: must not be empty")
    if len(value) > max_length:
        raise ValueError(f"{field}: {len(value)} characters long, more than {max_length}")
    if "\x00" in value:
        raise ValueError(f"{field}: contains a NUL character")
    if control and _CONTROL.search(value):
        raise ValueError(f"{field}: contains a control character")
    return value


def _hex_id(field: str, value: Any, pattern: re.Pattern[str], size: int) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value.lower()):
        raise ValueError(f"{field}: must be {size} hex characters, got {str(value)[:80]!r}")
    if not any(c != "0" for c in value):
        raise ValueError(f"{field}: must not be all zeros")
    return value.lower()


@dataclasses.dataclass(frozen=True)
class Reward:
    """One reward to attach after the fact.

    ``value``: a finite number. ``name``: ``"episode"`` (the rollout's episode reward; the latest by time
    wins) or the name of an intermediate reward (letters, digits, ``_ . : / -``, at most 128). ``source``:
    who gave it (free text, at most 256 characters). ``time_ns``: when it was given, Unix nanoseconds
    (``None``: when the store receives it); at most :data:`MAX_FUTURE_S` ahead of this machine's clock.

    The target is the most specific id given: ``span_id`` (found by its ``trace_id`` or ``rollout_id``),
    else ``trace_id``, else ``rollout_id``. A ``rollout_id`` given with a trace or span id names the
    rollout they must belong to. Invalid fields raise ``ValueError`` starting with the field's name.
    """

    reward_id: str
    value: float
    name: str = EPISODE
    source: str = DEFAULT_SOURCE
    time_ns: int | None = None
    rollout_id: str | None = None
    trace_id: str | None = None
    span_id: str | None = None

    def __post_init__(self) -> None:
        _text("reward_id", self.reward_id, MAX_REWARD_ID, control=True)
        if isinstance(self.value, bool) or not isinstance(self.value, int | float):
            raise ValueError(f"value: must be a number, got {type(self.value).__name__}")
        try:
            value = float(self.value)
        except OverflowError:  # an int beyond a double
            value = math.inf
        if not math.isfinite(value):
            raise ValueError(f"value: must be a finite number, got {str(self.value)[:40]}")
        object.__setattr__(self, "value", value)
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(
                f"name: {str(self.name)[:80]!r} is not a reward name: 1 to 128 letters, digits and _ . : / -,"
                " starting with a letter or digit"
            )
        _text("source", self.source, MAX_SOURCE, control=True)
        if self.time_ns is not None:
            if isinstance(self.time_ns, bool) or not isinstance(self.time_ns, int):
                raise ValueError(f"time: must be Unix nanoseconds, got {type(self.time_ns).__name__}")
            if not 0 < self.time_ns <= _MAX_TIME_NS:
                raise ValueError(f"time: {self.time_ns} ns is outside 1970 to 2262")
            ahead_s = (self.time_ns - time.time_ns()) / 1e9
            if ahead_s > MAX_FUTURE_S:
                raise ValueError(
                    f"time: {format_time(self.time_ns)} is {ahead_s / 3600:.1f} h in the future; give the"
                    " time the reward was given (default: now)"
                )
        if self.rollout_id is not None:
            _text("rollout_id", self.rollout_id, MAX_ROLLOUT_ID)
        if self.trace_id is not None:
            object.__setattr__(self, "trace_id", _hex_id("trace_id", self.trace_id, _TRACE_ID, 32))
        if self.span_id is not None:
            object.__setattr__(self, "span_id", _hex_id("span_id", self.span_id, _SPAN_ID, 16))
            if self.trace_id is None and self.rollout_id is None:
                raise ValueError(
                    "span_id: a span id is unique only within its trace; give the span's trace_id or"
                    " rollout_id with it"
                )
        elif self.trace_id is None and self.rollout_id is None:
            raise ValueError("target: give rollout_id, trace_id, or span_id with its trace_id or rollout_id")

    @property
    def target(self) -> str:
        """``"span"``, ``"trace"`` or ``"rollout"``: what the reward is attached to."""
        return "span" if self.span_id else "trace" if self.trace_id else "rollout"

    def describe_target(self) -> str:
        """The target in words, e.g. ``span 00f0... of rollout ro-1``."""
        parts = []
        if self.span_id:
            parts.append(f"span {self.span_id}")
        if self.trace_id:
            parts.append(f"{'in ' if self.span_id else ''}trace {self.trace_id}")
        if self.rollout_id:
            parts.append(f"{'of ' if parts else ''}rollout {self.rollout_id!r}")
        return " ".join(parts)

    def same_as(self, other: Reward | StoredReward) -> bool:
        """Whether ``other`` records the same reward: value, name, source and target (not the time)."""
        target = (self.rollout_id, self.trace_id, self.span_id)
        theirs = other.requested if isinstance(other, StoredReward) else other
        return (self.value, self.name, self.source, target) == (
            theirs.value,
            theirs.name,
            theirs.source,
            (theirs.rollout_id, theirs.trace_id, theirs.span_id),
        )

    def to_json(self) -> dict[str, Any]:
        """The ``POST /api/rewards`` form: ``time`` as ISO 8601, ids left out when ``None``."""
        out: dict[str, Any] = {
            "reward_id": self.reward_id,
            "value": self.value,
            "name": self.name,
            "source": self.source,
        }
        if self.time_ns is not None:
            out["time"] = format_time(self.time_ns)
        for key in ("rollout_id", "trace_id", "span_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Reward:
        """From the ``POST /api/rewards`` form (``ValueError`` naming the field when invalid)."""
        given = data.get("time")
        return cls(
            reward_id=data.get("reward_id"),  # type: ignore[arg-type]  # validated in __post_init__
            value=data.get("value"),  # type: ignore[arg-type]
            name=data.get("name", EPISODE),
            source=data.get("source") or DEFAULT_SOURCE,
            time_ns=None if given is None else parse_time(given),
            rollout_id=data.get("rollout_id"),
            trace_id=data.get("trace_id"),
            span_id=data.get("span_id"),
        )


@dataclasses.dataclass(frozen=True)
class StoredReward:
    """A reward as the store keeps it: its request (``requested``) and where its span went.

    ``created`` is False when the reward id was already stored with the same value, name, source and
    target (nothing changed; the first one's time and place are reported). ``rollout_id`` is the rollout
    whose credit reads it (``None``: the target's spans carry no rollout id, so no rollout's does).
    """

    requested: Reward
    rollout_id: str | None
    trace_id: str
    span_id: str
    parent_span_id: str | None
    time_ns: int
    created: bool = True

    @property
    def reward_id(self) -> str:
        return self.requested.reward_id

    @property
    def value(self) -> float:
        return self.requested.value

    @property
    def name(self) -> str:
        return self.requested.name

    def to_json(self) -> dict[str, Any]:
        return {
            **self.requested.to_json(),
            "attached_to": {
                "rollout_id": self.rollout_id,
                "trace_id": self.trace_id,
                "span_id": self.span_id,
                "parent_span_id": self.parent_span_id,
                "time": format_time(self.time_ns),
                "time_ns": self.time_ns,
            },
            "created": self.created,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StoredReward:
        where = data["attached_to"]
        return cls(
            Reward.from_json(data),
            where["rollout_id"],
            where["trace_id"],
            where["span_id"],
            where["parent_span_id"],
            int(where["time_ns"]),
            bool(data["created"]),
        )


class RewardSink(Protocol):
    """Anything that stores late rewards: a ``Store`` backend or a ``StoreClient``."""

    def add_rewards(self, rewards: Sequence[Reward]) -> list[StoredReward]: ...


def make_reward(
    value: float,
    *,
    rollout_id: str | None = None,
    trace_id: str | None = None,
    span_id: str | None = None,
    name: str = EPISODE,
    source: str | None = None,
    reward_id: str | None = None,
    time: _dt.datetime | float | None = None,
) -> Reward:
    """A :class:`Reward` from Python values: ``time`` as an aware ``datetime`` or Unix seconds (``None``:
    when stored), a new random ``reward_id`` when none is given (then posting it again is a new reward)."""
    if isinstance(time, _dt.datetime):
        if time.tzinfo is None:
            raise ValueError("time: the datetime has no timezone; use datetime.now(timezone.utc) or similar")
        time_ns: int | None = parse_time(time.isoformat())
    elif time is not None:
        if isinstance(time, bool) or not isinstance(time, int | float) or not math.isfinite(time):
            raise ValueError(f"time: give a datetime or Unix seconds, got {time!r}")
        time_ns = int(round(time * 1e9))
    else:
        time_ns = None
    return Reward(
        reward_id=new_reward_id() if reward_id is None else reward_id,
        value=value,
        name=name,
        source=DEFAULT_SOURCE if source is None else source,
        time_ns=time_ns,
        rollout_id=rollout_id,
        trace_id=trace_id,
        span_id=span_id,
    )


def new_reward_id() -> str:
    """A fresh random reward id (``rw-`` and 24 hex characters)."""
    import uuid

    return f"rw-{uuid.uuid4().hex[:24]}"


def parse_time(text: Any) -> int:
    """Unix nanoseconds of an ISO 8601 time with a timezone (``2025-01-31T12:00:00Z``,
    ``...+02:00``); ``ValueError`` starting with ``time:`` otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"time: must be an ISO 8601 string, got {type(text).__name__}")
    try:
        when = _dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"time: {text[:80]!r} is not an ISO 8601 time like 2025-01-31T12:00:00Z") from None
    if when.tzinfo is None:
        raise ValueError(f"time: {text[:80]!r} has no timezone; add Z (UTC) or an offset like +02:00")
    delta = when - _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1_000


def format_time(time_ns: int) -> str:
    """ISO 8601 in UTC with microseconds, e.g. ``2025-01-31T12:00:00.000000Z``."""
    seconds, rest = divmod(time_ns, 1_000_000_000)
    when = _dt.datetime.fromtimestamp(seconds, _dt.timezone.utc).replace(microsecond=rest // 1_000)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _digest(reward_id: str, size: int) -> str:
    raw = bytearray(hashlib.blake2b(reward_id.encode(), digest_size=size, person=b"agl.reward").digest())
    if not any(raw):  # OTLP ids must not be all zeros
        raw[-1] = 1
    return raw.hex()


def reward_span_id(reward_id: str) -> str:
    """The span id of a late reward's span (16 hex characters), derived from its id."""
    return _digest(reward_id, 8)


def reward_trace_id(reward_id: str) -> str:
    """The trace id of a late reward that has no trace to join (32 hex characters), from its id."""
    return _digest(reward_id, 16)


_IDENTITY = (semconv.ROLLOUT_ID, semconv.ATTEMPT_ID, semconv.TASK_ID)


def reward_span(
    reward: Reward,
    *,
    trace_id: str,
    parent: Span | None,
    rollout_id: str | None,
    time_ns: int,
    task_id: str | None = None,
) -> Span:
    """The ``agl.reward`` span of ``reward``: in ``trace_id``, a child of ``parent`` (``None``: a root),
    at ``time_ns``, carrying ``rollout_id`` and the attempt and task ids of ``parent`` when it belongs to
    the same rollout (``task_id`` otherwise)."""
    attrs: dict[str, Any] = {}
    inherited = parent.attributes if parent is not None and parent.rollout_id == rollout_id else {}
    if rollout_id is not None:  # identity first: ingest finds it fastest there
        attrs[semconv.ROLLOUT_ID] = rollout_id
        for key in _IDENTITY[1:]:
            if key in inherited:
                attrs[key] = inherited[key]
        if semconv.TASK_ID not in attrs and task_id is not None:
            attrs[semconv.TASK_ID] = task_id
    attrs[semconv.REWARD_VALUE] = reward.value
    attrs[semconv.REWARD_NAME] = reward.name
    attrs[semconv.REWARD_SOURCE] = reward.source
    attrs[semconv.REWARD_ID] = reward.reward_id
    return Span(
        trace_id=trace_id,
        span_id=reward_span_id(reward.reward_id),
        parent_span_id=parent.span_id if parent is not None else None,
        name=semconv.SPAN_REWARD,
        start_ns=time_ns,
        end_ns=time_ns,
        attributes=attrs,
    )
