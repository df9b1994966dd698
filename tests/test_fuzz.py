"""Property-based fuzzing of every store and gateway endpoint and of the OTLP decoders, through the real
servers over HTTP (and gRPC): whatever arrives, the answer is never a 5xx other than the documented,
retryable 503, the server stays up, its memory stays bounded, and valid traffic afterwards succeeds.

Derandomized (the same examples every run), so a failure here reproduces; raise ``AGL_FUZZ_EXAMPLES``
to search longer locally."""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl_core.records import RolloutStatus
from agl_core.store import SqliteStore, StoreClient
from agl_core.store.service import StoreService
from agl_core.testing import GatewayServer, ScriptedBackend

from .test_store_ingest import make_request

EXAMPLES = int(os.environ.get("AGL_FUZZ_EXAMPLES", "120"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
#: What a hostile client may change in the RSS of the process serving it, over a whole test.
RSS_BUDGET = 200 * 1024 * 1024

_ints = st.one_of(
    st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1])
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    _ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["\x00", "ro-\x00", "\ud800", "é" * 10, "a" * 600]),
)
json_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
_content_types = st.sampled_from(
    ["application/json", "application/x-protobuf", "text/plain", "", "application/json; charset=latin-1"]
)


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _shaped(keys: list[str]) -> st.SearchStrategy[Any]:
    """Objects with the endpoint's own keys (and some others) holding random values: past the first
    layer of validation more often than random JSON gets."""
    return st.dictionaries(st.sampled_from([*keys, "extra", ""]), json_values, max_size=len(keys) + 1)


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _assert_answer(response: httpx.Response) -> None:
    request = response.request
    assert response.status_code < 500 or response.status_code == 503, (
        f"{request.method} {request.url.path} -> {response.status_code}: {response.text[:300]}"
    )


# --- the store --------------------------------------------------------------------------------------
_STORE_ENDPOINTS: list[tuple[str, str, list[str]]] = [
    ("POST", "/api/rollouts", ["rollouts"]),
    ("POST", "/api/rollouts/dequeue", ["worker_id", "lease_s"]),
    ("POST", "/api/rollouts/query", ["rollout_ids"]),
    ("POST", "/api/rollouts/cancel", ["rollout_ids"]),
    ("POST", "/api/rollouts/consumed", ["rollout_ids"]),
    ("POST", "/api/rollouts/merge", ["moves"]),
    ("POST", "/api/attempts/{id}/heartbeat", ["lease_s"]),
    ("POST", "/api/attempts/{id}/complete", ["status", "reward", "error"]),
    (
        "POST",
        "/api/spans/query",
        ["rollout_ids", "attempt_id", "trace_id", "after_seq", "limit", "start_after_ns"],
    ),
    ("POST", "/api/rewards", ["rewards"]),
    ("POST", "/api/rollouts/observed", ["rollouts"]),
    ("PUT", "/api/resources/{id}", ["value"]),
    ("GET", "/api/resources/{id}", []),
    ("GET", "/api/stats", []),
    ("GET", "/healthz", []),
    ("DELETE", "/api/rollouts", []),
    ("GET", "/api/nothing/here", []),
]
_rollout_items = st.dictionaries(
    st.sampled_from(["task_id", "input", "group_id", "rollout_id", "metadata", "max_attempts", "x"]),
    json_values,
    max_size=6,
)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def served_store(request, tmp_path_factory) -> Iterator[str]:
    if request.param == "sqlite":
        store: Any = SqliteStore(tmp_path_factory.mktemp("fuzz") / "store.sqlite")
        cleanup = None
    else:
        import uuid

        import psycopg

        from agl_core.store.postgres import PostgresStore

        from .conftest import POSTGRES_DSN

        schema = f"agl_fuzz_{uuid.uuid4().hex[:10]}"
        store = PostgresStore(POSTGRES_DSN, schema=schema)

        def cleanup() -> None:
            with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA "{schema}" CASCADE')

    service = StoreService(store, parse_workers=0)
    url = service.start_http_background()
    try:
        yield url
    finally:
        service.close()
        store.close()
        if cleanup is not None:
            cleanup()


