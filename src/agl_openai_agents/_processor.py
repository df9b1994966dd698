"""``AglTracingProcessor``: an Agents SDK trace processor that records the SDK's spans as OpenTelemetry
spans, and ``instrument()`` / ``uninstrument()`` that add it to (and remove it from) the SDK."""

from __future__ import annotations

import dataclasses
import logging
import threading
from contextvars import ContextVar, Token
from typing import Any

from agents.tracing import TracingProcessor
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, get_current_span

from agl_core import semconv
from agl_core._hooks import HookErrors
from agl_core.tracing import get_tracer, rollout_attributes

from . import _convert

__all__ = ["AglTracingProcessor", "instrument", "uninstrument"]

logger = logging.getLogger(__name__)


def _headers_override() -> ContextVar[dict[str, str] | None] | None:
    # The SDK's chat-completions model merges this context variable into the headers of each request it
    # sends (its own hook for per-call headers, also used by its LiteLLM / any-llm models). Putting the
    # W3C traceparent of the generation span there makes the gateway span a child of it: an exact join.
    # When a future SDK drops it, calls are still joined, by order within the rollout.
    try:
        from agents.models.chatcmpl_helpers import HEADERS_OVERRIDE
    except ImportError:
        return None
    return HEADERS_OVERRIDE


@dataclasses.dataclass(slots=True)
class _Open:
    """An SDK span or trace we are recording: its OTel span and what its children inherit."""

    span: trace.Span
    rollout: dict[str, str]
    agent: str | None
    #: Tool calls of the generations under this span that no function span has claimed yet (shared
    #: with the SDK spans folded into this one).
    tool_calls: list[_convert.ToolCall] = dataclasses.field(default_factory=list)
    headers_token: Token[dict[str, str] | None] | None = None
    #: An SDK bookkeeping span recorded as its parent's span (not ended by its own end).
    folded: bool = False


