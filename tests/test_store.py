"""The collector-store: the real OTel OTLP/HTTP exporter into the real server and SQLite."""

from __future__ import annotations

import gzip
import sqlite3
import time

import httpx
import pytest
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from agl_core import semconv
from agl_core.records import RolloutStatus
from agl_core.store import NotFoundError, StoreError
from agl_core.store.formats.otlp import extract_rows
from agl_core.store.sqlite import PAGE_SIZE, SqliteStore
from agl_core.tracing import emit_reward, rollout_scope

from .test_store_ingest import make_request


def _provider(url: str) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": "test-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url + "/v1/traces")))
    return provider


def test_real_otlp_http_exporter_spans_land_in_sqlite_and_read_back(store_server, client):
    provider = _provider(store_server.url)
    tracer = provider.get_tracer("t")
    with rollout_scope("ro-1", "at-1", "task-1", tracer_provider=provider):
        with tracer.start_as_current_span("step", attributes={"n": 3, "xs": [1, 2], "f": 0.5, "ok": True}):
            emit_reward(0.75, tracer_provider=provider)
    with rollout_scope("ro-2", tracer_provider=provider):
        with tracer.start_as_current_span("other"):
            pass
    provider.shutdown()

    spans = client.query_spans(rollout_ids=["ro-1"])
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {semconv.SPAN_ROLLOUT, semconv.SPAN_REWARD}  # "step" has no rollout attrs
    reward = by_name[semconv.SPAN_REWARD]
    assert reward.attributes[semconv.REWARD_VALUE] == 0.75
    assert reward.attributes[semconv.TASK_ID] == "task-1"
    root = by_name[semconv.SPAN_ROLLOUT]
    assert reward.trace_id == root.trace_id and root.parent_span_id is None
    assert root.resource["service.name"] == "test-agent"
    assert all(s.seq and s.seq > 0 for s in spans)

    step = [s for s in client.query_spans(trace_id=root.trace_id) if s.name == "step"][0]
    assert step.attributes == {"n": 3, "xs": [1, 2], "f": 0.5, "ok": True}
    assert step.parent_span_id == root.span_id
    assert [s.name for s in client.query_spans(rollout_ids=["ro-2"])] == [semconv.SPAN_ROLLOUT]


def test_spans_are_stored_once(store_server, store):
    provider = _provider(store_server.url)
    with rollout_scope("ro-dup", tracer_provider=provider):
        pass
    provider.force_flush()
    span = store.query_spans(rollout_ids=["ro-dup"])[0]
    assert store.add_spans([span, span]) == 0
    assert len(store.query_spans(rollout_ids=["ro-dup"])) == 1


