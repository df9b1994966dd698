"""The store under hostile input and lost workers, on SQLite and PostgreSQL: every refusal is a 4xx that
says what was wrong (or a retryable 503), and nothing bad is committed."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from agl_core.store import StoreClient
from agl_core.store.formats.otlp import MAX_SPANS_PER_REQUEST
from agl_core.store.ingest import IngestPipeline, Overloaded
from agl_core.store.service import StoreService
from tests._servers import wait_healthy

from ._exports import export_steps
from .test_store_ingest import make_request


def _api(url: str, path: str, body: bytes | str) -> httpx.Response:
    return httpx.post(url + path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    "body",
    [
        '{"rollouts": [{"task_id": "t", "input": {"x": NaN}}]}',
        '{"rollouts": [{"task_id": "t", "input": [1, Infinity]}]}',
        '{"rollouts": [{"task_id": "t", "metadata": {"deep": [{"v": -Infinity}]}}]}',
        '{"rollouts": [{"task_id": "t", "input": 1e400}]}',
    ],
)
def test_non_finite_numbers_are_refused_and_nothing_is_queued(store_server, client, body):
    r = _api(store_server.url, "/api/rollouts", body)
    assert r.status_code == 400 and "finite" in r.json()["error"]["message"]
    assert client.dequeue_rollout("w") is None  # nothing was committed, nothing half-claimed
    assert client.stats()["rollouts"] == 0


def test_non_finite_resource_value_is_refused(store_server, client):
    r = httpx.put(
        store_server.url + "/api/resources/policy",
        content='{"value": {"lr": NaN}}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert client.get_resource("policy") is None


def test_store_api_refuses_non_finite_values_from_library_callers(store):
    with pytest.raises(ValueError, match="NaN and Infinity"):
        store.enqueue_rollouts([{"task_id": "t", "input": math.nan}])
    assert store.dequeue_rollout("w") is None


@pytest.mark.parametrize(
    "query",
    [{"after_seq": 2**63}, {"start_after_ns": 2**64}, {"start_before_ns": 2**63}, {"after_seq": -1}],
)
def test_out_of_range_integers_are_a_400(store_server, query):
    r = _api(store_server.url, "/api/spans/query", json.dumps(query))
    assert r.status_code == 400, r.text
    assert "error" in r.json()


def test_largest_int64_is_accepted(store_server):
    r = _api(store_server.url, "/api/spans/query", json.dumps({"after_seq": 2**63 - 1}))
    assert r.status_code == 200 and r.json() == {"spans": [], "more": False}


@pytest.mark.parametrize("path", ["/api/rollouts/query", "/api/rollouts/cancel", "/api/rollouts/consumed"])
def test_nul_in_an_id_list_is_a_400_on_both_backends(store_server, path):
    r = _api(store_server.url, path, json.dumps({"rollout_ids": ["ro-1", "ro-\u0000x"]}))
    assert r.status_code == 400 and "rollout_ids" in r.json()["error"]["message"]


def test_nul_in_ids_and_path_params(store_server):
    assert (
        _api(store_server.url, "/api/rollouts", '{"rollouts": [{"task_id": "a\\u0000"}]}').status_code == 400
    )
    assert _api(store_server.url, "/api/rollouts/dequeue", '{"worker_id": "w\\u0000"}').status_code == 400
    r = _api(store_server.url, "/api/attempts/at%00x/heartbeat", "{}")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request"


def test_id_lists_are_bounded_and_the_client_pages(store_server, client):
    ids = [f"ro-{i}" for i in range(10_001)]
    r = _api(store_server.url, "/api/rollouts/query", json.dumps({"rollout_ids": ids}))
    assert r.status_code == 400 and "10000" in r.json()["error"]["message"]
    queued = client.enqueue_rollouts([{"task_id": "t", "rollout_id": i} for i in ids])  # two calls
    assert len(queued) == len(ids)
    found = client.get_rollouts(ids)  # two pages
    assert [x.rollout_id for x in found] == ids


def test_unknown_routes_and_methods_answer_json(store_server):
    missing = httpx.get(store_server.url + "/api/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"
    wrong = httpx.get(store_server.url + "/api/rollouts/dequeue")
    assert wrong.status_code == 405 and "POST" in wrong.headers["allow"]
    assert wrong.json()["error"]["type"] == "method_not_allowed"


@pytest.mark.parametrize(
    "body",
    [
        {"resourceSpans": 5},
        {"resourceSpans": [{"scopeSpans": 7}]},
        {"resourceSpans": [{"scopeSpans": [{"spans": 3.5}]}]},
        {"resourceSpans": [{"scopeSpans": [{"spans": [{"links": 5}]}]}]},
        {"resourceSpans": [{"scopeSpans": [{"spans": [{"links": [True]}]}]}]},
        {"resourceSpans": [{"scopeSpans": [{"spans": [{"name": {"x": 1}}]}]}]},
        {"resourceSpans": ["x"]},
        True,
        [1, 2],
    ],
)
def test_otlp_json_with_wrong_container_types_is_a_400_status(store_server, body):
    r = httpx.post(
        store_server.url + "/v1/traces",
        content=json.dumps(body),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    status = r.json()  # a google.rpc.Status in its JSON form
    assert status["code"] == 3 and status["message"]


def test_a_request_over_the_span_cap_is_refused_whole(store_server, client):
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for i in range(1, MAX_SPANS_PER_REQUEST + 2):
        scope.spans.add(trace_id=i.to_bytes(16, "big"), span_id=i.to_bytes(8, "big"))
    r = httpx.post(
        store_server.url + "/v1/traces",
        content=request.SerializeToString(),
        headers={"content-type": "application/x-protobuf"},
        timeout=60,
    )
    assert r.status_code == 400 and b"smaller batches" in r.content
    assert client.stats()["spans"] == 0


def test_decode_budget_and_full_backlog_refuse_before_decoding(sqlite_store):
    pipeline = IngestPipeline(sqlite_store, max_decoding_bytes=1000, max_pending_spans=10)
    try:
        pipeline.admit(800)  # one request alone is always admitted
        with pytest.raises(Overloaded, match="decoding"):
            pipeline.admit(300)
        pipeline._release(800)
        pipeline.admit(300)
        pipeline._release(300)
        pipeline._pending = 10  # the writer is 10 spans behind: the limit
        with pytest.raises(Overloaded, match="busy"):
            pipeline.parse_async(make_request("ro-x", 1).SerializeToString())
    finally:
        pipeline._pending = 0
        pipeline.close()


def test_a_store_without_parse_workers_keeps_to_the_decode_budget(sqlite_store):
    """Decoding in the server process (``--parse-workers 0``) is refused past the decode budget as in a
    worker, before the body is decoded, with the retryable answer; once the budget frees, it is stored."""
    service = StoreService(sqlite_store, parse_workers=0)
    url = service.start_http_background()
    body = make_request("ro-b", 300).SerializeToString()
    headers = {"content-type": "application/x-protobuf"}
    try:
        service.pipeline.max_decoding_bytes = len(body)
        service.pipeline.admit(1)  # another request is being decoded
        refused = httpx.post(url + "/v1/traces", content=body, headers=headers)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "decoding" in refused.text
        assert sqlite_store.stats()["spans"] == 0
        service.pipeline._release(1)
        stored = httpx.post(url + "/v1/traces", content=body, headers=headers)
        assert stored.status_code == 200
        assert sqlite_store.stats()["spans"] == 300
        assert service.pipeline._decoding == 0
    finally:
        service.close()


def _workers(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True) if "python" in p.name().lower()]


def test_a_killed_parse_worker_is_replaced_and_no_span_is_lost(sqlite_store):
    """SIGKILL the parse worker: the next big request gets a retryable 503, the real OTLP exporter retries
    it, the pool is rebuilt, and every span the exporter was told was stored is stored."""
    service = StoreService(sqlite_store, parse_workers=1)
    url = service.start_http_background()
    try:
        big = make_request("ro-w", 300).SerializeToString()  # over the 16 KB that goes to a worker
        ok = httpx.post(url + "/v1/traces", content=big, headers={"content-type": "application/x-protobuf"})
        assert ok.status_code == 200
        workers = _workers(os.getpid())
        pool_workers = [p for p in workers if "resource_tracker" not in " ".join(p.cmdline())]
        assert pool_workers, "no parse worker process found"
        for p in pool_workers:
            p.send_signal(signal.SIGKILL)
        psutil.wait_procs(pool_workers, timeout=10)
        retry = httpx.post(
            url + "/v1/traces",
            content=make_request("ro-w", 300, first=301).SerializeToString(),
            headers={"content-type": "application/x-protobuf"},
        )
        assert retry.status_code in (200, 503)
        if retry.status_code == 503:
            assert retry.headers["retry-after"] == "1"
        # the real exporter: retries 503 until the rebuilt pool answers
        export_steps(OTLPSpanExporter(endpoint=url + "/v1/traces"), "ro-e", 300, "y" * 60)
        with StoreClient(url) as client:
            (root,) = client.all_spans(["ro-e"])  # the rollout span; its steps share its trace
            assert len(client.query_spans(trace_id=root.trace_id)) == 301
        if retry.status_code == 200:
            assert service.pipeline.workers_restarted == 1
    finally:
        service.close()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _children(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_parse_workers_exit_with_the_store(tmp_path, how):
    from .test_cli_store import _free_port

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agl_core.cli", "store", "serve", "--db", str(tmp_path / "s.sqlite")]
        + ["--http-port", str(port), "--no-grpc", "--parse-workers", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url + "/healthz", proc)
        big = make_request("ro-w", 300).SerializeToString()
        assert (
            httpx.post(url + "/v1/traces", content=big, headers={"content-type": "application/x-protobuf"})
        ).status_code == 200
        children = _children(proc.pid)
        assert children, "the store started no parse worker"
        proc.send_signal(how)
        assert proc.wait(30) in (128 + how, -how)  # stopped by SIGTERM (143), or killed
        deadline = time.monotonic() + 15
        while (alive := [c for c in children if _running(c)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, f"parse workers left running after {how.name}: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


def test_a_legacy_non_finite_value_fails_its_rollout_instead_of_looping(tmp_path):
    """A rollout stored before non-finite numbers were refused: dequeue answers 409 once and marks it
    failed (no runner holds a claim it never received); the next dequeue does not pick it again."""
    from agl_core.records import RolloutStatus
    from agl_core.store import SqliteStore
    from agl_core.testing import Collector

    store = SqliteStore(tmp_path / "legacy.sqlite")
    try:
        (queued,) = store.enqueue_rollouts([{"task_id": "t", "input": {"x": 1}}])
        with store._write() as conn:  # what an older store let in
            conn.execute(
                "UPDATE rollouts SET input = ? WHERE rollout_id = ?", ['{"x": NaN}', queued.rollout_id]
            )
        with Collector(store) as server:
            first = _api(server.url, "/api/rollouts/dequeue", '{"worker_id": "w"}')
            assert first.status_code == 409 and "marked failed" in first.json()["error"]["message"]
            again = _api(server.url, "/api/rollouts/dequeue", '{"worker_id": "w"}')
            assert again.status_code == 204
        assert store.get_rollouts([queued.rollout_id])[0].status == RolloutStatus.FAILED
    finally:
        store.close()


def test_sqlite_checkpoints_beside_the_writer_and_stops_on_close(sqlite_store):
    from agl_core.store.formats.otlp import decode_protobuf, extract_rows

    for n in range(6):  # ~3 MB of spans: past SQLite's own checkpoint threshold (1000 pages)
        body = make_request(f"ro-ckpt-{n}", 500, first=1 + 500 * n, attrs=20).SerializeToString()
        batch = extract_rows(decode_protobuf(body), raw=body)
        assert sqlite_store.add_span_rows(batch.rows, batch.scopes) == 500
    thread = sqlite_store._checkpoints
    assert thread is not None and thread.is_alive()
    deadline = time.monotonic() + 10
    # the writer no longer checkpoints: the database file grows only by the checkpointer's copying
    while sqlite_store.path.stat().st_size < 2_000_000:
        assert time.monotonic() < deadline, "nothing was checkpointed into the database file"
        time.sleep(0.05)
    sqlite_store.close()
    assert not thread.is_alive()
    assert len(sqlite_store.path.read_bytes()) > 2_000_000