def _store_still_works(url: str) -> None:
    with StoreClient(url) as client:
        queued = client.enqueue_rollouts([{"task_id": "after-fuzz", "input": {"ok": 1}}])
        claimed = client.dequeue_rollout("fuzz-check")
        assert claimed is not None
        while claimed is not None and claimed[0].rollout_id != queued[0].rollout_id:
            client.complete_attempt(claimed[1].attempt_id, RolloutStatus.FAILED, error="fuzz leftover")
            claimed = client.dequeue_rollout("fuzz-check")
        assert claimed is not None
        done = client.complete_attempt(claimed[1].attempt_id, RolloutStatus.SUCCEEDED, reward=1.0)
        assert done.status == RolloutStatus.SUCCEEDED
    r = httpx.post(
        url + "/v1/traces",
        content=make_request("ro-after-fuzz", 3).SerializeToString(),
        headers={"content-type": "application/x-protobuf"},
    )
    assert r.status_code == 200


@FUZZ
@given(
    endpoint=st.sampled_from(_STORE_ENDPOINTS),
    path_id=st.one_of(st.text(min_size=1, max_size=30), st.sampled_from(["at-1", "%00", "..", "a/b"])),
    body=st.one_of(
        st.binary(max_size=200),
        json_values.map(_json_bytes),
        st.builds(lambda items: {"rollouts": items}, st.lists(_rollout_items, max_size=3)).map(_json_bytes),
    ),
    shaped=st.booleans(),
    shaped_body=st.data(),
    content_type=_content_types,
)
def _fuzz_store_api(served_store, endpoint, path_id, body, shaped, shaped_body, content_type):
    method, path, keys = endpoint
    if shaped and keys:
        body = _json_bytes(shaped_body.draw(_shaped(keys)))
    url = served_store + path.replace("{id}", quote(path_id, safe=""))
    response = httpx.request(method, url, content=body, headers={"content-type": content_type}, timeout=30)
    _assert_answer(response)
    if response.status_code >= 400:
        assert response.headers["content-type"].startswith("application/json"), response.text[:200]


def test_store_api_and_otlp_http_never_fail_with_a_5xx(served_store):
    """Every /api endpoint and /v1/traces, fuzzed; then memory and a valid round trip are checked."""
    before = _rss()
    _fuzz_store_api(served_store)
    _fuzz_otlp_http(served_store)
    assert _rss() - before < RSS_BUDGET
    _store_still_works(served_store)


# --- the OTLP decoders ------------------------------------------------------------------------------
def _mutate(data: bytes, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for position, value in flips:
        if out:
            out[position % len(out)] = value
    return bytes(out)


_valid = make_request("ro-fuzz", 4).SerializeToString()
_otlp_json_like = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(
                [
                    "resourceSpans",
                    "scopeSpans",
                    "spans",
                    "links",
                    "events",
                    "attributes",
                    "traceId",
                    "spanId",
                    "name",
                    "value",
                    "stringValue",
                    "arrayValue",
                    "values",
                    "kvlistValue",
                    "key",
                    "resource",
                    "startTimeUnixNano",
                    "status",
                    "code",
                    "x",
                ]
            ),
            inner,
            max_size=4,
        ),
    ),
    max_leaves=15,
)
_bodies = st.one_of(
    st.tuples(st.just("application/x-protobuf"), st.binary(max_size=300)),
    st.tuples(
        st.just("application/x-protobuf"),
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6).map(
            lambda flips: _mutate(_valid, flips)
        ),
    ),
    st.tuples(st.just("application/json"), _otlp_json_like.map(_json_bytes)),
    st.tuples(st.just("application/json"), st.binary(max_size=100)),
)


