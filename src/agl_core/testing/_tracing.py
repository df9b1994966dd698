"""Tracer providers for tests: one exporting over real OTLP/HTTP, one keeping spans in memory."""

from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ..tracing import RolloutSpanProcessor, make_otlp_exporter

__all__ = ["InMemoryTracing", "otlp_tracer_provider"]


def otlp_tracer_provider(
    endpoint: str, *, batch: bool = False, rollout_spans: bool = True, token: str | None = None
) -> TracerProvider:
    """A new SDK tracer provider exporting to ``endpoint`` (a store URL) with the real OTLP/HTTP exporter.

    ``batch=False`` exports each span as it ends (the store has it when the span's ``end()`` returns);
    ``batch=True`` uses a :class:`BatchSpanProcessor` (50 ms delay), as production does: call
    ``force_flush()`` before reading spans back. ``rollout_spans`` adds a :class:`RolloutSpanProcessor`,
    as :func:`agl_core.setup_tracing` does. The caller shuts the provider down.
    """
    provider = TracerProvider()
    if rollout_spans:
        provider.add_span_processor(RolloutSpanProcessor())
    exporter = make_otlp_exporter(endpoint, token=token)
    provider.add_span_processor(
        BatchSpanProcessor(exporter, schedule_delay_millis=50) if batch else SimpleSpanProcessor(exporter)
    )
    return provider


class InMemoryTracing:
    """An SDK tracer provider keeping finished spans in memory, for unit tests that need no server.

    ``provider`` goes wherever instrumentation takes one; :meth:`spans` reads back what ended, in order
    of ending. ``rollout_spans`` adds a :class:`RolloutSpanProcessor` first.
    """

    def __init__(self, *, rollout_spans: bool = False) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        if rollout_spans:
            self.provider.add_span_processor(RolloutSpanProcessor())
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        """The finished spans (only those called ``name`` when given)."""
        finished = self.exporter.get_finished_spans()
        return [s for s in finished if name is None or s.name == name]

    def clear(self) -> None:
        """Forget the spans recorded so far."""
        self.exporter.clear()

    def shutdown(self) -> None:
        self.provider.shutdown()

    def __enter__(self) -> InMemoryTracing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
