"""The adapters' lean spans (agl_core.otel.lean_spans): what processors and exporters receive is what the
SDK's own tracer would give them, and the SDK's tracer takes over wherever that could not be promised."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode

from agl_core import semconv
from agl_core.instrumentation import adapter_tracer
from agl_core.otel.lean_spans import LeanSpan, LeanTracer
from agl_core.tracing import RolloutSpanProcessor, context_rollout_attributes, rollout_scope


def _provider(*processors: SpanProcessor, **kwargs: Any) -> tuple[TracerProvider, InMemorySpanExporter]:
    provider = TracerProvider(**kwargs)
    for processor in processors:
        provider.add_span_processor(processor)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _record(tracer: trace.Tracer) -> None:
    """What an adapter does in one agent step with an LLM call and a failing tool."""
    step = tracer.start_span("invoke_agent solver", attributes={semconv.GEN_AI_AGENT_NAME: "solver"})
    inside = trace.set_span_in_context(step)
    call = tracer.start_span(
        "chat m", context=inside, kind=SpanKind.CLIENT, attributes={semconv.GEN_AI_REQUEST_MODEL: "m"}
    )
    call.set_attributes({semconv.GEN_AI_USAGE_INPUT_TOKENS: 12, semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 2})
    call.set_attribute(semconv.GEN_AI_RESPONSE_ID, "chatcmpl-1")
    call.update_name("chat m-2024")
    call.end()
    tool = tracer.start_span("execute_tool calc", context=inside, attributes={"agl.tool.args": ["1", "2"]})
    try:
        raise ValueError("division by zero")
    except ValueError as error:
        tool.record_exception(error)
        tool.set_status(Status(StatusCode.ERROR, "ValueError: division by zero"))
    tool.add_event("retry", {"attempt": 2})
    tool.end()
    step.set_status(StatusCode.OK)
    step.set_status(StatusCode.ERROR, "ignored: OK stays")
    step.end()


def _view(span: ReadableSpan, ids: dict[int, int]) -> dict[str, Any]:
    """A span as an exporter sees it, with ids replaced by their order of appearance."""

    def number(span_id: int | None) -> int | None:
        return None if span_id is None else ids.setdefault(span_id, len(ids))

    assert span.context is not None
    return {
        "name": span.name,
        "id": number(span.context.span_id),
        "parent": number(span.parent.span_id) if span.parent else None,
        "kind": span.kind,
        "flags": int(span.context.trace_flags),
        "attributes": dict(span.attributes or {}),
        "status": (span.status.status_code, span.status.description),
        "events": [
            (e.name, {k: v for k, v in (e.attributes or {}).items() if k != "exception.stacktrace"})
            for e in span.events
        ],
        "resource": dict(span.resource.attributes),
        "scope": span.instrumentation_scope,
        "ended": span.end_time is not None
        and span.start_time is not None
        and span.end_time >= span.start_time,
    }


def test_lean_spans_reach_processors_and_exporters_as_the_sdks_own() -> None:
    lean_provider, lean_exported = _provider(RolloutSpanProcessor())
    sdk_provider, sdk_exported = _provider(RolloutSpanProcessor())
    tracer = adapter_tracer(lean_provider)
    assert isinstance(tracer, LeanTracer)
    with rollout_scope("r-1", "a-1", tracer_provider=lean_provider):
        _record(tracer)
    with rollout_scope("r-1", "a-1", tracer_provider=sdk_provider):
        _record(sdk_provider.get_tracer("agl"))

    lean_spans, sdk_spans = lean_exported.get_finished_spans(), sdk_exported.get_finished_spans()
    assert [type(s) for s in lean_spans[:3]] == [ReadableSpan] * 3
    lean_ids: dict[int, int] = {}
    sdk_ids: dict[int, int] = {}
    assert [_view(s, lean_ids) for s in lean_spans] == [_view(s, sdk_ids) for s in sdk_spans]
    by_name: dict[str, Any] = {s.name: s for s in lean_spans}
    # the rollout processor stamped the rollout on spans started without it
    assert by_name["chat m-2024"].attributes[semconv.ROLLOUT_ID] == "r-1"
    assert by_name["execute_tool calc"].attributes["agl.tool.args"] == ("1", "2")  # a sequence: a tuple
    assert "Traceback" in by_name["execute_tool calc"].events[0].attributes["exception.stacktrace"]
    # one trace, under the rollout span
    assert len({span.context.trace_id for span in by_name.values()}) == 1
    # OTLP protobuf as the real exporter encodes it: the same but for ids and times
    lean_otlp, sdk_otlp = encode_spans(lean_spans), encode_spans(sdk_spans)
    for message in (lean_otlp, sdk_otlp):
        for resource_spans in message.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    for field in ("trace_id", "span_id", "parent_span_id"):
                        span.ClearField(field)
                    span.start_time_unix_nano = span.end_time_unix_nano = 0
                    for event in span.events:
                        event.time_unix_nano = 0
                        for attribute in event.attributes:
                            if attribute.key == "exception.stacktrace":
                                attribute.value.string_value = ""
    assert lean_otlp == sdk_otlp


def test_lean_spans_end_once_and_ignore_changes_after() -> None:
    provider, exported = _provider()
    tracer = adapter_tracer(provider)
    span = tracer.start_span("chat m")
    assert isinstance(span, LeanSpan) and span.is_recording()
    span.end()
    span.set_attribute("late", 1)
    span.set_attributes({"later": 2})
    span.set_status(StatusCode.ERROR)
    span.add_event("late")
    span.update_name("renamed")
    span.end()
    assert not span.is_recording()
    (only,) = exported.get_finished_spans()
    assert only.name == "chat m" and "late" not in (only.attributes or {})
    assert only.status.status_code is StatusCode.UNSET and not only.events


def test_attribute_values_are_cleaned_and_counted_as_the_sdk_does() -> None:
    ended = []
    for lean in (True, False):
        provider, exported = _provider(span_limits=SpanLimits(max_span_attributes=3))
        tracer = adapter_tracer(provider) if lean else provider.get_tracer("agl")
        assert isinstance(tracer, LeanTracer) is lean
        span = tracer.start_span("s", attributes={"a": "x", "b": 1})
        assert isinstance(span, LeanSpan) is lean
        # a mapping (refused by older SDKs, kept by newer ones), a list (kept as a tuple), an object
        span.set_attribute("c", {"k": "v"})
        span.set_attributes({"d": [1, 2], "e": object(), "f": True})  # type: ignore[dict-item]
        span.set_attribute("g", 2.5)
        span.end()
        (done,) = exported.get_finished_spans()
        ended.append((dict(done.attributes or {}), done.dropped_attributes))
    assert ended[0] == ended[1]
    attributes, dropped = ended[0]
    assert len(attributes) == 3 and attributes["g"] == 2.5 and dropped >= 4


def test_the_sampler_decides_as_it_would_for_the_sdk() -> None:
    provider, exported = _provider(sampler=ALWAYS_OFF)
    tracer = adapter_tracer(provider)
    span = tracer.start_span("dropped")
    assert not span.is_recording() and not span.get_span_context().trace_flags.sampled
    span.end()

    provider, exported = _provider(sampler=ParentBased(TraceIdRatioBased(1.0)))
    tracer = adapter_tracer(provider)
    kept = tracer.start_span("kept")
    assert isinstance(kept, LeanSpan) and kept.get_span_context().trace_flags.sampled
    child = tracer.start_span("child", context=trace.set_span_in_context(kept))
    child.end()
    kept.end()
    assert [s.name for s in exported.get_finished_spans()] == ["child", "kept"]

    # the default sampler under a parent that was not sampled: not recorded, its flags passed on
    provider, exported = _provider()
    tracer = adapter_tracer(provider)
    unsampled = trace.NonRecordingSpan(
        trace.SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=trace.TraceFlags(0))
    )
    span = tracer.start_span("under an unsampled parent", context=trace.set_span_in_context(unsampled))
    assert not span.is_recording()
    assert span.get_span_context().trace_id == 0xABC
    span.end()
    assert exported.get_finished_spans() == ()


class _Reads(SpanProcessor):
    """A processor that reads the live SDK span when it starts."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_start(self, span: Any, parent_context: otel_context.Context | None = None) -> None:
        self.seen.append(span)


