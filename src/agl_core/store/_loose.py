"""Spans that arrive without a rollout, made into rollouts once their trace goes quiet.

An agent run outside agl's runner (a user's own process with an adapter's ``instrument()``, or any
OpenTelemetry instrumentation exporting to the store) sends spans that name no rollout. The store groups
them as ``agl import`` and the gateway's capture do (:mod:`agl_core.importer._grouping`): a trace one of
whose spans names a rollout id joins it; else a trace whose spans name a session (``session.id``, then
``gen_ai.conversation.id``) joins the session's rollout ``imp-s-<hash>``; else the trace is a rollout of
its own, ``imp-t-<trace id>``. The same session captured by the gateway, imported from files and sent
live is one rollout.

A trace's spans arrive over time (children end, and are exported, before their parent, which often names
the session), so a trace is grouped only once no span of it has arrived for ``quiet_s`` (the
OpenTelemetry Collector's ``groupbytrace`` processor waits the same way). A span of a trace grouped
already joins that trace's rollout. Rollout ids that spans carry with no rollout record (an agent's own
``rollout_scope()``) get an observed record too, so that every rollout the store holds is counted and
listed. What it keeps between passes is bounded: beyond ``max_traces`` waiting traces the oldest are
grouped at once.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto

from .. import semconv
from ..rollout_ids import session_rollout_id, trace_rollout_id

__all__ = ["LooseSpans", "rollout_for_trace"]

SOURCE = "live"
_SESSION_KEYS = (semconv.SESSION_ID, semconv.GEN_AI_CONVERSATION_ID)
_SESSION_MARKERS = tuple(k.encode() for k in _SESSION_KEYS)


@dataclasses.dataclass
class LooseSpans:
    """What a store's grouping pass keeps between passes (:meth:`SqlStore.group_loose_spans`)."""

    #: Wait for a trace to be this many seconds without a new span before grouping it.
    quiet_s: float = 10.0
    #: Most traces waiting at once (the oldest are grouped first beyond it).
    max_traces: int = 100_000
    #: Store order of the last span seen (``None``: not started; the first pass starts at the oldest span
    #: stored without a rollout).
    after_seq: int | None = None
    #: Traces with spans waiting, and when (monotonic seconds) a span of each last arrived, oldest first.
    traces: OrderedDict[bytes, float] = dataclasses.field(default_factory=OrderedDict)
    #: Rollout ids seen on spans whose record may be missing, and when they were last seen.
    named: OrderedDict[str, float] = dataclasses.field(default_factory=OrderedDict)

    def saw_trace(self, trace_id: bytes, now: float) -> None:
        self.traces[trace_id] = now
        self.traces.move_to_end(trace_id)

    def saw_rollout(self, rollout_id: str, now: float) -> None:
        self.named[rollout_id] = now
        self.named.move_to_end(rollout_id)

    def ready_traces(self, now: float) -> list[bytes]:
        """Traces quiet for ``quiet_s`` (or pushed out by the bound), taken out of the waiting set."""
        return _take_ready(self.traces, now - self.quiet_s, self.max_traces)

    def ready_rollouts(self, now: float) -> list[str]:
        return _take_ready(self.named, now - self.quiet_s, self.max_traces)


def _take_ready(waiting: OrderedDict[Any, float], cutoff: float, bound: int) -> list[Any]:
    ready = []
    while waiting:
        key, seen = next(iter(waiting.items()))
        if seen > cutoff and len(waiting) <= bound:
            break
        waiting.popitem(last=False)
        ready.append(key)
    return ready


def _session(body: bytes) -> tuple[str, str] | None:
    """``(key, value)`` of the preferred session attribute a stored span carries, if any."""
    if not any(marker in body for marker in _SESSION_MARKERS):
        return None
    try:
        span = SpanProto.FromString(body)
    except (DecodeError, RuntimeError, ValueError):
        return None
    found: tuple[str, str] | None = None
    for kv in span.attributes:
        if kv.key in _SESSION_KEYS:
            kind = kv.value.WhichOneof("value")
            if kind in ("string_value", "int_value"):
                value = str(getattr(kv.value, kind))
                if value and (found is None or _SESSION_KEYS.index(kv.key) < _SESSION_KEYS.index(found[0])):
                    found = (kv.key, value)
    return found


def rollout_for_trace(
    trace_id: bytes, rows: Iterable[tuple[str | None, bytes | None]]
) -> tuple[str, dict[str, Any]]:
    """The rollout of a trace's loose spans and what it was grouped by (the record's metadata), from the
    trace's stored spans in store order as ``(rollout id, body)`` (the body needed only for spans
    without a rollout id): the first rollout id a span names, else the trace's session, else the trace."""
    session: tuple[str, str] | None = None
    for rollout_id, body in rows:
        if rollout_id:
            return rollout_id, {}
        if body is not None:
            found = _session(body)
            if found is not None and (
                session is None or _SESSION_KEYS.index(found[0]) < _SESSION_KEYS.index(session[0])
            ):
                session = found
    if session is not None:
        key, value = session
        return session_rollout_id(value), {key: value}
    return trace_rollout_id(trace_id), {"trace_id": trace_id.hex()}