@FUZZ
@given(body=_bodies, encoding=st.sampled_from(["", "gzip", "deflate", "br", "gzip-truncated"]))
def _fuzz_otlp_http(served_store, body, encoding):
    content_type, data = body
    headers = {"content-type": content_type}
    if encoding == "gzip":
        data, headers["content-encoding"] = gzip.compress(data), "gzip"
    elif encoding == "deflate":
        data, headers["content-encoding"] = zlib.compress(data), "deflate"
    elif encoding == "gzip-truncated":
        data, headers["content-encoding"] = gzip.compress(data)[:-5], "gzip"
    elif encoding == "br":
        headers["content-encoding"] = "br"
    response = httpx.post(served_store + "/v1/traces", content=data, headers=headers, timeout=30)
    _assert_answer(response)
    if response.status_code >= 400 and content_type == "application/json":
        assert "code" in response.json() or response.status_code in (401, 413, 415)


@pytest.fixture(scope="module")
def grpc_store(tmp_path_factory) -> Iterator[tuple[str, StoreService]]:
    store = SqliteStore(tmp_path_factory.mktemp("fuzz-grpc") / "store.sqlite")
    service = StoreService(store, parse_workers=0)
    port = service.start_grpc("127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{port}", service
    finally:
        service.close()
        store.close()


@FUZZ
@given(
    data=st.one_of(
        st.binary(max_size=300),
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6).map(
            lambda flips: _mutate(_valid, flips)
        ),
    )
)
def _fuzz_otlp_grpc(grpc_store, data):
    import grpc

    address, _ = grpc_store
    with grpc.insecure_channel(address) as channel:
        export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
        try:
            export(data, timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE), (
                exc.details()
            )


def test_otlp_grpc_never_answers_unknown_or_internal(grpc_store):
    import grpc

    address, service = grpc_store
    _fuzz_otlp_grpc(grpc_store)
    with grpc.insecure_channel(address) as channel:
        export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
        export(make_request("ro-grpc-ok", 2).SerializeToString(), timeout=30)
    assert len(service.store.query_spans(rollout_ids=["ro-grpc-ok"])) == 2


# --- the gateway ------------------------------------------------------------------------------------
_messages = st.lists(
    st.dictionaries(
        st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id"]),
        st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "developer"]), json_values),
        max_size=4,
    ),
    max_size=4,
)
_chat = st.fixed_dictionaries(
    {"model": st.one_of(st.just("scripted"), json_values), "messages": st.one_of(_messages, json_values)},
    optional={
        "tools": json_values,
        "tool_choice": json_values,
        "max_tokens": _ints,
        "n": st.one_of(st.integers(-2, 5), json_values),
        "temperature": st.one_of(st.floats(allow_nan=True), json_values),
        "stream": st.one_of(st.booleans(), json_values),
        "stop": json_values,
        "logprobs": json_values,
    },
)
_items = st.lists(
    st.dictionaries(
        st.sampled_from(["type", "role", "content", "call_id", "name", "arguments", "output", "id"]),
        st.one_of(
            st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "user"]),
            json_values,
        ),
        max_size=5,
    ),
    max_size=4,
)
_responses = st.fixed_dictionaries(
    {"model": st.one_of(st.just("scripted"), json_values), "input": st.one_of(st.text(max_size=20), _items)},
    optional={
        "instructions": json_values,
        "tools": json_values,
        "tool_choice": json_values,
        "max_output_tokens": _ints,
        "previous_response_id": st.one_of(st.just("resp_0"), json_values),
        "text": json_values,
        "stream": st.one_of(st.booleans(), json_values),
        "include": json_values,
    },
)
_blocks = st.lists(
    st.dictionaries(
        st.sampled_from(["type", "text", "id", "name", "input", "tool_use_id", "content", "is_error"]),
        st.one_of(st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking"]), json_values),
        max_size=5,
    ),
    max_size=3,
)
_anthropic = st.fixed_dictionaries(
    {
        "model": st.one_of(st.just("scripted"), json_values),
        "max_tokens": st.one_of(st.integers(-1, 64), json_values),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "assistant", "system"]),
                    "content": st.one_of(st.text(), _blocks),
                }
            ),
            max_size=3,
        ),
    },
    optional={
        "system": json_values,
        "tools": json_values,
        "tool_choice": json_values,
        "stop_sequences": json_values,
        "temperature": st.one_of(st.floats(allow_nan=True), json_values),
        "stream": st.one_of(st.booleans(), json_values),
    },
)


