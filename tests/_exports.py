"""Spans sent through a real OpenTelemetry exporter, as an instrumented agent sends them."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from agl_core.tracing import rollout_scope


def export_steps(exporter: SpanExporter, rollout_id: str, steps: int, payload: str) -> None:
    """``steps`` spans (each with ``payload`` as an attribute) under rollout ``rollout_id``'s span, sent by
    a batch processor in exports of up to 400 spans; flushed (asserted) and shut down."""
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, max_export_batch_size=400))
    tracer = provider.get_tracer("t")
    with rollout_scope(rollout_id, tracer_provider=provider):
        for i in range(steps):
            with tracer.start_as_current_span(f"step-{i}", attributes={"payload": payload}):
                pass
    assert provider.force_flush(30_000)
    provider.shutdown()
