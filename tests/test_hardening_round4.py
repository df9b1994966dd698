"""Round four of hostile input: one bad value in a span, a request or a reward never takes reads down,
never steers a decision, and every stored span's rollout is listed. Store tests run on SQLite and
PostgreSQL."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from agl_core import semconv
from agl_core.store import RolloutFilter
from agl_core.store._loose import LooseSpans
from agl_core.store.formats.otlp import UNREADABLE_SPAN, row_to_span
from tests.conftest import make_span


def _otlp(rollout: str, n: int, value: float) -> bytes:
    request = ExportTraceServiceRequest()
    span = (
        request.resource_spans.add()
        .scope_spans.add()
        .spans.add(
            trace_id=bytes([n]) * 16,
            span_id=bytes([n]) * 8,
            name="step",
            start_time_unix_nano=1,
            end_time_unix_nano=2,
        )
    )
    span.attributes.add(key=semconv.ROLLOUT_ID).value.string_value = rollout
    span.attributes.add(key="score").value.double_value = value
    inner = span.attributes.add(key="deep").value.array_value.values.add()
    inner.kvlist_value.values.add(key="x").value.double_value = value
    span.events.add(name="e", time_unix_nano=1).attributes.add(key="v").value.double_value = value
    return request.SerializeToString()


# --- 1. non-finite numbers in spans -----------------------------------------------------------------------
def test_non_finite_numbers_in_spans_never_fail_a_read(store_server, client):
    for n, value in enumerate([math.nan, math.inf, -math.inf, 1.5], start=1):
        r = httpx.post(
            store_server.url + "/v1/traces",
            content=_otlp(f"ro-{n}", n, value),
            headers={"content-type": "application/x-protobuf"},
        )
        assert r.status_code == 200
    page = httpx.post(store_server.url + "/api/spans/query", json={})
    assert page.status_code == 200, page.text
    scores = {s["attributes"][semconv.ROLLOUT_ID]: s["attributes"]["score"] for s in page.json()["spans"]}
    assert scores == {"ro-1": "NaN", "ro-2": "Infinity", "ro-3": "-Infinity", "ro-4": 1.5}
    (spans_2,) = [s for s in client.query_spans() if s.rollout_id == "ro-2"]
    assert spans_2.attributes["deep"] == [{"x": "Infinity"}]
    assert spans_2.events[0]["attributes"] == {"v": "Infinity"}
    # the Python API's spans read back the same way
    store_server.store.add_spans([make_span("py", {semconv.ROLLOUT_ID: "ro-py", "v": math.nan})])
    assert client.query_spans(rollout_ids=["ro-py"])[0].attributes["v"] == "NaN"


def test_a_damaged_span_body_reads_back_as_a_placeholder():
    span = row_to_span(7, b"\xff\xff\xff", {})
    assert span.name == UNREADABLE_SPAN and span.seq == 7 and "could not be decoded" in span.status_message


# --- 2. lone surrogates ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path", "body", "where"),
    [
        ("PUT", "/api/resources/p", '{"value": {"a": ["ok", "x\\ud800"]}}', "value.a.1"),
        (
            "POST",
            "/api/rollouts",
            '{"rollouts": [{"task_id": "t", "input": "a\\udfff"}]}',
            "rollouts.0.input",
        ),
        ("POST", "/api/rollouts", '{"rollouts": [{"task_id": "t", "metadata": {"k\\ud800": 1}}]}', "a key"),
    ],
)
def test_a_lone_surrogate_is_a_400_that_says_where(store_server, client, method, path, body, where):
    r = httpx.request(
        method, store_server.url + path, content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert where in message and "surrogate" in message
    assert client.stats()["rollouts"] == 0 and client.get_resource("p") is None


def test_a_surrogate_pair_is_text_and_is_kept(store_server, client):
    r = httpx.put(
        store_server.url + "/api/resources/p",
        content='{"value": "\\ud83d\\ude00"}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200 and client.get_resource("p").value == "\N{GRINNING FACE}"


def test_a_lone_surrogate_in_otlp_json_is_a_400(store_server):
    span = {"traceId": "03" * 16, "spanId": "04" * 8, "name": "y\ud800", "startTimeUnixNano": "1"}
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]})
    r = httpx.post(
        store_server.url + "/v1/traces", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400


def test_library_callers_get_a_value_error_for_a_lone_surrogate(store):
    with pytest.raises(ValueError, match=r"input\.k holds a lone UTF-16 surrogate"):
        store.enqueue_rollouts([{"task_id": "t", "input": {"k": "\udc00"}}])
    assert store.stats()["rollouts"] == 0


# --- 3. spans stored before the first grouping pass ----------------------------------------------------
def test_rollouts_named_by_spans_stored_before_the_first_pass_are_listed(store):
    backlog = [make_span("step", {semconv.ROLLOUT_ID: f"early-{n}"}) for n in range(3)]
    store.add_spans(backlog)  # an exporter's backlog, stored before the store's first maintenance pass
    store.group_loose_spans(LooseSpans(quiet_s=10), now=100)
    listed = {r.rollout_id for r in store.list_rollouts(limit=50).rollouts}
    assert listed == {"early-0", "early-1", "early-2"}


def test_a_restarted_store_lists_rollouts_its_last_run_missed(store):
    store.add_spans([make_span("step", {semconv.ROLLOUT_ID: "missed"})])
    loose = LooseSpans(quiet_s=10)
    loose.after_seq = store.stats()["spans"]  # what the old code left: the span was passed over
    store.group_loose_spans(loose, now=100)
    assert store.stats()["rollouts"] == 0
    store.group_loose_spans(LooseSpans(quiet_s=10), now=200)  # a restart: a new pass state
    assert [r.rollout_id for r in store.list_rollouts().rollouts] == ["missed"]


# --- 4. search matches text, not encoding bytes ----------------------------------------------------------
def test_search_matches_the_text_users_see_not_the_encoding(store):
    n = 1200
    spans = []
    for i in range(n):
        store.enqueue_rollouts([{"task_id": "t", "rollout_id": f"r{i:05d}"}])
        attrs = {
            semconv.ROLLOUT_ID: f"r{i:05d}",
            "gen_ai.input.messages": json.dumps([{"role": "user", "content": f"question {i}"}]),
            "n": i,
        }
        if i == 77:
            attrs["note"] = 'costs 5% of "it"\\n\nok'
        spans.append(make_span(f"call {i}", attrs, start=37 * i + 1))
    store.add_spans(spans)
    for text in ["%", '"it"', "\\", "\n"]:
        page = store.list_rollouts(RolloutFilter(text=text), limit=50)
        assert [r.rollout_id for r in page.rollouts] == ["r00077"], text
        assert page.total == 1
    # keys, names, message contents inside JSON values and paging over the verified matches
    assert store.list_rollouts(RolloutFilter(text="note")).total == 1
    assert store.list_rollouts(RolloutFilter(text="question 1199")).rollouts[0].rollout_id == "r01199"
    first = store.list_rollouts(RolloutFilter(text="call 11"), limit=5)
    assert first.total == 111 and len(first.rollouts) == 5 and first.before is not None
    second = store.list_rollouts(RolloutFilter(text="call 11"), before=first.before, limit=5)
    assert [r.rollout_id for r in second.rollouts] == [f"r{i:05d}" for i in (1194, 1193, 1192, 1191, 1190)]


# --- 5. a PostgreSQL password never shows ---------------------------------------------------------------
def test_store_serve_never_prints_a_postgres_password():
    import signal
    import subprocess
    import sys
    import uuid

    from tests._servers import wait_healthy
    from tests.conftest import POSTGRES_DSN
    from tests.test_cli_store import _free_port

    secret = f"pw{uuid.uuid4().hex[:8]}"
    # trust auth ignores the password; the URL still carries one, as a user's would
    db = POSTGRES_DSN.replace("://postgres@", f"://postgres:{secret}@")
    port = _free_port()
    cmd = [sys.executable, "-m", "agl_core.cli", "store", "serve", "--http-port", str(port), "--no-grpc"]
    proc = subprocess.Popen(
        [*cmd, "--db", db, "--parse-workers", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "postgres:***@" in out and "postgres:***@" in err
    unreachable = subprocess.run(
        [*cmd, "--db", f"postgresql://u:{secret}@127.0.0.1:1/db?password={secret}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unreachable.returncode == 2 and "u:***@127.0.0.1:1" in unreachable.stderr
    for text in (out, err, unreachable.stdout, unreachable.stderr):
        assert secret not in text


def test_masked_url_masks_the_password_forms():
    from agl_core.settings import masked_url

    assert masked_url("postgresql://u:p@h:5/db") == "postgresql://u:***@h:5/db"
    assert (
        masked_url("x postgresql://u@h/db?sslmode=a&password=p y")
        == "x postgresql://u@h/db?sslmode=a&password=*** y"
    )
    assert masked_url("runs/a.sqlite") == "runs/a.sqlite"
