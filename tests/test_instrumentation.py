"""The adapter contract in agl_core.instrumentation, without any framework."""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agl_core import semconv
from agl_core.instrumentation import (
    HookErrors,
    Instrumentor,
    OpenSpan,
    OpenSpans,
    Patches,
    read_usage,
    span_attributes,
    start_span,
    usage_attributes,
)
from agl_core.tracing import rollout_attributes, rollout_scope


def test_instrument_twice_installs_once_and_uninstrument_undoes_once() -> None:
    calls: list[str] = []
    instrumentor: Instrumentor[None] = Instrumentor(lambda installed: calls.append("uninstall"))
    assert not instrumentor.is_instrumented()
    for _ in range(2):
        instrumentor.instrument(lambda: calls.append("install"))
    assert instrumentor.is_instrumented() and calls == ["install"]
    instrumentor.uninstrument()
    instrumentor.uninstrument()
    assert not instrumentor.is_instrumented() and calls == ["install", "uninstall"]


def test_patches_restore_the_exact_originals_unless_wrapped_again() -> None:
    def original() -> str:
        return "original"

    owner = types.SimpleNamespace(f=original, g=original)
    patches = Patches()
    patches.replace(owner, "f", lambda: "agl")
    patches.replace(owner, "g", lambda: "agl")
    assert owner.f() == "agl"
    assert patches.restore() and owner.f is original and owner.g is original

    patches.replace(owner, "f", lambda: "agl")
    owner.f = other = lambda: "another instrumentor"
    assert not patches.restore() and owner.f is other


def test_a_failing_hook_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    errors = HookErrors("Demo")

    def boom() -> None:
        raise RuntimeError("boom")

    assert [errors.call("on_start", boom) for _ in range(3)] == [None] * 3
    assert errors.failed == {"on_start"}
    assert [r.getMessage() for r in caplog.records] == [
        "agl: Demo hook on_start failed; the agent continues untraced there"
    ]


def test_spans_carry_rollout_source_and_agent_and_nest_under_their_parent() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    runs: OpenSpans[str, OpenSpan] = OpenSpans()
    with rollout_scope("ro-1", "at-1", tracer_provider=provider):
        rollout = rollout_attributes()
        outer = start_span(tracer, "outer", source=semconv.SOURCE_USER, attributes={}, rollout=rollout)
        runs.add("a", OpenSpan(outer, rollout, "solver"))
        runs.add("b", OpenSpan(outer, rollout, "solver", folded=True))
        inner = start_span(
            tracer,
            "inner",
            source=semconv.SOURCE_USER,
            attributes={semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT},
            rollout=rollout,
            parent=runs.get("a"),
            agent="solver",
        )
        inner.end()
    assert runs.end("b") is None and "b" not in runs  # a folded run does not end its parent's span
    ended = runs.end("a")
    assert ended is not None and len(runs) == 0
    ended.span.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["inner"].parent is not None
    assert spans["inner"].parent.span_id == spans["outer"].context.span_id
    assert dict(spans["inner"].attributes or {}) == {
        semconv.ROLLOUT_ID: "ro-1",
        semconv.ATTEMPT_ID: "at-1",
        semconv.SOURCE: semconv.SOURCE_USER,
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.GEN_AI_AGENT_NAME: "solver",
    }


def test_span_attributes_keep_an_agent_name_the_adapter_gave() -> None:
    attrs = span_attributes(
        semconv.SOURCE_USER, {semconv.GEN_AI_AGENT_NAME: "own"}, rollout={}, agent="enclosing"
    )
    assert attrs == {semconv.SOURCE: semconv.SOURCE_USER, semconv.GEN_AI_AGENT_NAME: "own"}


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ({"input_tokens": 11, "output_tokens": 3}, (11, 3)),
        ({"prompt_tokens": 11, "completion_tokens": 3}, (11, 3)),
        (types.SimpleNamespace(prompt_tokens=5, completion_tokens=2), (5, 2)),
        ({"input_tokens": 7.0, "output_tokens": True}, (7, None)),
        ({"input_tokens": "11"}, (None, None)),
        (None, (None, None)),
    ],
)
def test_read_usage_takes_either_naming_and_only_whole_counts(usage: Any, expected: Any) -> None:
    assert read_usage(usage) == expected


def test_usage_attributes_leave_out_missing_counts() -> None:
    assert usage_attributes(11, None) == {semconv.GEN_AI_USAGE_INPUT_TOKENS: 11}
    assert usage_attributes(11, 3) == {
        semconv.GEN_AI_USAGE_INPUT_TOKENS: 11,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 3,
    }
