"""Rollout attribution of spans made by instrumentation that knows nothing of agl."""

from __future__ import annotations

import asyncio
import threading

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agl_core import semconv
from agl_core.tracing import RolloutSpanProcessor, rollout_scope


def _provider():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(RolloutSpanProcessor())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_foreign_spans_inside_a_rollout_get_its_identity_and_outside_stay_untouched():
    provider, exporter = _provider()
    foreign = provider.get_tracer("someone-else")
    with rollout_scope("ro-1", "at-1", "task-1", tracer_provider=provider):
        with foreign.start_as_current_span("foreign"):
            pass
        with foreign.start_as_current_span("own", attributes={semconv.ROLLOUT_ID: "explicit"}):
            pass
    with foreign.start_as_current_span("outside"):
        pass
    spans = {s.name: dict(s.attributes or {}) for s in exporter.get_finished_spans()}
    assert spans["foreign"] == {
        semconv.ROLLOUT_ID: "ro-1",
        semconv.ATTEMPT_ID: "at-1",
        semconv.TASK_ID: "task-1",
    }
    assert spans["own"][semconv.ROLLOUT_ID] == "explicit"
    assert spans["outside"] == {}


def test_a_span_started_outside_the_rollout_context_inherits_from_its_parent_span():
    provider, exporter = _provider()
    tracer = provider.get_tracer("framework")
    with rollout_scope("ro-2", tracer_provider=provider) as root:
        parent = trace.set_span_in_context(root)
    # e.g. a framework's worker thread that only got the parent span, not the context
    thread = threading.Thread(target=lambda: tracer.start_span("worker", context=parent).end())
    thread.start()
    thread.join()
    (worker,) = [s for s in exporter.get_finished_spans() if s.name == "worker"]
    assert worker.attributes[semconv.ROLLOUT_ID] == "ro-2"


def test_concurrent_asyncio_rollouts_keep_their_own_identity():
    provider, exporter = _provider()
    tracer = provider.get_tracer("framework")

    async def one(i):
        with rollout_scope(f"ro-{i}", tracer_provider=provider):
            for _ in range(3):
                with tracer.start_as_current_span(f"step-{i}"):
                    await asyncio.sleep(0)

    async def main():
        await asyncio.gather(*(one(i) for i in range(16)))

    asyncio.run(main())
    steps = [s for s in exporter.get_finished_spans() if s.name.startswith("step-")]
    assert len(steps) == 48
    assert all(s.attributes[semconv.ROLLOUT_ID] == "ro-" + s.name.split("-")[1] for s in steps)
