"""agl_core.otel.otlp_file.OtlpJsonLinesExporter: spans in the OTLP JSON lines agl import reads."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExportResult

from agl_core.importer import import_traces, session_rollout_id
from agl_core.otel.otlp_file import OtlpJsonLinesExporter
from agl_core.store import SqliteStore


def test_two_providers_in_threads_append_whole_lines_that_import_reads(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    providers = []
    for name in ("agent", "gateway"):
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        provider.add_span_processor(BatchSpanProcessor(OtlpJsonLinesExporter(path), max_export_batch_size=7))
        providers.append(provider)

    def work(provider: TracerProvider, worker: int) -> None:
        tracer = provider.get_tracer("test")
        for n in range(50):
            with tracer.start_as_current_span(
                f"call {n}", attributes={"session.id": f"s{worker}", "note": "é" * 300}
            ):
                pass

    threads = [threading.Thread(target=work, args=(p, w)) for w, p in enumerate(providers * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for provider in providers:
        provider.shutdown()
    lines = path.read_text(encoding="utf-8").splitlines()
    spans = [
        span
        for line in lines
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
    ]
    assert len(spans) == 200
    assert all(len(s["traceId"]) == 32 and len(s["spanId"]) == 16 for s in spans)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    store = SqliteStore(str(tmp_path / "store.sqlite"))
    try:
        summary = import_traces([path], store)
        assert (summary.spans, summary.problems) == (200, [])
        stored = store.query_spans(limit=1000)
    finally:
        store.close()
    assert {s.rollout_id for s in stored} == {session_rollout_id(f"s{w}") for w in range(4)}


def test_after_shutdown_exports_fail_and_write_nothing(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    exporter = OtlpJsonLinesExporter(path)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("one"):
        pass
    assert len(path.read_text().splitlines()) == 1
    exporter.shutdown()
    assert exporter.export([]) is SpanExportResult.FAILURE
    assert len(path.read_text().splitlines()) == 1


def test_an_unwritable_path_fails_the_export(tmp_path: Path) -> None:
    exporter = OtlpJsonLinesExporter(tmp_path / "missing-dir" / "spans.jsonl")
    provider = TracerProvider()
    results: list[SpanExportResult] = []

    class Recording(SimpleSpanProcessor):
        def on_end(self, span):  # type: ignore[no-untyped-def]
            results.append(exporter.export([span]))

    provider.add_span_processor(Recording(exporter))
    with provider.get_tracer("t").start_as_current_span("one"):
        pass
    assert results == [SpanExportResult.FAILURE]