def test_a_processor_that_reads_live_spans_gets_the_sdks_spans() -> None:
    provider, exported = _provider(RolloutSpanProcessor())
    tracer = adapter_tracer(provider)
    first = tracer.start_span("before")
    assert isinstance(first, LeanSpan)
    reads = _Reads()
    provider.add_span_processor(reads)  # added later: looked at again at the next span
    second = tracer.start_span("after")
    assert isinstance(second, SdkSpan) and reads.seen == [second]
    second.end()
    first.end()  # started lean, it still ends for every processor
    assert [s.name for s in exported.get_finished_spans()] == ["after", "before"]


@pytest.mark.parametrize(
    "make",
    [
        lambda: TracerProvider(span_limits=SpanLimits(max_span_attribute_length=10)),
        lambda: trace.NoOpTracerProvider(),
    ],
    ids=["value-length-limit", "not-the-sdk"],
)
def test_the_sdks_tracer_is_kept_where_lean_spans_could_differ(make: Callable[[], Any]) -> None:
    provider = make()
    tracer = adapter_tracer(provider)
    assert not isinstance(tracer, LeanTracer)
    assert type(tracer) is type(provider.get_tracer("agl"))


def test_a_lean_span_carries_the_rollout_to_code_run_outside_its_context() -> None:
    provider, _ = _provider(RolloutSpanProcessor(), BatchSpanProcessor(InMemorySpanExporter()))
    tracer = adapter_tracer(provider)
    with rollout_scope("r-9", "a-9", task_id="t-9", tracer_provider=provider):
        step = tracer.start_span("step", attributes={semconv.ROLLOUT_ID: "r-9", semconv.ATTEMPT_ID: "a-9"})
    # a framework running a callback in a context of its own, with only the span in it
    detached = trace.set_span_in_context(step, otel_context.Context())
    assert context_rollout_attributes(detached) == {semconv.ROLLOUT_ID: "r-9", semconv.ATTEMPT_ID: "a-9"}
    step.end()
    provider.shutdown()