def _tool_bomb(count: int, shape: str) -> bytes:
    """A request offering ``count`` tools in one door's shape (the bound is 128; 20,000 once took 73 s)."""
    params = {"type": "object", "properties": {}}
    if shape == "chat":
        tools = [
            {"type": "function", "function": {"name": f"f{i % 97}", "parameters": params}}
            for i in range(count)
        ]
        return _json_bytes(
            {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
        )
    if shape == "responses":
        tools = [{"type": "function", "name": f"f{i % 97}", "parameters": params} for i in range(count)]
        return _json_bytes({"model": "scripted", "input": "hi", "tools": tools})
    tools = [{"name": f"f{i % 97}", "input_schema": params} for i in range(count)]
    body = {
        "model": "scripted",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": tools,
    }
    return _json_bytes(body)


#: Hostile shapes beside the random ones: tool-count bombs and nesting bombs.
_bombs = st.one_of(
    st.builds(_tool_bomb, st.integers(100, 5_000), st.sampled_from(["chat", "responses", "anthropic"])),
    st.integers(500, 200_000).map(lambda n: b"[" * n),
    st.integers(500, 50_000).map(
        lambda n: b'{"model": "scripted", "messages": ' + b"[" * n + b"]" * n + b"}"
    ),
)
_GATEWAY_PATHS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/rollouts/ro-fuzz/attempts/at-1/agents/planner/v1/responses"),
    ("POST", "/rollouts/ro-fuzz/agents/%2e%2e/v1/messages"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("POST", "/agl/v1/policy"),
    ("GET", "/agl/v1/policy"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/rollout/ro-fuzz/v1/chat/completions"),
    ("GET", "/v1/nothing"),
    ("PUT", "/v1/chat/completions"),
]


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    # a reply for every call: valid requests get through the Responses and Messages doors as well
    with GatewayServer(ScriptedBackend(lambda messages, tools: "fine"), admin_token="fuzz-token") as served:
        yield served.url


# three times the examples: fourteen routes and three request shapes share them
@settings(FUZZ, max_examples=EXAMPLES * 3)
@given(
    endpoint=st.sampled_from(_GATEWAY_PATHS),
    body=st.one_of(
        _chat.map(_json_bytes),
        _responses.map(_json_bytes),
        _anthropic.map(_json_bytes),
        json_values.map(_json_bytes),
        st.binary(max_size=200),
        _bombs,
    ),
    content_type=_content_types,
    # what a client can send in a header: printable latin-1 (h11 refuses control characters itself)
    authorization=st.one_of(
        st.none(),
        # (h11 also refuses a value with blanks at either end)
        st.text(
            st.characters(min_codepoint=32, max_codepoint=255, exclude_characters="\x7f"), max_size=20
        ).filter(lambda value: value == value.strip(" \t")),
    ),
)
def _fuzz_gateway(gateway, endpoint, body, content_type, authorization):
    method, path = endpoint
    headers: dict[str, str | bytes] = {"content-type": content_type}
    if authorization is not None:
        headers["authorization"] = authorization.encode("latin-1")
    response = httpx.request(method, gateway + path, content=body, headers=headers, timeout=60)
    # 501: this backend cannot load policies, and no backend counts Anthropic tokens (both documented);
    # any other 5xx is a defect
    documented_501 = path == "/agl/v1/policy" or path.endswith("/count_tokens")
    assert response.status_code < 500 or (documented_501 and response.status_code == 501), (
        f"{method} {path} -> {response.status_code}: {response.text[:300]}"
    )


def test_gateway_never_fails_with_a_5xx(gateway):
    before = _rss()
    _fuzz_gateway(gateway)
    assert _rss() - before < RSS_BUDGET
    ok = httpx.post(
        gateway + "/v1/chat/completions",
        json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"
