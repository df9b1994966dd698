"""Collector-store ingest: every protocol real senders use, redaction, backpressure, concurrency, fuzzing."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from agl_core import semconv
from agl_core.server import BackgroundServer
from agl_core.store import AsyncStoreClient, StoreClient, StoreUnavailableError
from agl_core.store.formats.otlp import OtlpDecodeError, decode_protobuf, extract_rows, span_slices
from agl_core.store.ingest import IngestPipeline, _parse_elsewhere, _with_bodies
from agl_core.store.redact import MASK, parse_rules
from agl_core.store.service import RetentionPolicy, StoreService, parse_duration
from agl_core.tracing import rollout_scope


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_request(rollout: str, n: int, *, first: int = 1, attrs: int = 3) -> ExportTraceServiceRequest:
    """An export request of ``n`` spans of one rollout with distinct ids."""
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = "bench"
    scope = rs.scope_spans.add()
    for i in range(first, first + n):
        span = scope.spans.add(
            trace_id=(hash(rollout) & 0xFFFFFFFF).to_bytes(4, "big") + i.to_bytes(12, "big"),
            span_id=i.to_bytes(8, "big"),
            name=f"span-{i}",
            start_time_unix_nano=time.time_ns(),
            end_time_unix_nano=time.time_ns(),
        )
        span.attributes.add(key=semconv.ROLLOUT_ID).value.string_value = rollout
        for a in range(attrs):
            span.attributes.add(key=f"attr.{a}").value.string_value = "x" * 40
    return request


def _post(url: str, request: ExportTraceServiceRequest, **headers: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/traces",
        content=request.SerializeToString(),
        headers={"content-type": "application/x-protobuf", **headers},
    )


@pytest.fixture
def service(store):
    svc = StoreService(store)
    svc.start_grpc("127.0.0.1", 0)
    url = svc.start_http_background()
    yield svc, url
    svc.close()


def test_otlp_json_with_hex_ids(service):
    svc, url = service
    body = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "js-agent"}}]},
                "scopeSpans": [
                    {
                        "scope": {"name": "manual"},
                        "spans": [
                            {
                                "traceId": "5b8efff798038103d269b633813fc60c",
                                "spanId": "eee19b7ec3c1b174",
                                "parentSpanId": "eee19b7ec3c1b173",
                                "name": "from-json",
                                "kind": 2,
                                "startTimeUnixNano": "1544712660000000000",
                                "endTimeUnixNano": "1544712661000000000",
                                "attributes": [
                                    {"key": semconv.ROLLOUT_ID, "value": {"stringValue": "ro-json"}},
                                    {"key": "n", "value": {"intValue": "7"}},
                                    {
                                        "key": "xs",
                                        "value": {"arrayValue": {"values": [{"doubleValue": 1.5}]}},
                                    },
                                ],
                                "status": {"code": 2, "message": "bad"},
                            }
                        ],
                    }
                ],
            }
        ]
    }
    response = httpx.post(url + "/v1/traces", json=body)
    assert response.status_code == 200 and response.json() == {}
    (span,) = StoreClient(url).query_spans(rollout_ids=["ro-json"])
    assert (span.trace_id, span.span_id, span.parent_span_id) == (
        "5b8efff798038103d269b633813fc60c",
        "eee19b7ec3c1b174",
        "eee19b7ec3c1b173",
    )
    assert span.attributes["n"] == 7 and span.attributes["xs"] == [1.5]
    assert span.status_code == "ERROR" and span.status_message == "bad"
    assert span.resource == {"service.name": "js-agent"} and span.start_ns == 1544712660000000000

    bad = httpx.post(
        url + "/v1/traces", json={"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}
    )
    assert bad.status_code == 400 and "not hex" in bad.json()["message"]


def test_real_sdk_grpc_and_http_exporters_with_gzip(service):
    from opentelemetry.exporter.otlp.proto.grpc.exporter import Compression as GrpcCompression
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    svc, url = service
    exporters = {
        "grpc": GrpcExporter(
            endpoint=f"127.0.0.1:{svc.grpc_port}", insecure=True, compression=GrpcCompression.Gzip
        ),
        "http": HttpExporter(endpoint=url + "/v1/traces", compression=Compression.Gzip),
    }
    for name, exporter in exporters.items():
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        with rollout_scope(f"ro-{name}", tracer_provider=provider):
            with provider.get_tracer("t").start_as_current_span(
                "work", attributes={semconv.ROLLOUT_ID: f"ro-{name}"}
            ):
                pass
        provider.shutdown()
    client = StoreClient(url)
    for name in exporters:
        assert sorted(s.name for s in client.query_spans(rollout_ids=[f"ro-{name}"])) == [
            semconv.SPAN_ROLLOUT,
            "work",
        ]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_rotel_collector_forwards_to_the_store(service, tmp_path, protocol):
    """A real third-party collector (rotel) receives from the SDK and exports, compressed, to agl."""
    import rotel

    binary = Path(rotel.__file__).parent / "rotel-agent"
    svc, url = service
    rotel_grpc, rotel_http = _free_port(), _free_port()
    target = f"http://127.0.0.1:{svc.grpc_port}" if protocol == "grpc" else url
    proc = subprocess.Popen(
        [
            str(binary),
            "start",
            "--otlp-grpc-endpoint",
            f"127.0.0.1:{rotel_grpc}",
            "--otlp-http-endpoint",
            f"127.0.0.1:{rotel_http}",
            "--exporter",
            "otlp",
            "--otlp-exporter-endpoint",
            target,
            "--otlp-exporter-protocol",
            protocol,
            "--otlp-exporter-compression",
            "gzip",
            "--batch-timeout",
            "100ms",
            "--pid-file",
            str(tmp_path / "rotel.pid"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        deadline = time.monotonic() + 20
        while True:  # wait for rotel's receiver
            try:
                socket.create_connection(("127.0.0.1", rotel_http), timeout=0.2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (
                    proc.stdout.read() if proc.poll() is not None else "rotel did not start"
                )
                time.sleep(0.1)
        provider = TracerProvider()
        provider.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"http://127.0.0.1:{rotel_http}/v1/traces"))
        )
        for _ in range(5):
            with rollout_scope(f"ro-rotel-{protocol}", tracer_provider=provider):
                pass
        provider.shutdown()
        client = StoreClient(url)
        deadline = time.monotonic() + 20
        while len(client.query_spans(rollout_ids=[f"ro-rotel-{protocol}"])) < 5:
            assert time.monotonic() < deadline, "rotel did not forward the spans"
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.communicate(timeout=20)  # reads and closes its pipe


def test_redaction_happens_before_anything_is_written(store):
    redactor = parse_rules(["key:secret.*", "email", "api-key", "regex:ACCT-\\d+"])
    svc = StoreService(store, redactor=redactor)
    url = svc.start_http_background()
    try:
        request = make_request("ro-red", 1, attrs=0)
        span = request.resource_spans[0].scope_spans[0].spans[0]
        span.attributes.add(key="secret.password").value.string_value = "hunter2"
        span.attributes.add(
            key="gen_ai.input.messages"
        ).value.string_value = "mail bob@example.com key sk-abcdefghijklmnop1234"
        nested = span.attributes.add(key="nested").value.kvlist_value.values.add(key="acct")
        nested.value.string_value = "ACCT-12345 and ACCT-9"
        span.attributes.add(key=semconv.PROMPT_TOKEN_IDS).value.array_value.values.add().int_value = 42
        span.status.message = "failed for alice@example.org"
        request.resource_spans[0].resource.attributes.add(key="secret.token").value.string_value = "t0k"
        assert _post(url, request).status_code == 200
        (stored,) = StoreClient(url).query_spans(rollout_ids=["ro-red"])
        assert "secret.password" not in stored.attributes and "secret.token" not in stored.resource
        assert stored.attributes["gen_ai.input.messages"] == f"mail {MASK} key {MASK}"
        assert stored.attributes["nested"] == {"acct": f"{MASK} and {MASK}"}
        assert stored.attributes[semconv.PROMPT_TOKEN_IDS] == [42]
        assert stored.status_message == f"failed for {MASK}"
        # the raw bytes on disk hold no trace of the secrets either
        raw = b"".join(bytes(r[0]) for r in store._read("SELECT body FROM spans"))
        assert b"hunter2" not in raw and b"bob@example.com" not in raw and b"ACCT-12345" not in raw
    finally:
        svc.close()
    with pytest.raises(ValueError, match="not one of"):
        parse_rules(["drop:x"])
    with pytest.raises(ValueError, match="invalid regular expression"):
        parse_rules(["regex:("])


def test_retention_by_age_and_consumed(store):
    old = make_request("ro-old", 3)
    for span in old.resource_spans[0].scope_spans[0].spans:
        span.start_time_unix_nano = int((time.time() - 10 * 86400) * 1e9)
    pipeline = IngestPipeline(store)
    for request in (old, make_request("ro-new", 2, first=10), make_request("ro-used", 4, first=20)):
        pipeline.submit(pipeline.parse(request.SerializeToString())).result()
    store.enqueue_rollouts(
        [{"task_id": "t", "rollout_id": "ro-used"}, {"task_id": "t", "rollout_id": "ro-new"}]
    )
    assert store.mark_consumed(["ro-used"]) == 1
    assert store.apply_retention(max_age_s=parse_duration("7d")) == 3
    assert store.apply_retention(consumed=True) == 4
    assert store.stats()["spans"] == 2 and len(store.query_spans(rollout_ids=["ro-new"])) == 2
    assert RetentionPolicy.parse(["7d", "consumed"]) == RetentionPolicy(7 * 86400, True)
    with pytest.raises(ValueError, match="duration"):
        RetentionPolicy.parse(["forever"])
    pipeline.close()


def test_backpressure_answers_retry_later_and_recovers(store):
    gate = threading.Event()
    original = store.add_span_rows

    def slow_add(rows, scopes):
        gate.wait(10)
        return original(rows, scopes)

    store.add_span_rows = slow_add  # a stalled disk
    pipeline = IngestPipeline(store, max_pending_spans=100)
    from agl_core.store.server import create_store_app

    with BackgroundServer(create_store_app(store, pipeline=pipeline)) as server:
        first = threading.Thread(target=_post, args=(server.url, make_request("ro-bp", 80)))
        first.start()
        deadline = time.monotonic() + 5
        while pipeline._pending == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = _post(server.url, make_request("ro-bp", 80, first=100))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        gate.set()
        first.join(10)
        assert _post(server.url, make_request("ro-bp", 80, first=100)).status_code == 200
    assert len(store.query_spans(rollout_ids=["ro-bp"])) == 160
    pipeline.close()


def test_write_failure_is_reported_not_acknowledged(store):
    def broken(rows, scopes):
        raise RuntimeError("disk full")

    store.add_span_rows = broken
    pipeline = IngestPipeline(store)
    future = pipeline.submit(pipeline.parse(make_request("ro-x", 2).SerializeToString()))
    # a database error is reported as retryable (HTTP 503 / gRPC UNAVAILABLE), never acknowledged
    with pytest.raises(StoreUnavailableError, match="RuntimeError: disk full"):
        future.result(10)
    pipeline.close()


def test_32_concurrent_exporters_lose_nothing(service):
    svc, url = service
    per_sender, batch = 6, 40

    def sender(k: int) -> None:
        with httpx.Client() as http:
            for b in range(per_sender):
                body = make_request(f"ro-c{k}", batch, first=1 + b * batch).SerializeToString()
                if b % 2:
                    response = http.post(
                        url + "/v1/traces",
                        content=gzip.compress(body),
                        headers={"content-type": "application/x-protobuf", "content-encoding": "gzip"},
                    )
                else:
                    response = http.post(
                        url + "/v1/traces", content=body, headers={"content-type": "application/x-protobuf"}
                    )
                assert response.status_code == 200

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    client = StoreClient(url)
    assert client.stats()["spans"] == 32 * per_sender * batch
    assert {len(client.query_spans(rollout_ids=[f"ro-c{k}"])) for k in range(32)} == {per_sender * batch}


def test_async_client(service):
    svc, url = service

    async def scenario():
        async with AsyncStoreClient(url) as client:
            (queued,) = await client.enqueue_rollouts([{"task_id": "t", "input": 3}])
            rollout, attempt = await client.dequeue_rollout("w", lease_s=5)
            assert (await client.heartbeat(attempt.attempt_id)).status.value == "running"
            done = await client.complete_attempt(attempt.attempt_id, "succeeded", reward=1.0)
            assert done.reward == 1.0
            assert (await client.put_resource("r", {"a": 1})).version == 1
            assert (await client.get_resource("r")).value == {"a": 1}
            return await client.wait_for_rollouts([queued.rollout_id], timeout_s=1)

    (final,) = asyncio.run(scenario())
    assert final.status.value == "succeeded"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=512))
def test_fuzz_protobuf_decoder_never_crashes(body):
    pipeline = IngestPipeline(store=None)
    try:
        batch = pipeline.parse(body)
    except OtlpDecodeError:
        return
    for row in batch.rows:
        assert len(row[0]) == 16 and len(row[1]) == 8


@settings(max_examples=200, deadline=None)
@given(
    doc=st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
        max_leaves=20,
    )
)
def test_fuzz_json_decoder_never_crashes(doc):
    pipeline = IngestPipeline(store=None)
    for candidate in (doc, {"resourceSpans": [{"scopeSpans": [{"spans": [doc]}]}]}):
        try:
            pipeline.parse(json.dumps(candidate).encode(), json_body=True)
        except OtlpDecodeError:
            pass


def test_mutated_real_requests_never_crash(service):
    """Bit flips and truncations of a real request: each gets a 200 or a clear 400, the server lives."""
    svc, url = service
    good = make_request("ro-mut", 3).SerializeToString()
    with httpx.Client() as http:
        for i in range(0, len(good), 7):
            for body in (good[:i], good[:i] + bytes([good[i] ^ 0xFF]) + good[i + 1 :]):
                response = http.post(
                    url + "/v1/traces", content=body, headers={"content-type": "application/x-protobuf"}
                )
                assert response.status_code in (200, 400), response.status_code
        assert http.get(url + "/healthz").status_code == 200


def test_hostile_values(service):
    svc, url = service
    request = make_request("ro-hostile", 1, attrs=0)
    span = request.resource_spans[0].scope_spans[0].spans[0]
    span.name = "n\x00ame" + "y" * 5000
    span.attributes.add(key="big").value.string_value = "z" * 200_000
    deep = span.attributes.add(key="deep").value
    for _ in range(30):
        deep = deep.kvlist_value.values.add(key="k").value
    span.attributes.add(key="nul").value.string_value = "a\x00b"
    span.end_time_unix_nano = 2**64 - 1  # beyond int64
    response = _post(url, request)
    assert response.status_code == 200  # the request is fine; that one span is rejected with its reason
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    partial = ExportTraceServiceResponse.FromString(response.content).partial_success
    assert partial.rejected_spans == 1 and "2262" in partial.error_message
    span.end_time_unix_nano = span.start_time_unix_nano
    assert _post(url, request).status_code == 200
    (stored,) = StoreClient(url).query_spans(rollout_ids=["ro-hostile"])
    assert len(stored.attributes["big"]) == 200_000 and stored.attributes["nul"] == "a\x00b"


@pytest.mark.skipif(shutil.which("kill") is None, reason="needs kill")
@pytest.mark.parametrize("attrs", [3, 12], ids=["written-by-the-store", "written-by-workers"])
def test_sigkill_loses_no_acknowledged_span(tmp_path, attrs):
    """Kill -9 the server in the middle of ingestion; every acknowledged span is there after a restart.
    Exports of 50 spans with 3 attributes are under 16 KB and written by the store process; with 12 they
    go to the parse workers, which write them themselves and die with the store (SIGTERM from the
    kernel)."""
    db = tmp_path / "crash.sqlite"
    port = _free_port()

    def start():
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agl_core.cli",
                "store",
                "serve",
                "--db",
                str(db),
                "--http-port",
                str(port),
                "--no-grpc",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.05)

    proc = start()
    acked: list[int] = []
    stop = threading.Event()

    def sender(k: int) -> None:
        with httpx.Client(timeout=5) as http:
            b = 0
            while not stop.is_set():
                body = make_request(f"ro-k{k}", 50, first=1 + b * 50, attrs=attrs).SerializeToString()
                try:
                    response = http.post(
                        f"http://127.0.0.1:{port}/v1/traces",
                        content=body,
                        headers={"content-type": "application/x-protobuf"},
                    )
                except httpx.HTTPError:
                    return
                if response.status_code == 200:
                    acked.append((k, b))
                b += 1

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while len(acked) < 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, 9)
    proc.wait()
    stop.set()
    for t in threads:
        t.join(10)
    assert len(acked) >= 20
    proc = start()
    try:
        client = StoreClient(f"http://127.0.0.1:{port}")
        for k in range(4):
            stored = {s.name for s in client.all_spans([f"ro-k{k}"])}
            for kk, b in acked:
                if kk == k:
                    assert {f"span-{i}" for i in range(1 + b * 50, 51 + b * 50)} <= stored
    finally:
        proc.terminate()
        proc.wait(10)


def test_parse_workers_decode_in_another_process_with_the_same_result():
    redactor = parse_rules(["email", "key:attr.1"])
    pipeline = IngestPipeline(store=None, redactor=redactor, parse_workers=1)
    try:
        request = make_request("ro-w", 300, attrs=3)
        request.resource_spans[0].scope_spans[0].spans[0].attributes.add(
            key="m"
        ).value.string_value = "x@y.org"
        body = request.SerializeToString()
        assert len(body) > 16_384
        remote = pipeline.parse_async(body).result(60)
        assert remote == pipeline.parse(body)
        assert len(remote.rows) == 300 and b"x@y.org" not in remote.rows[0][10]
        with pytest.raises(OtlpDecodeError):
            pipeline.parse_async(b"\xff" * 20_000).result(60)
    finally:
        pipeline.close()


def test_a_parse_worker_sends_back_where_each_span_lies_and_the_store_gets_its_bytes():
    """Without redaction a worker returns each span's place in the body, not its bytes; the rows the
    store then writes are those of a parse in its own process (spans with and without a rollout id, with
    an attempt id before the rollout id, a span with an invalid id, a second resource and scope)."""
    request = make_request("ro-o", 200, attrs=3)
    spans = request.resource_spans[0].scope_spans[0].spans
    del spans[7].attributes[0]  # no rollout id
    spans[8].attributes.insert(0, spans[8].attributes[0])  # attempt id first, then the rollout id
    spans[8].attributes[0].key = semconv.ATTEMPT_ID
    spans[9].span_id = b"\0" * 8  # invalid: rejected
    extra = make_request("ro-o2", 30, first=500)
    request.resource_spans.add().CopyFrom(extra.resource_spans[0])
    body = request.SerializeToString()
    pipeline = IngestPipeline(store=None, parse_workers=1)
    try:
        remote = pipeline.parse_async(body).result(60)
        local = pipeline.parse(body)
        assert remote == local
        assert len(remote.rows) == 229 and remote.rejected == 1
        by_name = {row[3]: row for row in remote.rows}
        assert by_name["span-8"][7] is None and by_name["span-9"][7:9] == ("ro-o", "ro-o")
        assert {row[7] for row in remote.rows} == {"ro-o", "ro-o2", None}
        sent_back = _parse_elsewhere(body, False, None)
        assert all(type(row[10]) is tuple for row in sent_back.rows)  # places, not bytes
        assert _with_bodies(sent_back, body) == local
    finally:
        pipeline.close()


def test_a_failure_putting_a_workers_rows_together_reaches_the_request(monkeypatch):
    import agl_core.store.ingest as ingest

    def broken(batch, body):
        raise RuntimeError("rows could not be put together")

    monkeypatch.setattr(ingest, "_with_bodies", broken)
    pipeline = IngestPipeline(store=None, parse_workers=1)
    try:
        with pytest.raises(RuntimeError, match="put together"):
            pipeline.parse_async(make_request("ro-f", 200).SerializeToString()).result(60)
        assert pipeline._decoding == 0
    finally:
        pipeline.close()


def test_unredacted_spans_are_stored_as_the_bytes_they_arrived_as():
    request = make_request("ro-a", 3)
    second = request.resource_spans.add()  # a second resource, its two scopes: order kept everywhere
    for scope_no in range(2):
        scope = second.scope_spans.add()
        scope.scope.name = f"scope-{scope_no}"
        scope.spans.extend(
            make_request("ro-b", 2, first=10 + 10 * scope_no).resource_spans[0].scope_spans[0].spans
        )
    body = request.SerializeToString()
    sliced = extract_rows(decode_protobuf(body), raw=body)
    encoded = extract_rows(decode_protobuf(body))
    assert sliced == encoded and len(sliced.rows) == 7
    assert [row[10] for row in sliced.rows] == [
        span.SerializeToString()
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]
    assert span_slices(b"\x0a\x05\x12") is None  # a field running past the end: spans are encoded instead


def test_grpc_requires_the_bearer_token_when_configured(store):
    import grpc
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    svc = StoreService(store, token="s3cret")
    port = svc.start_grpc("127.0.0.1", 0)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
        body = make_request("ro-auth", 2).SerializeToString()
        with pytest.raises(grpc.RpcError) as info:
            export(body, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            export(b"\xff\xff", metadata=[("authorization", "Bearer s3cret")], timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        export(body, metadata=[("authorization", "Bearer s3cret")], timeout=10)
        channel.close()
        provider = TracerProvider()
        provider.add_span_processor(
            SimpleSpanProcessor(
                GrpcExporter(
                    endpoint=f"127.0.0.1:{port}", insecure=True, headers={"authorization": "Bearer s3cret"}
                )
            )
        )
        with rollout_scope("ro-auth-sdk", tracer_provider=provider):
            pass
        provider.shutdown()
        assert len(store.query_spans(rollout_ids=["ro-auth"])) == 2
        assert len(store.query_spans(rollout_ids=["ro-auth-sdk"])) == 1
    finally:
        svc.close()


@pytest.mark.parametrize("variable_limit", [None, 999])
def test_sqlite_writes_a_batch_in_few_statements_in_order_and_each_span_once(sqlite_store, variable_limit):
    """Every statement step gives up Python's lock, and taking it back from a thread busy with Python
    costs up to the switch interval: a batch goes in as a few multi-row INSERTs, not one per span. The
    order of the batch is the order of ``seq``; a span already stored, or twice in the batch, is written
    once; an SQLite allowing fewer bound variables gets smaller statements."""
    store = sqlite_store
    first = extract_rows(make_request("ro-many", 30, first=1))
    store.add_span_rows(first.rows, first.scopes)
    writer = store._writer
    if variable_limit:
        writer.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, variable_limit)
    statements: list[str] = []
    writer.set_trace_callback(
        lambda sql: statements.append(sql) if sql.startswith("INSERT INTO spans") else None
    )
    batch = extract_rows(make_request("ro-many", 1_300, first=11))  # spans 11-30 are stored already
    rows = batch.rows + batch.rows[500:503]  # and three come twice
    try:
        assert store.add_span_rows(rows, batch.scopes) == 1_300 - 20
    finally:
        writer.set_trace_callback(None)
    per = 256 if variable_limit is None else 64  # rows per statement: 11 variables each
    assert len(statements) <= len(rows) // per + 8, len(statements)
    assert max(sql.count("'span-") for sql in statements) == per  # the trace shows the bound values
    spans = store.query_spans(rollout_ids=["ro-many"], limit=5_000)
    assert [s.name for s in spans] == [f"span-{i}" for i in range(1, 1_311)]
    assert [s.seq for s in spans] == sorted(s.seq for s in spans)
    assert spans[-1].attributes["attr.2"] == "x" * 40

    with pytest.raises(ValueError, match="11 fields"):  # a malformed row fails the whole write
        store.add_span_rows([*extract_rows(make_request("ro-bad", 3)).rows, ("short",)], {})  # type: ignore[list-item]
    assert store.query_spans(rollout_ids=["ro-bad"]) == []