def test_an_adapter_tracer_taken_before_the_global_provider_is_set_records_lean_after() -> None:
    # The global provider can be set once per process: a process of its own.
    script = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from agl_core.otel.lean_spans import LeanSpan
from agl_core.instrumentation import adapter_tracer

tracer = adapter_tracer()  # what instrument() does at import time, before tracing is set up
before = tracer.start_span("before")
before.end()
exported = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exported))
trace.set_tracer_provider(provider)
after = tracer.start_span("after")
assert isinstance(after, LeanSpan), type(after)
after.end()
assert [s.name for s in exported.get_finished_spans()] == ["after"]
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_lean_span_made_current_ends_and_records_what_escapes() -> None:
    provider, exported = _provider()
    tracer = adapter_tracer(provider)
    with pytest.raises(KeyError), tracer.start_as_current_span("step", attributes={"a": 1}) as step:
        assert isinstance(step, LeanSpan) and trace.get_current_span() is step
        with tracer.start_as_current_span("inner", end_on_exit=False) as inner:
            assert inner.get_span_context().trace_id == step.get_span_context().trace_id
        assert inner.is_recording()  # left open
        raise KeyError("missing")
    inner.end()
    step_done, inner_done = exported.get_finished_spans()  # in the order they ended
    assert inner_done.parent is not None and inner_done.parent.span_id == step.get_span_context().span_id
    assert step_done.status.status_code is StatusCode.ERROR
    assert [e.name for e in step_done.events] == ["exception"]
    assert trace.get_current_span() is not step
