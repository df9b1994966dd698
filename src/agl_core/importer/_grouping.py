"""Which rollout each imported span belongs to.

A span that carries ``agl.rollout.id`` keeps it, and the other spans of its trace join that rollout.
Otherwise every trace that carries a session (``session.id``, then ``gen_ai.conversation.id``, on any of
its spans) belongs to the rollout of that session, and every other trace is a rollout of its own. The ids
are derived from the session or trace id alone (``imp-s-<hash of the session>``, ``imp-t-<trace id>``), so
importing the same traces again names the same rollouts.

Sessions span traces, and a trace's spans are spread over a file, so a trace's rollout is final only
when no span still to be read can change it (:meth:`Grouping.settled`); until then its spans wait. Into
a store written directly, :meth:`Grouping.learn` reads the rows the store's own ingest
parsed (its indexed rollout id; a span's own encoding is decoded only when it holds a session key the
trace's grouping still lacks); into a running store, :meth:`Grouping.scan` reads the records (records
without any of these keys are not even decoded).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from .. import semconv
from ..rollout_ids import session_rollout_id, trace_rollout_id
from ..store.formats.otlp import SpanRow
from ._files import Record

__all__ = ["SESSION_KEYS", "Grouping", "session_rollout_id", "trace_rollout_id"]

#: Span attributes naming the session a trace belongs to, in order of preference.
SESSION_KEYS = (semconv.SESSION_ID, semconv.GEN_AI_CONVERSATION_ID)
_KEYS = (semconv.ROLLOUT_ID, *SESSION_KEYS)
_MARKERS = tuple(k.encode() for k in _KEYS)
_SESSION_MARKERS = tuple(k.encode() for k in SESSION_KEYS)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class Grouping:
    """What :meth:`learn` or :meth:`scan` learnt: each trace's rollout id (from its spans) and session."""

    def __init__(self) -> None:
        self._trace_rollout: dict[bytes, str] = {}
        self._trace_session: dict[bytes, tuple[str, str]] = {}
        self._attribute: dict[str, bytes] = {}

    # --- learn: from the store's parsed rows --------------------------------------------------------
    def learn(self, rows: Iterable[SpanRow]) -> None:
        """Note the rollout ids and sessions of spans as the store's ingest parsed them (in the order they
        were read, so the first rollout id of a trace wins as in :meth:`scan`). A row's rollout id is
        the one the store indexes; a span is decoded only when it may name a session the trace still
        lacks: the trace has no rollout id yet (which would outrank any session), its session is not
        known by the preferred key, and its encoding contains a session key."""
        trace_rollout, sessions = self._trace_rollout, self._trace_session
        preferred = SESSION_KEYS[0]
        for row in rows:
            trace_id, rollout_id = row[0], row[7]
            if rollout_id is not None:
                trace_rollout.setdefault(trace_id, rollout_id)
                continue
            if trace_id in trace_rollout or sessions.get(trace_id, ("",))[0] == preferred:
                continue
            body = row[10]
            if not any(marker in body for marker in _SESSION_MARKERS):
                continue
            try:
                span = Span.FromString(body)
            except (DecodeError, RuntimeError, ValueError):  # the store encoded it; cannot happen
                continue
            for kv in span.attributes:
                if kv.key in SESSION_KEYS:
                    value = kv.value
                    kind = value.WhichOneof("value")
                    if kind in ("string_value", "int_value"):
                        self._note(trace_id, kv.key, getattr(value, kind))

    # --- scan: from the records ----------------------------------------------------------------------
    def scan(self, record: Record) -> None:
        """Note the rollout ids and sessions of a record's traces. A record that cannot be decoded is
        left for the import to report."""
        if not any(marker in record.body for marker in _MARKERS):
            return
        try:
            if record.json:
                self._scan_json(json.loads(record.body))
            else:
                with_ids = _MARKERS[0] in record.body
                self._scan_proto(ExportTraceServiceRequest.FromString(record.body), with_ids)
        except (ValueError, RecursionError, DecodeError, RuntimeError, TypeError, AttributeError):
            pass

    def _note(self, trace_id: bytes, key: str, value: Any) -> None:
        if value is None or value == "" or not isinstance(value, str | int) or isinstance(value, bool):
            return
        text = str(value)
        if key == semconv.ROLLOUT_ID:
            # as the store indexes it (extract_rows): at most 256 characters, no NUL
            self._trace_rollout.setdefault(trace_id, text[:256].replace("\x00", ""))
            return
        known = self._trace_session.get(trace_id)
        if known is None or SESSION_KEYS.index(key) < SESSION_KEYS.index(known[0]):
            self._trace_session[trace_id] = (key, text)

    def _scan_proto(self, request: ExportTraceServiceRequest, with_ids: bool) -> None:
        sessions = self._trace_session
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    # walking attributes is the costly part: skip it when it cannot teach anything more
                    # (no rollout ids in the record, and the trace's session known by the preferred key)
                    if not with_ids and sessions.get(span.trace_id, ("",))[0] == SESSION_KEYS[0]:
                        continue
                    for kv in span.attributes:
                        if kv.key in _KEYS:
                            value = kv.value
                            kind = value.WhichOneof("value")
                            if kind in ("string_value", "int_value"):
                                self._note(span.trace_id, kv.key, getattr(value, kind))

    def _scan_json(self, data: Any) -> None:
        for rs in _items(data, "resourceSpans", "resource_spans"):
            for ss in _items(rs, "scopeSpans", "scope_spans"):
                for span in _items(ss, "spans", "spans"):
                    trace_hex = span.get("traceId", span.get("trace_id"))
                    if not isinstance(trace_hex, str):
                        continue
                    try:
                        trace_id = bytes.fromhex(trace_hex)
                    except ValueError:
                        continue
                    for kv in _items(span, "attributes", "attributes"):
                        key, value = kv.get("key"), kv.get("value")
                        if key in _KEYS and isinstance(value, dict):
                            for kind in ("stringValue", "string_value", "intValue", "int_value"):
                                if kind in value:
                                    self._note(trace_id, key, value[kind])
                                    break

    # --- assignment ----------------------------------------------------------------------------------
    def rollout_of(self, trace_id: bytes) -> tuple[str, dict[str, Any]]:
        """The rollout of a span without ``agl.rollout.id`` in trace ``trace_id``, and what it was
        grouped by (for the rollout's metadata)."""
        own = self._trace_rollout.get(trace_id)
        if own is not None:
            return own, {}
        session = self._trace_session.get(trace_id)
        if session is not None:
            key, value = session
            return session_rollout_id(value), {key: value}
        return trace_rollout_id(trace_id), {"trace_id": trace_id.hex()}

    def regrouped(self) -> dict[str, str]:
        """``{imp-t-<trace>: rollout}`` for each trace whose spans name a rollout id or a session: where an
        earlier import, which did not read those spans (a file cut short, say), put spans of the trace in
        the trace's own rollout, they belong in ``rollout`` (:meth:`Store.merge_rollouts` moves them)."""
        moves: dict[str, str] = {}
        for trace_id in {*self._trace_rollout, *self._trace_session}:
            moves[trace_rollout_id(trace_id)] = self.rollout_of(trace_id)[0]
        return moves

    def settled(self, trace_id: bytes, may_hold: Callable[[str], bool]) -> bool:
        """Whether :meth:`rollout_of` ``trace_id`` is final, whatever spans are read after those learnt so
        far; ``may_hold(key)`` says whether spans still to be read may carry attribute ``key``. A trace's
        first rollout id is final; a session named by a key is final when no span can name a rollout
        id or a session by a preferred key; a trace with neither, when no span can carry any of them."""
        if trace_id in self._trace_rollout:
            return True
        if may_hold(semconv.ROLLOUT_ID):
            return False
        session = self._trace_session.get(trace_id)
        rank = SESSION_KEYS.index(session[0]) if session is not None else len(SESSION_KEYS)
        return not any(may_hold(key) for key in SESSION_KEYS[:rank])

    def attribute_bytes(self, rollout_id: str) -> bytes:
        """``agl.rollout.id = rollout_id`` encoded as one more ``attributes`` entry of a Span message.

        Appending these bytes to a span's encoding adds the attribute as the last one: protobuf appends
        a repeated field's entries in the order they appear, so this equals adding it to the message and
        encoding it again, without decoding the span (the costly part)."""
        encoded = self._attribute.get(rollout_id)
        if encoded is None:
            kv = KeyValue(key=semconv.ROLLOUT_ID, value=AnyValue(string_value=rollout_id)).SerializeToString()
            encoded = b"\x4a" + _varint(len(kv)) + kv  # field 9 (attributes), length-delimited
            self._attribute[rollout_id] = encoded
        return encoded


def _items(parent: Any, camel: str, snake: str) -> list[Any]:
    if not isinstance(parent, dict):
        return []
    value = parent.get(camel, parent.get(snake))
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []
