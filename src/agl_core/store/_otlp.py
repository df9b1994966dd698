"""Decoding OTLP trace export requests into :class:`~agl_core.records.Span` records."""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from ..records import Span

__all__ = ["DecodeResult", "OtlpDecodeError", "decode_export_request", "encode_export_response"]

_STATUS_NAMES = {0: "UNSET", 1: "OK", 2: "ERROR"}
#: Attribute values longer than this are cut (the span is kept); a hostile sender cannot bloat the store.
MAX_VALUE_CHARS = 1 << 20
_MAX_DEPTH = 8


class OtlpDecodeError(ValueError):
    """The body is not a valid OTLP ExportTraceServiceRequest."""


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    spans: list[Span]
    rejected: int
    error_message: str


def _any_value(value: AnyValue, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        return None
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value[:MAX_VALUE_CHARS]
    if kind == "bool_value":
        return value.bool_value
    if kind == "int_value":
        return value.int_value
    if kind == "double_value":
        return value.double_value
    if kind == "array_value":
        return [_any_value(v, depth + 1) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value(kv.value, depth + 1) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value[:MAX_VALUE_CHARS]).decode("ascii")
    return None


def _attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: _any_value(kv.value) for kv in key_values}


def decode_export_request(body: bytes) -> DecodeResult:
    """Parse a protobuf-encoded ``ExportTraceServiceRequest``.

    Spans with an invalid trace or span id are rejected one by one (counted in ``rejected``, the first
    reason in ``error_message``); a body that is not a valid message at all raises
    :class:`OtlpDecodeError`.
    """
    try:
        request = ExportTraceServiceRequest.FromString(body)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise OtlpDecodeError(f"body is not a valid OTLP ExportTraceServiceRequest protobuf: {exc}") from None
    spans: list[Span] = []
    rejected = 0
    first_error = ""
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                problem = _id_problem(span.trace_id, 16, "trace_id") or _id_problem(span.span_id, 8, "span_id")
                if not problem and span.parent_span_id and len(span.parent_span_id) != 8:
                    problem = f"parent_span_id must be 8 bytes, got {len(span.parent_span_id)}"
                if problem:
                    rejected += 1
                    first_error = first_error or f"span {span.name!r}: {problem}"
                    continue
                spans.append(
                    Span(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex() if span.parent_span_id else None,
                        name=span.name[:1024],
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes),
                        status_code=_STATUS_NAMES.get(span.status.code, "UNSET"),
                        status_message=span.status.message[:4096],
                        events=tuple(
                            {"name": e.name, "time_ns": e.time_unix_nano, "attributes": _attributes(e.attributes)}
                            for e in span.events
                        ),
                        resource=resource,
                    )
                )
    return DecodeResult(spans, rejected, first_error)


def _id_problem(raw: bytes, size: int, field: str) -> str:
    if len(raw) != size:
        return f"{field} must be {size} bytes, got {len(raw)}"
    if not any(raw):
        return f"{field} must not be all zeros"
    return ""


def encode_export_response(rejected: int = 0, error_message: str = "") -> bytes:
    response = ExportTraceServiceResponse()
    if rejected or error_message:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = error_message
    return response.SerializeToString()