class AglTracingProcessor(TracingProcessor):
    """Records Agents SDK traces and spans as OpenTelemetry spans following the GenAI conventions.

    Agents become ``invoke_agent`` spans, generations / responses ``chat`` spans (with usage and, with
    ``capture_content=True``, the messages), function tools ``execute_tool`` spans with the tool call
    id and error status, handoffs and guardrails ``agl.handoff`` / ``agl.guardrail`` spans. The SDK's
    traces and its ``task`` and ``turn`` bookkeeping spans get no span of their own (what runs in them
    nests under their parent; an SDK trace's agents under the span current where the trace started,
    the rollout's). Every span carries the rollout identity of the context the SDK trace started in, and
    the agent name.
    """

    def __init__(
        self, *, tracer_provider: trace.TracerProvider | None = None, capture_content: bool = False
    ) -> None:
        self.capture_content = capture_content
        self._tracer = get_tracer(tracer_provider)
        # Each operation on it is a single dict operation (atomic under the GIL); an SDK span's start and
        # end never race, so no lock is needed across threads.
        self._open: dict[str, _Open] = {}
        self._headers = _headers_override()
        self.hook_errors = HookErrors("OpenAI Agents SDK")
        #: ``uninstrument()`` turns the processor off when it cannot take it out of the SDK.
        self.enabled = True

    def _start(
        self,
        key: str,
        parent_key: str | None,
        name: str,
        attrs: dict[str, Any],
        agent: str | None,
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> _Open:
        parent = self._open.get(parent_key) if parent_key else None
        if parent is not None:  # the rollout was read where the SDK trace started
            ctx, rollout, agent = (
                trace.set_span_in_context(parent.span),
                parent.rollout,
                agent or parent.agent,
            )
        else:
            ctx, rollout = otel_context.get_current(), rollout_attributes()
        attrs = {**attrs, **rollout, semconv.SOURCE: semconv.SOURCE_OPENAI_AGENTS}
        if agent and semconv.GEN_AI_AGENT_NAME not in attrs:
            attrs[semconv.GEN_AI_AGENT_NAME] = agent
        opened = _Open(
            self._tracer.start_span(name, context=ctx, kind=kind, attributes=attrs), rollout, agent
        )
        self._open[key] = opened
        return opened

    # --- traces --------------------------------------------------------------------------------------
    # Every hook catches its own errors inline (the SDK calls them several times per LLM call).
    def on_trace_start(self, trace: Any) -> None:
        try:
            # An SDK trace (one Runner.run, or the user's ``trace()`` block) gets no span: its agents nest
            # under the span current where it started, the rollout's or the user's own.
            if self.enabled:
                current = get_current_span()
                self._open[trace.trace_id] = _Open(current, rollout_attributes(), None, folded=True)
        except Exception:
            self.hook_errors.report("on_trace_start")

    def on_trace_end(self, trace: Any) -> None:
        try:
            self._open.pop(trace.trace_id, None)
        except Exception:
            self.hook_errors.report("on_trace_end")

    # --- spans ---------------------------------------------------------------------------------------
    def on_span_start(self, span: Any) -> None:
        try:
            if not self.enabled:
                return
            data = span.span_data
            parent_key = span.parent_id or span.trace_id
            if _convert.is_bookkeeping(data) and parent_key in self._open:
                parent = self._open[parent_key]
                agent = _convert.agent_name(data) or parent.agent
                self._open[span.span_id] = _Open(
                    parent.span, parent.rollout, agent, parent.tool_calls, folded=True
                )
                return
            name, attrs, agent, llm = _convert.start_info(data)
            opened = self._start(
                span.span_id, parent_key, name, attrs, agent, SpanKind.CLIENT if llm else SpanKind.INTERNAL
            )
            if llm and self._headers is not None:
                context = opened.span.get_span_context()
                traceparent = (
                    f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
                )
                opened.headers_token = self._headers.set(
                    {**(self._headers.get() or {}), semconv.HEADER_TRACEPARENT: traceparent}
                )
        except Exception:
            self.hook_errors.report("on_span_start")

    def on_span_end(self, span: Any) -> None:
        try:
            opened = self._open.pop(span.span_id, None)
            parent = self._open.get(span.parent_id or span.trace_id)
            if opened is None or opened.folded:
                return
            if opened.headers_token is not None and self._headers is not None:
                try:
                    self._headers.reset(opened.headers_token)
                except (
                    ValueError
                ):  # ended in another context than it started in; nothing of ours is left there
                    pass
            data = span.span_data
            kind = data.type
            otel_span = opened.span
            attrs = _convert.end_attributes(data, capture_content=self.capture_content)
            if kind == "generation" and parent is not None:
                parent.tool_calls.extend(_convert.tool_calls(data.output))
            elif kind == "function" and parent is not None:
                call_id = _convert.match_tool_call(data.name, data.input, parent.tool_calls)
                if call_id:
                    attrs[semconv.GEN_AI_TOOL_CALL_ID] = call_id
            elif kind == "handoff" and data.to_agent:
                otel_span.update_name(_convert.span_name(data))
            if attrs:
                otel_span.set_attributes(attrs)
            if (
                span.error
            ):  # success leaves the status UNSET, as OpenTelemetry asks of instrumentation libraries
                error_type, description = _convert.error_description(span.error)
                otel_span.set_attribute(semconv.ERROR_TYPE, error_type)
                otel_span.set_status(Status(StatusCode.ERROR, description))
            otel_span.end()
        except Exception:
            self.hook_errors.report("on_span_end")

    def shutdown(self) -> None:
        self.force_flush()

    def force_flush(self) -> None:
        """Spans go out through the OpenTelemetry tracer provider; flush that to export them."""


# --- instrument / uninstrument -----------------------------------------------------------------------
@dataclasses.dataclass
class _Installed:
    processor: AglTracingProcessor
    #: The SDK's processors before ``instrument(replace_processors=True)``; ``None`` when agl only added.
    replaced: tuple[Any, ...] | None


_installed: _Installed | None = None
_install_lock = threading.Lock()


def _sdk_processors() -> tuple[Any, ...] | None:
    # The SDK can add or replace processors but has no public way to list them; uninstrument() needs the
    # list to take agl's out and leave the user's. None when a future SDK keeps them elsewhere.
    from agents.tracing import get_trace_provider

    multi = getattr(get_trace_provider(), "_multi_processor", None)
    processors = getattr(multi, "_processors", None)
    return tuple(processors) if isinstance(processors, (tuple, list)) else None


def instrument(
    *,
    tracer_provider: trace.TracerProvider | None = None,
    capture_content: bool = False,
    replace_processors: bool = False,
) -> AglTracingProcessor:
    """Record the Agents SDK's traces as OpenTelemetry spans; returns the processor.

    Adds :class:`AglTracingProcessor` next to the processors already registered (the SDK's own exporter
    to the OpenAI dashboard included); ``replace_processors=True`` makes it the only one. Calling it
    again while instrumented returns the same processor and changes nothing.
    """
    global _installed
    from agents.tracing import add_trace_processor, set_trace_processors

    with _install_lock:
        if _installed is not None:
            return _installed.processor
        processor = AglTracingProcessor(tracer_provider=tracer_provider, capture_content=capture_content)
        replaced = None
        if replace_processors:
            replaced = _sdk_processors()
            if replaced is None:
                logger.warning(
                    "agl: cannot list the Agents SDK's trace processors; uninstrument() cannot restore them"
                )
                replaced = ()
            set_trace_processors([processor])
        else:
            add_trace_processor(processor)
        _installed = _Installed(processor, replaced)
        return processor


def uninstrument() -> None:
    """Take agl's processor out of the SDK; with ``replace_processors=True`` the previous ones come back."""
    global _installed
    from agents.tracing import set_trace_processors

    with _install_lock:
        if _installed is None:
            return
        installed, _installed = _installed, None
        installed.processor.enabled = False
        if installed.replaced is not None:
            set_trace_processors(list(installed.replaced))
            return
        current = _sdk_processors()
        if current is None:
            logger.warning(
                "agl: cannot list the Agents SDK's trace processors; agl's stays registered, switched off"
            )
            return
        set_trace_processors([p for p in current if p is not installed.processor])