def _export_body(store_server) -> bytes:
    """A real exporter's protobuf body, captured by encoding one span like the SDK does."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    provider = TracerProvider()
    captured = []

    class Capture(SimpleSpanProcessor):
        def on_end(self, span):  # noqa: D401
            captured.append(span)

    provider.add_span_processor(Capture(OTLPSpanExporter(endpoint=store_server.url + "/v1/traces")))
    with provider.get_tracer("t").start_as_current_span("gz", attributes={semconv.ROLLOUT_ID: "ro-gz"}):
        pass
    return encode_spans(captured).SerializeToString()


def test_gzip_bodies_are_accepted(store_server, client):
    body = _export_body(store_server)
    response = httpx.post(
        store_server.url + "/v1/traces",
        content=gzip.compress(body),
        headers={"content-type": "application/x-protobuf", "content-encoding": "gzip"},
    )
    assert response.status_code == 200
    ExportTraceServiceResponse.FromString(response.content)
    assert any(s.name == "gz" for s in client.query_spans(rollout_ids=["ro-gz"]))


@pytest.mark.parametrize(
    "body, headers, status, reason",
    [
        (b"\xff\xff\xff garbage", {"content-type": "application/x-protobuf"}, 400, "not a valid OTLP"),
        (b"x", {"content-type": "text/plain"}, 415, "send application/x-protobuf or application/json"),
        (b"", {}, 415, "(none)"),
        (
            b"abc",
            {"content-type": "application/x-protobuf", "content-encoding": "gzip"},
            400,
            "not valid gzip",
        ),
        (
            b"abc",
            {"content-type": "application/x-protobuf", "content-encoding": "br"},
            415,
            "Content-Encoding",
        ),
    ],
)
def test_malformed_otlp_bodies_get_a_reason_and_the_server_keeps_serving(
    store_server, body, headers, status, reason
):
    response = httpx.post(store_server.url + "/v1/traces", content=body, headers=headers)
    assert response.status_code == status
    assert reason in status_pb2.Status.FromString(response.content).message
    assert httpx.get(store_server.url + "/healthz").json() == {"ok": True}


def test_oversized_body_gets_413(store_server):
    from agl_core.store import server

    response = httpx.post(
        store_server.url + "/v1/traces",
        content=b"\0" * (server.MAX_BODY_BYTES + 1),
        headers={"content-type": "application/x-protobuf"},
    )
    assert response.status_code == 413


def test_spans_with_invalid_ids_are_rejected_as_partial_success(store_server, client):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    good = scope.spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="good")
    good.attributes.add(key=semconv.ROLLOUT_ID).value.string_value = "ro-ids"
    scope.spans.add(trace_id=b"\x00" * 16, span_id=b"\x03" * 8, name="zero-trace")
    scope.spans.add(trace_id=b"\x01" * 5, span_id=b"\x03" * 8, name="short-trace")
    response = httpx.post(
        store_server.url + "/v1/traces",
        content=request.SerializeToString(),
        headers={"content-type": "application/x-protobuf"},
    )
    assert response.status_code == 200
    partial = ExportTraceServiceResponse.FromString(response.content).partial_success
    assert partial.rejected_spans == 2 and "trace_id" in partial.error_message
    assert [s.name for s in client.query_spans(rollout_ids=["ro-ids"])] == ["good"]


def test_rollout_queue_lifecycle_with_retries(client):
    queued = client.enqueue_rollouts(
        [
            {"task_id": "t1", "input": {"q": 1}, "group_id": "g", "max_attempts": 2},
            {"task_id": "t2", "input": None},
        ]
    )
    assert [r.status for r in queued] == [RolloutStatus.QUEUED] * 2
    rollout, attempt = client.dequeue_rollout("w1")
    assert rollout.rollout_id == queued[0].rollout_id and rollout.input == {"q": 1} and attempt.number == 1
    # first attempt fails: the rollout goes back to the queue (2 attempts allowed)
    assert (
        client.complete_attempt(attempt.attempt_id, RolloutStatus.FAILED, error="boom").status
        == RolloutStatus.QUEUED
    )
    # the oldest queued rollout goes first, so the retry comes before t2
    third = client.dequeue_rollout("w2")
    assert third[0].rollout_id == queued[0].rollout_id and third[1].number == 2
    second = client.dequeue_rollout("w2")
    assert second[0].rollout_id == queued[1].rollout_id
    done = client.complete_attempt(third[1].attempt_id, RolloutStatus.SUCCEEDED, reward=0.5)
    assert done.status == RolloutStatus.SUCCEEDED and done.reward == 0.5
    assert [a.status for a in done.attempts] == [RolloutStatus.FAILED, RolloutStatus.SUCCEEDED]
    assert done.attempts[0].error == "boom"
    with pytest.raises(StoreError, match="already finished"):
        client.complete_attempt(third[1].attempt_id, RolloutStatus.SUCCEEDED)
    assert client.dequeue_rollout("w3") is None
    with pytest.raises(NotFoundError):
        client.get_rollouts(["nope"])


def test_resources_are_versioned(client):
    assert client.get_resource("llm") is None
    assert client.put_resource("llm", {"base_url": "a"}).version == 1
    assert client.put_resource("llm", {"base_url": "b"}).version == 2
    latest = client.get_resource("llm")
    assert (latest.version, latest.value) == (2, {"base_url": "b"})


@pytest.mark.parametrize(
    "path, body, status, fragment",
    [
        ("/api/rollouts", {"rollouts": []}, 400, "rollouts"),
        ("/api/rollouts", {"rollouts": [{"input": 1}]}, 400, "task_id"),
        ("/api/rollouts", {"rollouts": [{"task_id": "t", "colour": 1}]}, 400, "colour"),
        ("/api/rollouts/dequeue", {}, 400, "worker_id"),
        ("/api/attempts/at-x/complete", {"status": "running"}, 400, "status"),
        ("/api/attempts/at-x/complete", {"status": "succeeded"}, 404, "at-x"),
        ("/api/spans/query", {"trace_id": "XYZ"}, 400, "trace_id"),
    ],
)
def test_api_validates_input(store_server, path, body, status, fragment):
    response = httpx.post(store_server.url + path, json=body)
    assert response.status_code == status
    assert fragment in response.json()["error"]["message"]


def test_api_rejects_non_json(store_server):
    response = httpx.post(
        store_server.url + "/api/rollouts", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    response = httpx.post(
        store_server.url + "/api/rollouts", content=b"x", headers={"content-type": "text/plain"}
    )
    assert response.status_code == 415


def test_bearer_token_is_enforced(store):
    from agl_core.server import BackgroundServer
    from agl_core.store import StoreClient
    from agl_core.store.server import create_store_app

    with BackgroundServer(create_store_app(store, token="s3cret")) as server:
        assert httpx.get(server.url + "/api/stats").status_code == 401
        assert (
            httpx.post(
                server.url + "/v1/traces", content=b"", headers={"content-type": "application/x-protobuf"}
            ).status_code
            == 401
        )
        with StoreClient(server.url, token="s3cret") as authed:
            assert authed.stats()["spans"] == 0


def test_leases_heartbeats_and_reclaiming_dead_runners(store):
    (a, b) = store.enqueue_rollouts([{"task_id": "t1", "max_attempts": 2}, {"task_id": "t2"}])
    ra, att_a = store.dequeue_rollout("w-dies", lease_s=10)
    rb, att_b = store.dequeue_rollout("w-alive", lease_s=10)
    now = time.time()
    # w-alive keeps beating; w-dies goes silent
    assert store.heartbeat(att_b.attempt_id, lease_s=100).status == RolloutStatus.RUNNING
    assert store.reclaim_expired(now=now + 50) == 1
    (ra,) = store.get_rollouts([a.rollout_id])
    assert ra.status == RolloutStatus.QUEUED  # a second try is allowed
    assert ra.attempts[0].status == RolloutStatus.TIMED_OUT and "w-dies" in ra.attempts[0].error
    # the dead runner's late result is refused, the live one's heartbeat says it is timed out
    with pytest.raises(StoreError, match="already finished"):
        store.complete_attempt(att_a.attempt_id, RolloutStatus.SUCCEEDED, reward=1.0)
    assert store.heartbeat(att_a.attempt_id).status == RolloutStatus.TIMED_OUT
    retry = store.dequeue_rollout("w-new", lease_s=10)
    assert retry[0].rollout_id == a.rollout_id and retry[1].number == 2
    assert store.reclaim_expired(now=now + 500) == 2  # retry and b both lapse; no tries left
    assert {r.status for r in store.get_rollouts([a.rollout_id, b.rollout_id])} == {RolloutStatus.TIMED_OUT}


def test_cancel_queued_and_running(store):
    (q, r, done) = store.enqueue_rollouts([{"task_id": "q"}, {"task_id": "r"}, {"task_id": "d"}])
    _, running = store.dequeue_rollout("w")  # takes q (oldest)
    _, finished = store.dequeue_rollout("w")
    store.complete_attempt(finished.attempt_id, RolloutStatus.SUCCEEDED)
    out = {
        x.rollout_id: x.status for x in store.cancel_rollouts([q.rollout_id, r.rollout_id, done.rollout_id])
    }
    assert out == {
        q.rollout_id: RolloutStatus.CANCELLED,
        r.rollout_id: RolloutStatus.SUCCEEDED,
        done.rollout_id: RolloutStatus.CANCELLED,
    }
    assert store.heartbeat(running.attempt_id).status == RolloutStatus.CANCELLED
    assert store.dequeue_rollout("w") is None
    with pytest.raises(NotFoundError):
        store.cancel_rollouts(["ro-none"])


def test_span_queries_by_attempt_and_time(store):
    from .conftest import make_span

    spans = [
        make_span("a", {semconv.ROLLOUT_ID: "ro-q", semconv.ATTEMPT_ID: "at-1"}, start=100),
        make_span("b", {semconv.ROLLOUT_ID: "ro-q", semconv.ATTEMPT_ID: "at-2"}, start=200),
        make_span("c", {semconv.ROLLOUT_ID: "ro-q", semconv.ATTEMPT_ID: "at-2"}, start=300),
    ]
    assert store.add_spans(spans) == 3 and store.add_spans(spans) == 0
    assert [s.name for s in store.query_spans(attempt_id="at-2")] == ["b", "c"]
    assert [s.name for s in store.query_spans(start_after_ns=150, start_before_ns=300)] == ["b"]
    assert [s.name for s in store.query_spans(rollout_ids=["ro-q"], limit=2)] == ["a", "b"]
    first = store.query_spans(rollout_ids=["ro-q"], limit=1)[0]
    assert [s.name for s in store.query_spans(rollout_ids=["ro-q"], after_seq=first.seq)] == ["b", "c"]
    assert spans[0].attributes == store.query_spans(attempt_id="at-1")[0].attributes


def test_new_sqlite_files_get_large_pages_and_old_ones_keep_theirs(tmp_path):
    new = SqliteStore(tmp_path / "new.sqlite")
    old_path = tmp_path / "old.sqlite"
    with sqlite3.connect(old_path) as conn:  # a file an earlier agl made, with SQLite's 4 KiB pages
        conn.execute("PRAGMA page_size=4096")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE kept (x)")
    old = SqliteStore(old_path)
    try:
        for store, pages in ((new, PAGE_SIZE), (old, 4096)):
            assert store._writer.execute("PRAGMA page_size").fetchone() == (pages,)
            batch = extract_rows(make_request("ro-pages", 40))
            assert store.add_span_rows(batch.rows, batch.scopes) == 40
            assert len(store.query_spans(rollout_ids=["ro-pages"])) == 40
    finally:
        new.close()
        old.close()


def test_a_span_query_page_is_bounded_by_bytes_and_the_client_pages_on(store, monkeypatch):
    """With 6 MB of spans stored, a page holds at most QUERY_PAGE_BYTES (here 1 MB) of them and says
    there is more; the client reads on to its limit, every span once, in order."""
    from agl_core.store import server as store_server_module
    from agl_core.testing import Collector

    from .conftest import make_span

    monkeypatch.setattr(store_server_module, "QUERY_PAGE_BYTES", 1_000_000)
    spans = [make_span(f"s{i}", {"blob": f"{i:04d}" + "b" * 200_000}, trace_id="ab" * 16) for i in range(30)]
    store.add_spans(spans)
    page, more = store.span_page(limit=1000, max_bytes=1_000_000)
    assert more and 1 <= len(page) <= 5
    one, more_one = store.span_page(limit=1000, max_bytes=10)  # one span over the bound still comes
    assert len(one) == 1 and more_one
    everything, more_all = store.span_page(limit=1000)
    assert len(everything) == 30 and not more_all
    with Collector(store) as collector:
        raw = httpx.post(collector.url + "/api/spans/query", json={"limit": 1000}).json()
        assert raw["more"] is True and len(raw["spans"]) < 30
        got = collector.client.query_spans(limit=1000)
        assert [s.name for s in got] == [f"s{i}" for i in range(30)]
        assert len(collector.client.query_spans(limit=7)) == 7
        assert len(collector.client.all_spans([])) == 0
