"""Redaction audit: a marker in every field of the OTLP data model and of the API, then the database
files (main, WAL, shared memory) are searched byte for byte after a clean stop. A visible marker in the
same requests proves the search would have found them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psycopg
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from agl_core import semconv
from agl_core.records import RolloutStatus
from agl_core.store import SqliteStore, StoreClient
from agl_core.store.redact import parse_rules
from agl_core.store.service import StoreService
from tests._servers import wait_healthy

from .conftest import POSTGRES_DSN

SECRET = "SECRET-7f3a9c"  # masked by the regex rule wherever it is
KEYED = "KEYED-51be0d"  # only ever under a key the key rule drops
VISIBLE = "VISIBLE-c0ffee"  # under no rule: must be found (the search works)
RULES = ["regex:SECRET-[0-9a-f]{6}", "key:drop.*"]


def _set(value: AnyValue, text: str, depth: int = 0) -> None:
    """``text`` as a string, nested ``depth`` levels deep in alternating arrays and key-value lists."""
    if depth == 0:
        value.string_value = text
    elif depth % 2:
        _set(value.array_value.values.add(), text, depth - 1)
    else:
        _set(value.kvlist_value.values.add(key="k").value, text, depth - 1)


def _fill(attributes, tag: str) -> None:
    attributes.add(key=f"{tag}.plain").value.string_value = f"{tag} {SECRET} {VISIBLE}"
    attributes.add(key=f"{tag}.bytes").value.bytes_value = f"raw {SECRET}".encode()
    _set(attributes.add(key=f"{tag}.nested").value, f"n {SECRET}", 5)
    _set(attributes.add(key=f"{tag}.deep").value, f"deep {SECRET}", 20)  # past the checked depth
    attributes.add(key="drop.me").value.string_value = KEYED
    inner = attributes.add(key=f"{tag}.kv").value.kvlist_value.values
    inner.add(key="drop.inner").value.string_value = KEYED  # a key rule inside a key-value list
    inner.add(key="ok").value.string_value = VISIBLE


def _request(rollout_id: str, first: int, start_ns: int) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    _fill(rs.resource.attributes, "resource")
    ss = rs.scope_spans.add()
    ss.scope.name = f"scope {SECRET}"
    ss.scope.version = f"v {SECRET}"
    _fill(ss.scope.attributes, "scope")
    for i in range(first, first + 3):
        span = ss.spans.add(
            trace_id=i.to_bytes(16, "big"),
            span_id=i.to_bytes(8, "big"),
            name=f"span {SECRET}",
            trace_state=f"k={SECRET}",
            start_time_unix_nano=start_ns,
            end_time_unix_nano=start_ns + 1000,
        )
        span.attributes.add(key=semconv.ROLLOUT_ID).value.string_value = rollout_id
        _fill(span.attributes, "span")
        event = span.events.add(name=f"event {SECRET}", time_unix_nano=start_ns)
        _fill(event.attributes, "event")
        link = span.links.add(trace_id=(i + 1000).to_bytes(16, "big"), span_id=(i + 1000).to_bytes(8, "big"))
        link.trace_state = f"l={SECRET}"
        _fill(link.attributes, "link")
        span.status.code = 2
        span.status.message = f"failed: {SECRET}"
    return request


def _deep(depth: int) -> object:
    value: object = f"deep {SECRET}"
    for _ in range(depth):
        value = [value]
    return value


def _exercise(url: str) -> None:
    """Send the markers through OTLP/HTTP (protobuf and JSON) and every API field that is stored."""
    body = _request("ro-audit", 1, time.time_ns()).SerializeToString()
    r = httpx.post(url + "/v1/traces", content=body, headers={"content-type": "application/x-protobuf"})
    assert r.status_code == 200, r.text
    with StoreClient(url) as client:
        value = {"q": f"{SECRET} {VISIBLE}", "drop.me": KEYED, SECRET: "key", "deep": _deep(20)}
        client.enqueue_rollouts(
            [
                {
                    "task_id": "t1",
                    "rollout_id": "ro-audit",
                    "input": value,
                    "metadata": {"note": SECRET, **value},
                }
            ]
        )
        client.put_resource("policy", value)
        claimed = client.dequeue_rollout("w1")
        assert claimed is not None
        client.complete_attempt(claimed[1].attempt_id, RolloutStatus.FAILED, error=f"boom {SECRET}")
        stored = client.get_rollouts(["ro-audit"])[0]
        assert SECRET not in json.dumps(stored.input) and KEYED not in json.dumps(stored.metadata)
        assert VISIBLE in json.dumps(stored.input)


def _files(db: Path) -> bytes:
    return b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))


def test_no_marker_reaches_the_sqlite_files(tmp_path):
    db = tmp_path / "audit.sqlite"
    store = SqliteStore(db)
    service = StoreService(store, redactor=parse_rules(RULES), parse_workers=0)
    url = service.start_http_background()
    try:
        _exercise(url)
    finally:
        service.close()
        store.close()
    data = _files(db)
    assert VISIBLE.encode() in data  # the search finds what is there
    assert SECRET.encode() not in data
    assert KEYED.encode() not in data


def test_no_marker_reaches_postgres():
    import uuid

    from agl_core.store.postgres import PostgresStore

    schema = f"agl_audit_{uuid.uuid4().hex[:10]}"
    store = PostgresStore(POSTGRES_DSN, schema=schema)
    service = StoreService(store, redactor=parse_rules(RULES), parse_workers=0)
    url = service.start_http_background()
    try:
        _exercise(url)
    finally:
        service.close()
        store.close()
    try:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            tables = [
                row[0]
                for row in conn.execute(
                    "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", [schema]
                )
            ]
            assert {"spans", "rollouts", "attempts", "resources"} <= set(tables)
            dump = b""
            for table in tables:
                for row in conn.execute(f'SELECT * FROM "{schema}"."{table}"'):
                    for cell in row:
                        dump += bytes(cell) if isinstance(cell, bytes | memoryview) else str(cell).encode()
    finally:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    assert VISIBLE.encode() in dump
    assert SECRET.encode() not in dump
    assert KEYED.encode() not in dump


def _old_spans() -> bytes:
    old = time.time_ns() - 3 * 86_400 * 10**9
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for i in range(1, 200):
        span = scope.spans.add(
            trace_id=i.to_bytes(16, "big"),
            span_id=i.to_bytes(8, "big"),
            name="old",
            start_time_unix_nano=old,
            end_time_unix_nano=old + 1,
        )
        span.attributes.add(key="payload").value.string_value = f"OLDSPAN-{i:04d} " + "x" * 200
    return request.SerializeToString()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_spans_deleted_by_retention_leave_the_files_of_a_stopped_store(tmp_path, stop):
    """``agl store serve --retention 1d`` as a user runs it: spans older than a day are deleted by the
    store's maintenance, then a clean stop; no byte of them is left in the database, WAL or -shm file."""
    from .test_cli_store import _free_port

    db = tmp_path / "retention.sqlite"
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agl_core.cli", "store", "serve", "--db", str(db), "--http-port", str(port)]
        + ["--no-grpc", "--retention", "1d"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url + "/healthz", proc)
        r = httpx.post(
            url + "/v1/traces", content=_old_spans(), headers={"content-type": "application/x-protobuf"}
        )
        assert r.status_code == 200
        assert b"OLDSPAN-0001" in _files(db)  # on disk before retention runs
        deadline = time.monotonic() + 30  # maintenance runs every 5 s
        while httpx.get(url + "/api/stats").json()["spans"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert httpx.get(url + "/api/stats").json()["spans"] == 0
        proc.send_signal(stop)
        assert proc.wait(30) == 128 + stop  # stopped cleanly, by that signal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"OLDSPAN-" not in _files(db)
