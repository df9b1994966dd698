"""The span spool: spans exported while the store is down reach it once it is back, batches are split by
bytes so one huge span cannot make the store refuse the others, and every drop is counted."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

from agl_core import semconv
from agl_core.gateway.capture import session_rollout_id
from agl_core.otel.spool import SpoolingSpanExporter, split_request
from agl_core.server import BackgroundServer
from agl_core.store import SqliteStore
from agl_core.store.base import NotFoundError
from agl_core.store.server import create_store_app
from agl_core.testing import Collector, GatewayServer, ScriptedBackend
from agl_core.tracing import make_otlp_exporter


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _StoreAt:
    """A store server on a fixed port and SQLite file, which can be stopped and started again."""

    def __init__(self, path: Path, port: int, token: str | None = None) -> None:
        self.path, self.port, self.token = path, port, token
        self.url = f"http://127.0.0.1:{port}"
        self._running: tuple[SqliteStore, object, BackgroundServer] | None = None

    def start(self) -> None:
        store = SqliteStore(self.path)
        app = create_store_app(store, token=self.token)
        server = BackgroundServer(app, port=self.port)
        server.start()
        self._running = (store, app, server)

    def stop(self) -> None:
        assert self._running is not None
        store, app, server = self._running
        server.stop()
        app.state.pipeline.close()  # type: ignore[attr-defined]
        store.close()
        self._running = None

    def span_names(self) -> list[str]:
        store = SqliteStore(self.path)
        try:
            return [s.name for s in store.query_spans()]
        finally:
            store.close()


def _provider(exporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_spans_exported_while_the_store_is_down_are_stored_when_it_comes_back(tmp_path):
    store = _StoreAt(tmp_path / "store.sqlite", _free_port())
    exporter = SpoolingSpanExporter(store.url + "/v1/traces", retry_s=0.05, max_retry_s=0.2)
    tracer = _provider(exporter).get_tracer("t")
    for i in range(30):  # nothing listens: every export fails to connect
        with tracer.start_as_current_span(f"down-{i}"):
            pass
    stats = exporter.stats()
    assert (stats.queued, stats.sent, stats.dropped) == (30, 0, {})
    time.sleep(0.5)
    assert exporter.stats().retries >= 2  # it kept trying
    store.start()
    try:
        assert exporter.force_flush(15_000)
        for i in range(5):  # the spool is empty again: sent directly
            with tracer.start_as_current_span(f"up-{i}"):
                pass
        stats = exporter.stats()
        assert (stats.queued, stats.queued_bytes, stats.sent, stats.dropped) == (0, 0, 35, {})
        names = store.span_names()
        assert sorted(names) == sorted([f"down-{i}" for i in range(30)] + [f"up-{i}" for i in range(5)])
    finally:
        exporter.shutdown()
        store.stop()


def test_one_huge_span_does_not_cost_the_spans_exported_beside_it(tmp_path):
    with Collector() as collector:
        exporter = make_otlp_exporter(collector.url)
        provider = TracerProvider()
        # one export of all 41 spans, as a batch processor would make it
        provider.add_span_processor(
            BatchSpanProcessor(exporter, max_export_batch_size=512, schedule_delay_millis=60_000)
        )
        tracer = provider.get_tracer("t")
        for i in range(40):
            with tracer.start_as_current_span(f"normal-{i}", attributes={"text": "x" * 2000}):
                pass
        for i in range(5):  # 5 x 7 MB: over the store's 32 MiB body limit together
            with tracer.start_as_current_span(f"huge-{i}", attributes={"prompt": "p" * 7_000_000}):
                pass
        provider.force_flush()
        names = [s.name for s in collector.spans()]
        assert sorted(names) == sorted([f"normal-{i}" for i in range(40)] + [f"huge-{i}" for i in range(5)])
        assert exporter.stats().dropped == {}  # type: ignore[attr-defined]
        provider.shutdown()


def test_a_span_over_the_request_limit_alone_is_dropped_counted_and_logged(caplog):
    with Collector() as collector:
        exporter = SpoolingSpanExporter(
            collector.otlp_endpoint, max_request_bytes=100_000, batch_bytes=10_000
        )
        tracer = _provider(exporter).get_tracer("t")
        with caplog.at_level(logging.ERROR, logger="agl_core.otel.spool"):
            with tracer.start_as_current_span("whole", attributes={"a": "y" * 50}):
                with tracer.start_as_current_span("too-big", attributes={"a": "z" * 200_000}):
                    pass
        assert [s.name for s in collector.spans()] == ["whole"]
        assert exporter.stats().dropped == {"span_too_large": 1}
        assert "over the 100000-byte request limit" in caplog.text
        exporter.shutdown()


def test_split_request_keeps_order_resources_and_a_byte_bound():
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "svc"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    for scope in ("a", "b"):
        tracer = provider.get_tracer(scope)
        for i in range(20):
            with tracer.start_as_current_span(f"{scope}{i}", attributes={"v": "q" * 1000}):
                pass
    request = encode_spans(memory.get_finished_spans())
    chunks, oversize = split_request(request, 5_000, 1_000_000)
    assert oversize == 0 and len(chunks) > 4
    names = []
    for chunk, count in chunks:
        assert chunk.ByteSize() <= 5_000 + 1_100  # one span may carry a chunk past the aim
        spans = [s for rs in chunk.resource_spans for ss in rs.scope_spans for s in ss.spans]
        assert len(spans) == count
        for rs in chunk.resource_spans:
            assert any(kv.value.string_value == "svc" for kv in rs.resource.attributes)
            for ss in rs.scope_spans:
                assert all(s.name.startswith(ss.scope.name) for s in ss.spans)
        names += [s.name for s in spans]
    assert names == [f"{scope}{i}" for scope in "ab" for i in range(20)]


def test_a_full_spool_drops_new_spans_and_counts_them(tmp_path, caplog):
    url = f"http://127.0.0.1:{_free_port()}/v1/traces"
    exporter = SpoolingSpanExporter(url, max_spool_bytes=3_000, retry_s=5.0, max_retry_s=5.0)
    tracer = _provider(exporter).get_tracer("t")
    with caplog.at_level(logging.ERROR, logger="agl_core.otel.spool"):
        for i in range(20):
            with tracer.start_as_current_span(f"s{i}", attributes={"v": "w" * 500}):
                pass
    stats = exporter.stats()
    assert stats.queued + stats.dropped["spool_full"] == 20
    assert 0 < stats.queued < 20 and stats.queued_bytes <= 3_000
    assert "the spool is full (3000 bytes" in caplog.text
    exporter.shutdown(0)


def test_a_spool_directory_keeps_spans_across_a_restart_of_the_exporter(tmp_path, caplog):
    store = _StoreAt(tmp_path / "store.sqlite", _free_port())
    spool = tmp_path / "spool"
    first = SpoolingSpanExporter(store.url + "/v1/traces", spool_dir=spool, retry_s=0.05, max_retry_s=0.1)
    tracer = _provider(first).get_tracer("t")
    for i in range(12):
        with tracer.start_as_current_span(f"kept-{i}"):
            pass
    with caplog.at_level(logging.WARNING, logger="agl_core.otel.spool"):
        first.shutdown(200)
    assert "12 span(s) the store has not acknowledged stay in" in caplog.text
    files = list(spool.glob("*.otlp"))
    assert len(files) == 12 and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    store.start()
    try:
        second = SpoolingSpanExporter(store.url + "/v1/traces", spool_dir=spool)
        assert second.stats().queued == 12
        assert second.force_flush(15_000)
        assert sorted(store.span_names()) == sorted(f"kept-{i}" for i in range(12))
        assert list(spool.glob("*.otlp")) == []
        second.shutdown()
    finally:
        store.stop()


def test_spans_the_store_refuses_for_good_are_dropped_with_its_answer(caplog):
    with Collector(token="right") as collector:
        exporter = SpoolingSpanExporter(collector.otlp_endpoint, token="wrong")
        tracer = _provider(exporter).get_tracer("t")
        with caplog.at_level(logging.ERROR, logger="agl_core.otel.spool"):
            with tracer.start_as_current_span("refused"):
                pass
        assert exporter.stats().dropped == {"refused_401": 1}
        assert "HTTP 401" in caplog.text
        assert collector.spans() == []
        exporter.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_spool_bytes": 0}, "max_spool_bytes must be at least 1"),
        ({"retry_s": 2.0, "max_retry_s": 1.0}, "max_retry_s at least retry_s"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpoolingSpanExporter("http://127.0.0.1:9/v1/traces", **kwargs)


# -- the gateway under steady captured traffic while the store is down ----------------------------------

MODEL = "prod-model"


def _gateway_process(store_url: str, upstream: str, port: int, extra: list[str]) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGL_", "OTEL_"))}
    argv = [sys.executable, "-m", "agl_core.cli", "gateway", "serve", "--backend", "openai"]
    argv += ["--upstream", upstream, "--upstream-model", MODEL, "--port", str(port), "--capture"]
    argv += ["--store-url", store_url, *extra]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "PYTHONUNBUFFERED": "1"}
    )


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_captured_calls_answered_while_the_store_is_down_are_all_stored_after(tmp_path):
    """The store stops for a minute (six times the OpenTelemetry exporter's 10 s deadline, after which it
    gave the spans up; the retry delay reaches its 30 s cap) under steady captured traffic: every call the
    gateway answered has its span stored once the store is back, counted exactly, and /metrics showed them
    queued meanwhile."""
    store = _StoreAt(tmp_path / "store.sqlite", _free_port())
    store.start()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with GatewayServer(ScriptedBackend(model_name=MODEL)) as upstream:
        process = _gateway_process(store.url, upstream.v1, port, [])
        try:
            _wait(lambda: _healthy(url, process), 30, "gateway did not start")
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            answered: dict[str, str] = {}  # response id -> session

            def call(session: str) -> None:
                response = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"hello from {session}"}],
                    extra_headers={semconv.HEADER_SESSION_ID: session},
                )
                answered[response.id] = session

            for i in range(5):
                call(f"before-{i}")
            store.stop()
            stop_at = time.monotonic() + 60
            i = 0
            while time.monotonic() < stop_at:
                call(f"down-{i}")
                i += 1
                time.sleep(0.1)
            queued = _metric(url, "agl_spans_queued")
            store.start()
            _wait(lambda: _metric(url, "agl_spans_queued") == 0, 90, "the spool did not empty")
            assert _metric(url, "agl_spans_dropped_total") == 0
            assert queued > 0
            stored = _stored_response_ids(store)
            assert set(answered) <= stored, f"{len(set(answered) - stored)} answered calls missing"
            assert len(answered) >= 5 + 60  # steady traffic really ran while the store was down
            wanted = {session_rollout_id(s) for s in answered.values()}
            _wait(lambda: wanted <= _registered_rollouts(store, wanted), 60, "sessions not registered")
        finally:
            process.send_signal(signal.SIGTERM)
            out, err = process.communicate(timeout=60)
            store.stop()
    assert process.returncode == 143, err


def _healthy(url: str, process: subprocess.Popen[str]) -> bool:
    assert process.poll() is None, process.communicate()
    try:
        return httpx.get(url + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def _stored_response_ids(store: _StoreAt) -> set[str]:
    sqlite = SqliteStore(store.path)
    try:
        return {
            str(s.attributes[semconv.GEN_AI_RESPONSE_ID])
            for s in sqlite.query_spans()
            if semconv.GEN_AI_RESPONSE_ID in s.attributes
        }
    finally:
        sqlite.close()


def _registered_rollouts(store: _StoreAt, ids: set[str]) -> set[str]:
    sqlite = SqliteStore(store.path)
    try:
        return {r.rollout_id for r in sqlite.get_rollouts(sorted(ids))}
    except NotFoundError:  # not all registered yet
        return set()
    finally:
        sqlite.close()


def test_the_gateway_records_a_huge_prompt_cut_short_and_the_other_calls_whole():
    """A huge prompt with n=5 puts it in five spans: recorded cut to the bound with a marker and the
    original size, and every span of it and of 40 normal calls beside it is stored. (60 KB here, over a
    16 KiB bound: the scripted backend's byte tokenizer makes a token id of every byte.)"""
    from agl_core.gateway.app import create_gateway_app

    with Collector() as collector:
        exporter = make_otlp_exporter(collector.url)
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=50))
        app = create_gateway_app(
            ScriptedBackend(model_name=MODEL),
            tracer_provider=provider,
            span_exporter=exporter,
            max_recorded_prompt_bytes=16 * 1024,
        )
        with BackgroundServer(app) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            errors: list[BaseException] = []

            def normal(i: int) -> None:
                try:
                    client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"q{i}"}]
                    )
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)

            threads = [threading.Thread(target=normal, args=(i,)) for i in range(40)]
            for t in threads[:20]:
                t.start()
            huge = client.chat.completions.create(
                model=MODEL, n=5, messages=[{"role": "user", "content": "é" * 30_000}]
            )
            for t in threads[20:]:
                t.start()
            for t in threads:
                t.join()
            assert not errors
            provider.force_flush()
            assert "agl_spans_sent_total" in httpx.get(server.url + "/metrics").text
        spans = collector.spans()
        big = [s for s in spans if s.attributes.get(semconv.GEN_AI_RESPONSE_ID) == huge.id]
        assert len(big) == 5
        for span in big:
            text = span.attributes[semconv.GEN_AI_INPUT_MESSAGES]
            assert len(text.encode()) < 16 * 1024 + 100
            assert "[cut by agl:" in text
            assert span.attributes[semconv.INPUT_MESSAGES_ORIGINAL_BYTES] > 60_000
        assert len(spans) == 45
        provider.shutdown()
