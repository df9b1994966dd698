"""OTLP trace payloads: decoding (protobuf and JSON), validation, and the stored row form.

A span is stored as its own protobuf encoding (``body``) beside the few columns that are indexed. That
keeps ingest cheap (no per-attribute conversion on the hot path) and loses nothing the sender sent;
attributes are decoded only when spans are read back. Without redaction the body is the span's bytes as
they arrived, cut out of the request (:func:`span_slices`) rather than encoded again.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from typing import Any, TypeAlias

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from ... import semconv
from ...pipeline.rewards import DEFAULT_REWARD_RANGE, RewardRange
from ...records import Span
from ._otlp_json import build_request

__all__ = [
    "OtlpDecodeError",
    "ParsedBatch",
    "SpanRow",
    "decode_json",
    "decode_protobuf",
    "encode_export_response",
    "extract_rows",
    "row_to_span",
    "span_shows_text",
    "span_slices",
    "span_to_proto",
    "with_rollout_id",
]

_STATUS_NAMES: dict[Status.StatusCode.ValueType, str] = {
    Status.STATUS_CODE_UNSET: "UNSET",  # 0
    Status.STATUS_CODE_OK: "OK",  # 1
    Status.STATUS_CODE_ERROR: "ERROR",  # 2
}
_STATUS_CODES = {v: k for k, v in _STATUS_NAMES.items()}
_MAX_DEPTH = 16
_MAX_NAME = 1024
_MAX_ID = 256
_MAX_TIME_NS = 2**63 - 1
#: How non-finite doubles read back (the OTLP JSON mapping's strings for them).
_NON_FINITE_TEXT = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
#: The name a stored span that cannot be decoded reads back under.
UNREADABLE_SPAN = "agl.unreadable_span"
#: Most spans accepted in one export request. OTLP exporters send batches of 512 by default; a request far
#: beyond this costs the store hundreds of megabytes to decode, so it is refused (400) whole.
MAX_SPANS_PER_REQUEST = 100_000


class OtlpDecodeError(ValueError):
    """The body is not a valid OTLP ExportTraceServiceRequest."""


SpanRow: TypeAlias = tuple[
    bytes, bytes, bytes | None, str, int, int, int, str | None, str | None, bytes, bytes
]
"""A span as the store writes it, a plain tuple (cheap to build, pickle and bind) in column order:
``(trace_id, span_id, parent_span_id, name, start_ns, end_ns, status_code, rollout_id, attempt_id,
scope_key, body)``; ids are bytes, ``body`` is the span's own protobuf encoding."""


@dataclasses.dataclass(frozen=True)
class ParsedBatch:
    rows: list[SpanRow]
    #: scope_key -> (Resource protobuf bytes, InstrumentationScope protobuf bytes)
    scopes: dict[bytes, tuple[bytes, bytes]]
    rejected: int
    error_message: str


def decode_protobuf(body: bytes) -> ExportTraceServiceRequest:
    try:
        return ExportTraceServiceRequest.FromString(body)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise OtlpDecodeError(f"body is not a valid OTLP ExportTraceServiceRequest protobuf: {exc}") from None


_ID_FIELDS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")


def _hex_ids_to_base64(obj: dict[str, Any], where: str) -> None:
    """OTLP/JSON writes ids as hex; protobuf's JSON mapping expects base64 for bytes fields."""
    for key in _ID_FIELDS:
        value = obj.get(key)
        if value in (None, ""):
            continue
        if not isinstance(value, str):
            raise OtlpDecodeError(f"{where}.{key} must be a hex string")
        try:
            obj[key] = base64.b64encode(bytes.fromhex(value)).decode("ascii")
        except ValueError:
            raise OtlpDecodeError(f"{where}.{key} is not hex: {value[:64]!r}") from None


