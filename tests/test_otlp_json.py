"""The OTLP/JSON fast path gives exactly what protobuf's JSON mapping gives, or leaves the body to it."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from agl_core.store.formats._otlp_json import build_request
from agl_core.store.formats.otlp import decode_json

_odd = st.one_of(st.none(), st.booleans(), st.integers(-(2**65), 2**65), st.floats(), st.text(max_size=4))
_int = st.one_of(st.integers(0, 2**64), st.integers(0, 2**64).map(str), _odd)
_id = st.binary(min_size=0, max_size=16).map(lambda b: base64.b64encode(b).decode())


def _keys(names: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with any subset of ``names`` (each spelled camelCase or snake_case), now and then an
    unknown key."""
    spelled = {
        name: st.sampled_from([name, name.split("_")[0] + "".join(p.title() for p in name.split("_")[1:])])
        for name in names
    }
    return st.fixed_dictionaries(
        {},
        optional={
            **{n: st.tuples(spelled[n], s) for n, s in names.items()},
            "x": st.tuples(st.just("bogus"), _odd),
        },
    ).map(lambda d: dict(d.values()))


_any_value = st.recursive(
    st.one_of(
        st.fixed_dictionaries({"stringValue": st.one_of(st.text(max_size=8), _odd)}),
        st.fixed_dictionaries({"intValue": _int}),
        st.fixed_dictionaries({"boolValue": st.one_of(st.booleans(), _odd)}),
        st.fixed_dictionaries({"double_value": st.one_of(st.floats(), st.integers(-5, 5), _odd)}),
        st.just({}),
    ),
    lambda inner: st.one_of(
        st.fixed_dictionaries({"arrayValue": st.fixed_dictionaries({"values": st.lists(inner, max_size=3)})}),
        st.fixed_dictionaries(
            {
                "kvlistValue": st.fixed_dictionaries(
                    {
                        "values": st.lists(
                            st.fixed_dictionaries({"key": st.text(max_size=3), "value": inner}), max_size=3
                        )
                    }
                )
            }
        ),
    ),
    max_leaves=6,
)
_attributes = st.lists(st.fixed_dictionaries({"key": st.text(max_size=6), "value": _any_value}), max_size=4)
_span = _keys(
    {
        "trace_id": _id,
        "span_id": _id,
        "parent_span_id": _id,
        "name": st.one_of(st.text(max_size=6), _odd),
        "kind": st.one_of(st.integers(0, 5), st.sampled_from(["SPAN_KIND_SERVER", "NOPE"]), _odd),
        "start_time_unix_nano": _int,
        "end_time_unix_nano": _int,
        "attributes": _attributes,
        "dropped_attributes_count": _int,
        "events": st.lists(
            _keys({"time_unix_nano": _int, "name": st.text(max_size=4), "attributes": _attributes}),
            max_size=2,
        ),
        "links": st.lists(_keys({"trace_id": _id, "span_id": _id, "flags": _int}), max_size=2),
        "status": _keys(
            {
                "code": st.one_of(st.integers(0, 2), st.just("STATUS_CODE_ERROR"), _odd),
                "message": st.text(max_size=4),
            }
        ),
        "flags": _int,
    }
)
_request = _keys(
    {
        "resource_spans": st.lists(
            _keys(
                {
                    "resource": _keys({"attributes": _attributes}),
                    "scope_spans": st.lists(
                        _keys(
                            {
                                "scope": _keys({"name": st.text(max_size=4), "version": st.text(max_size=3)}),
                                "spans": st.lists(_span, max_size=3),
                            }
                        ),
                        max_size=2,
                    ),
                    "schema_url": st.text(max_size=4),
                }
            ),
            max_size=2,
        )
    }
)


@settings(max_examples=400, deadline=None)
@given(_request)
def test_fast_path_matches_the_json_mapping(data):
    fast = build_request(copy.deepcopy(data))
    try:
        reference = json_format.ParseDict(
            copy.deepcopy(data), ExportTraceServiceRequest(), ignore_unknown_fields=True
        )
    except Exception:
        assert fast is None  # what the mapping refuses, the fast path leaves to it
        return
    if fast is not None:
        assert fast.SerializeToString(deterministic=True) == reference.SerializeToString(deterministic=True)


def test_a_collector_line_takes_the_fast_path():
    line = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "a"}}]},
                "scopeSpans": [
                    {
                        "scope": {"name": "s"},
                        "spans": [
                            {
                                "traceId": "0af7651916cd43dd8448eb211c80319c",
                                "spanId": "b7ad6b7169203331",
                                "name": "chat",
                                "kind": 3,
                                "startTimeUnixNano": "1700000000000000000",
                                "endTimeUnixNano": "1700000000000001000",
                                "attributes": [{"key": "n", "value": {"intValue": "3"}}],
                                "status": {"code": 2, "message": "boom"},
                            }
                        ],
                    }
                ],
            }
        ]
    }
    converted = json.loads(json.dumps(line))
    for span in converted["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        for key in ("traceId", "spanId"):
            span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    assert build_request(converted) is not None
    request = decode_json(json.dumps(line).encode())
    span = request.resource_spans[0].scope_spans[0].spans[0]
    assert (
        span.trace_id.hex() == "0af7651916cd43dd8448eb211c80319c" and span.attributes[0].value.int_value == 3
    )
    assert span.status.code == 2 and span.kind == 3