def _objects(parent: dict[str, Any], keys: tuple[str, ...], where: str) -> list[dict[str, Any]]:
    """The list of objects under the first of ``keys`` present (JSON null or absent: none), or
    :class:`OtlpDecodeError` naming the path when it is not a list of objects."""
    key = next((k for k in keys if k in parent), keys[0])
    value = parent.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise OtlpDecodeError(f"{where}{key} must be a list, not a JSON {_json_type(value)}")
    for n, item in enumerate(value):
        if not isinstance(item, dict):
            raise OtlpDecodeError(f"{where}{key}[{n}] must be an object, not a JSON {_json_type(item)}")
    return value


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def decode_json(body: bytes) -> ExportTraceServiceRequest:
    """Parse an OTLP/JSON body (hex ids, lowerCamelCase or snake_case keys, enums as numbers)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise OtlpDecodeError(f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise OtlpDecodeError("the JSON body must be an object with a 'resourceSpans' list")
    for i, rs in enumerate(_objects(data, ("resourceSpans", "resource_spans"), "")):
        for j, ss in enumerate(_objects(rs, ("scopeSpans", "scope_spans"), f"resourceSpans[{i}].")):
            for k, span in enumerate(_objects(ss, ("spans",), f"resourceSpans[{i}].scopeSpans[{j}].")):
                where = f"resourceSpans[{i}].scopeSpans[{j}].spans[{k}]"
                _hex_ids_to_base64(span, where)
                for n, link in enumerate(_objects(span, ("links",), f"{where}.")):
                    _hex_ids_to_base64(link, f"{where}.links[{n}]")
    fast = build_request(data)
    if fast is not None:
        return fast
    try:
        return json_format.ParseDict(data, ExportTraceServiceRequest(), ignore_unknown_fields=True)
    except (
        Exception
    ) as exc:  # the JSON mapping raises several types for ill-typed fields; all are the sender's
        raise OtlpDecodeError(f"body is not a valid OTLP/JSON ExportTraceServiceRequest: {exc}") from None


_ZERO_TRACE, _ZERO_SPAN = bytes(16), bytes(8)


def _id_problem(raw: bytes, size: int, field: str) -> str:
    if len(raw) != size:
        return f"{field} must be {size} bytes, got {len(raw)}"
    if not any(raw):
        return f"{field} must not be all zeros"
    return ""


def _span_problem(span: SpanProto) -> str:
    """Why a span failed the ingest checks (called only for rejected spans)."""
    problem = _id_problem(span.trace_id, 16, "trace_id") or _id_problem(span.span_id, 8, "span_id")
    if not problem and span.parent_span_id and len(span.parent_span_id) != 8:
        problem = f"parent_span_id must be 8 bytes, got {len(span.parent_span_id)}"
    if not problem:
        problem = "start/end time is beyond the year 2262 (more than 2**63-1 ns)"
    return problem


def _reward_problem(span: SpanProto, rewards: RewardRange) -> str:
    """Why the ``agl.reward`` span's value is not one the store takes ('' when it is, or has none)."""
    for kv in span.attributes:
        if kv.key == semconv.REWARD_VALUE:
            kind = kv.value.WhichOneof("value")
            if kind in ("double_value", "int_value"):
                return rewards.problem(getattr(kv.value, kind))
    return ""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(data: bytes, start: int, end: int, wanted: int) -> list[tuple[int, int]]:
    """(start, end) of each length-delimited field number ``wanted`` in ``data[start:end]``, in order;
    other fields are skipped. Raises ``ValueError`` (or ``IndexError``) on what is not wire format."""
    out = []
    pos = start
    while pos < end:
        # one-byte tags and one- or two-byte lengths (spans up to 16 KB) read inline: this walk runs
        # once per span of every request
        tag = data[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint(data, pos)
        kind = tag & 7
        if kind == 2:
            size = data[pos]
            if size < 0x80:
                pos += 1
            elif data[pos + 1] < 0x80:
                size = (size & 0x7F) | data[pos + 1] << 7
                pos += 2
            else:
                size, pos = _varint(data, pos)
            if tag >> 3 == wanted:
                out.append((pos, pos + size))
            pos += size
        elif kind == 0:
            _, pos = _varint(data, pos)
        elif kind == 1:
            pos += 8
        elif kind == 5:
            pos += 4
        else:  # groups: never in OTLP
            raise ValueError(f"wire type {kind}")
    if pos != end:
        raise ValueError("field runs past its message")
    return out


def span_slices(body: bytes) -> list[list[list[tuple[int, int]]]] | None:
    """Where each span's encoding lies in an ``ExportTraceServiceRequest`` body, as (start, end) offsets
    indexed ``[resource_spans][scope_spans][span]`` like the decoded message; None when the body cannot
    be walked (the caller encodes the decoded spans instead). Repeated message fields keep their order on
    the wire, so the n-th occurrence is the n-th element."""
    try:
        return [
            [_fields(body, ss_start, ss_end, 2) for ss_start, ss_end in _fields(body, rs_start, rs_end, 2)]
            for rs_start, rs_end in _fields(body, 0, len(body), 1)
        ]
    except (ValueError, IndexError):
        return None


def _places(
    slices: list[list[list[tuple[int, int]]]] | None, i: int, j: int, count: int
) -> list[tuple[int, int]] | None:
    """Where the spans of resource ``i``'s scope ``j`` lie in the raw body (:func:`span_slices`), or
    ``None`` when the walk found no such scope or another number of spans (they are encoded instead)."""
    if slices is None:
        return None
    try:
        where = slices[i][j]
    except IndexError:
        return None
    return where if len(where) == count else None


def _identity(span: Any) -> tuple[str | None, str | None]:
    """The span's rollout and attempt ids; agl writes them first, so the walk usually stops after two."""
    rollout_key, attempt_key = semconv.ROLLOUT_ID, semconv.ATTEMPT_ID
    rollout_id = attempt_id = None
    for kv in span.attributes:
        key = kv.key
        if key == rollout_key:
            rollout_id = _id_text(kv.value)
            if attempt_id is not None:
                break
        elif key == attempt_key:
            attempt_id = _id_text(kv.value)
            if rollout_id is not None:
                break
    return rollout_id, attempt_id


def extract_rows(
    request: ExportTraceServiceRequest,
    redact: Callable[[Any], None] | None = None,
    raw: bytes | None = None,
    *,
    offsets: bool = False,
    rewards: RewardRange | None = DEFAULT_REWARD_RANGE,
) -> ParsedBatch:
    """Validate each span and turn it into a :class:`SpanRow`.

    A span with an invalid id is rejected on its own (counted, first reason kept); the rest are kept.
    ``redact`` is applied to every resource, scope and span message before anything is encoded. ``raw``,
    the protobuf body ``request`` was decoded from, lets unredacted spans keep the bytes they arrived as;
    with ``offsets`` such a span's row holds, in place of those bytes, their ``(start, end)`` in ``raw``
    (for a process that sends the rows to one that holds ``raw``: not rows a store can write).
    An ``agl.reward`` span whose value lies outside ``rewards`` (non-finite values always do) is rejected.
    """
    total = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
    if total > MAX_SPANS_PER_REQUEST:
        raise OtlpDecodeError(
            f"the request holds {total} spans, over the {MAX_SPANS_PER_REQUEST} accepted in one export;"
            " send smaller batches (BatchSpanProcessor's max_export_batch_size)"
        )
    rows: list[SpanRow] = []
    scopes: dict[bytes, tuple[bytes, bytes]] = {}
    rejected = 0
    first_error = ""
    rollout_marker = semconv.ROLLOUT_ID.encode()
    slices = span_slices(raw) if raw is not None and redact is None else None
    for i, resource_spans in enumerate(request.resource_spans):
        if redact is not None:
            redact(resource_spans.resource)
        resource_bytes = resource_spans.resource.SerializeToString(deterministic=True)
        for j, scope_spans in enumerate(resource_spans.scope_spans):
            if redact is not None:
                redact(scope_spans.scope)
            scope_bytes = scope_spans.scope.SerializeToString(deterministic=True)
            scope_key = hashlib.blake2b(resource_bytes + b"\0" + scope_bytes, digest_size=16).digest()
            if scope_key not in scopes:
                scopes[scope_key] = (resource_bytes, scope_bytes)
            append = rows.append
            spans = scope_spans.spans
            where = _places(slices, i, j, len(spans)) if raw is not None else None
            for n, span in enumerate(spans):
                trace_id, span_id, parent = span.trace_id, span.span_id, span.parent_span_id
                start_ns, end_ns = span.start_time_unix_nano, span.end_time_unix_nano
                # hot loop: the common valid case is checked inline, details only on failure
                if (
                    len(trace_id) != 16
                    or len(span_id) != 8
                    or (parent and len(parent) != 8)
                    or trace_id == _ZERO_TRACE
                    or span_id == _ZERO_SPAN
                    or start_ns > _MAX_TIME_NS
                    or end_ns > _MAX_TIME_NS
                ):
                    rejected += 1
                    first_error = first_error or f"span {span.name[:100]!r}: {_span_problem(span)}"
                    continue
                if rewards is not None and span.name == semconv.SPAN_REWARD:
                    problem = _reward_problem(span, rewards)
                    if problem:
                        rejected += 1
                        first_error = first_error or f"span {span.name!r}: {problem}"
                        continue
                if where is not None:
                    start, end = where[n]
                    if offsets:
                        # the caller holds ``raw``: the span's place in it, not a copy of its bytes
                        has_rollout = raw.find(rollout_marker, start, end) >= 0  # type: ignore[union-attr]
                        body: bytes | tuple[int, int] = (start, end)
                    else:
                        body = raw[start:end]  # type: ignore[index]
                        has_rollout = rollout_marker in body
                else:
                    if redact is not None:
                        redact(span)
                    body = span.SerializeToString()
                    has_rollout = rollout_marker in body
                # Walking the attributes is the costly part of ingest; a span whose bytes do not even
                # contain the rollout key has no rollout id.
                rollout_id, attempt_id = _identity(span) if has_rollout else (None, None)
                name = span.name
                if len(name) > _MAX_NAME or "\x00" in name:
                    name = _clean_text(name[:_MAX_NAME])
                append(
                    (  # type: ignore[arg-type]  # body: (start, end) with ``offsets`` (see above)
                        trace_id,
                        span_id,
                        parent or None,
                        name,
                        start_ns,
                        end_ns,
                        span.status.code,
                        rollout_id,
                        attempt_id,
                        scope_key,
                        body,
                    )
                )
    return ParsedBatch(rows, scopes, rejected, first_error)


def with_rollout_id(body: bytes, rollout_id: str) -> bytes:
    """A stored span's encoding with its ``agl.rollout.id`` attribute set to ``rollout_id`` (every entry of
    that key rewritten; added as the last attribute when it has none)."""
    span = SpanProto.FromString(body)
    found = False
    for kv in span.attributes:
        if kv.key == semconv.ROLLOUT_ID:
            kv.value.Clear()
            kv.value.string_value = rollout_id
            found = True
    if not found:
        span.attributes.add(key=semconv.ROLLOUT_ID).value.string_value = rollout_id
    return span.SerializeToString()


def _clean_text(text: str) -> str:
    """Indexed text columns hold no NUL characters (PostgreSQL refuses them); the body keeps the original."""
    return text.replace("\x00", "") if "\x00" in text else text


def _id_text(value: AnyValue) -> str | None:
    """:func:`_id_value`, the common case (a short clean string) without its checks' calls."""
    text = value.string_value
    if text and len(text) <= _MAX_ID and "\x00" not in text:
        return text
    return _id_value(value)


def _id_value(value: AnyValue) -> str | None:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return _clean_text(value.string_value[:_MAX_ID]) or None
    if kind == "int_value":
        return str(value.int_value)
    return None


# --- reading back -------------------------------------------------------------------------------------
def any_value(value: AnyValue, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        return None
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "int_value":
        return value.int_value
    if kind == "double_value":
        number = value.double_value
        # JSON has no NaN or infinity: such a number reads back as the OTLP JSON mapping's string for it,
        # so that no reader (the API's JSON, the dashboard, the trainer) fails on a stored span
        return number if math.isfinite(number) else _NON_FINITE_TEXT[repr(number)]
    if kind == "array_value":
        return [any_value(v, depth + 1) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value, depth + 1) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode("ascii")
    return None


def attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in key_values}


def resource_attributes(resource_bytes: bytes) -> dict[str, Any]:
    return attributes(Resource.FromString(resource_bytes).attributes)


def row_to_span(seq: int, body: bytes, resource: dict[str, Any]) -> Span:
    """The stored span ``body`` as a record. A body that does not decode (a damaged row) reads back as a
    placeholder span saying so, never as an error that would fail the whole page holding it."""
    try:
        proto = SpanProto.FromString(body)
    except DecodeError as exc:
        return Span(
            trace_id="0" * 32,
            span_id="0" * 16,
            parent_span_id=None,
            name=UNREADABLE_SPAN,
            start_ns=0,
            end_ns=0,
            attributes={},
            status_code="ERROR",
            status_message=f"the stored span (seq {seq}) could not be decoded: {exc}",
            resource=resource,
            seq=seq,
        )
    return Span(
        trace_id=proto.trace_id.hex(),
        span_id=proto.span_id.hex(),
        parent_span_id=proto.parent_span_id.hex() if proto.parent_span_id else None,
        name=proto.name,
        start_ns=proto.start_time_unix_nano,
        end_ns=proto.end_time_unix_nano,
        attributes=attributes(proto.attributes),
        status_code=_STATUS_NAMES.get(proto.status.code, "UNSET"),
        status_message=proto.status.message,
        events=tuple(
            {"name": e.name, "time_ns": e.time_unix_nano, "attributes": attributes(e.attributes)}
            for e in proto.events
        ),
        resource=resource,
        seq=seq,
    )


def _value_shows(value: AnyValue, text: str, depth: int = 0) -> bool:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return _string_shows(value.string_value, text)
    if depth >= _MAX_DEPTH:
        return False
    if kind == "array_value":
        return any(_value_shows(v, text, depth + 1) for v in value.array_value.values)
    if kind == "kvlist_value":
        return any(
            text in kv.key or _value_shows(kv.value, text, depth + 1) for kv in value.kvlist_value.values
        )
    return False


def _string_shows(value: str, text: str) -> bool:
    """``text`` is in the string as a person reads it: inside a JSON document (the chat messages
    instrumentations record as one JSON attribute), in its keys and strings rather than its quoting."""
    if text not in value:
        return False
    if value[:1] not in ("[", "{"):
        return True
    try:
        document = json.loads(value)
    except (ValueError, RecursionError):
        return True
    return _json_shows(document, text)


def _json_shows(value: Any, text: str, depth: int = 0) -> bool:
    if isinstance(value, str):
        return text in value
    if depth >= _MAX_DEPTH:
        return False
    if isinstance(value, list):
        return any(_json_shows(v, text, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(text in k or _json_shows(v, text, depth + 1) for k, v in value.items())
    return False


def span_shows_text(body: bytes, text: str) -> bool:
    """Whether the stored span ``body`` shows ``text`` where a person reads it: its name, status message,
    an attribute's key or text value (message contents inside JSON values included), an event's name or
    attributes. Ids, times, numbers and the encoding's own bytes never match."""
    try:
        span = SpanProto.FromString(body)
    except DecodeError:
        return False
    if text in span.name or text in span.status.message:
        return True
    for key_values in (span.attributes, *(e.attributes for e in span.events)):
        for kv in key_values:
            if text in kv.key or _value_shows(kv.value, text):
                return True
    return any(text in e.name for e in span.events)


# --- records -> OTLP (for spans added through the Python API) --------------------------------------------
def _to_any(value: Any, target: AnyValue) -> None:
    if isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int):
        target.int_value = value
    elif isinstance(value, float):
        target.double_value = value
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, (list, tuple)):
        array = target.array_value
        array.SetInParent()
        for item in value:
            _to_any(item, array.values.add())
    elif isinstance(value, dict):
        kvlist = target.kvlist_value
        kvlist.SetInParent()
        for k, v in value.items():
            kv = kvlist.values.add(key=str(k))
            _to_any(v, kv.value)
    elif value is not None:
        target.string_value = str(value)


def span_to_proto(span: Span) -> SpanProto:
    proto = SpanProto(
        trace_id=bytes.fromhex(span.trace_id),
        span_id=bytes.fromhex(span.span_id),
        parent_span_id=bytes.fromhex(span.parent_span_id) if span.parent_span_id else b"",
        name=span.name,
        start_time_unix_nano=span.start_ns,
        end_time_unix_nano=span.end_ns,
    )
    for key, value in span.attributes.items():
        _to_any(value, proto.attributes.add(key=key).value)
    proto.status.code = _STATUS_CODES.get(span.status_code, Status.STATUS_CODE_UNSET)
    proto.status.message = span.status_message
    for event in span.events:
        e = proto.events.add(name=str(event.get("name", "")), time_unix_nano=int(event.get("time_ns", 0)))
        for key, value in (event.get("attributes") or {}).items():
            _to_any(value, e.attributes.add(key=key).value)
    return proto


def records_to_request(spans: list[Span]) -> ExportTraceServiceRequest:
    """An export request holding ``spans`` (grouped by their resource attributes)."""
    request = ExportTraceServiceRequest()
    groups: dict[str, Any] = {}
    for span in spans:
        key = json.dumps(dict(span.resource), sort_keys=True, default=str)
        if key not in groups:
            rs = request.resource_spans.add()
            for k, v in span.resource.items():
                _to_any(v, rs.resource.attributes.add(key=k).value)
            groups[key] = rs.scope_spans.add(scope=InstrumentationScope(name="agl"))
        groups[key].spans.append(span_to_proto(span))
    return request


def encode_export_response(rejected: int = 0, error_message: str = "") -> bytes:
    response = ExportTraceServiceResponse()
    if rejected or error_message:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = error_message
    return response.SerializeToString()
