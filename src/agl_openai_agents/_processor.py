"""``AglTracingProcessor``: an Agents SDK trace processor that records the SDK's spans as OpenTelemetry
spans, and ``instrument()`` / ``uninstrument()`` that add it to (and remove it from) the SDK."""

from __future__ import annotations

import dataclasses
import logging
from contextvars import ContextVar, Token
from typing import Any

from agents.tracing import TracingProcessor
from opentelemetry import trace
from opentelemetry.trace import SpanKind, get_current_span

from agl_core import semconv
from agl_core.capture import agent_header
from agl_core.instrumentation import (
    HookErrors,
    Instrumentor,
    OpenSpan,
    OpenSpans,
    adapter_tracer,
    mark_span_failed,
    start_span,
)
from agl_core.tracing import rollout_attributes

from . import _convert

__all__ = ["AglTracingProcessor", "instrument", "is_instrumented", "uninstrument"]

logger = logging.getLogger(__name__)


_Headers = ContextVar[dict[str, str] | None]


def _headers_overrides() -> dict[str, _Headers]:
    """The SDK's context variables of extra request headers, by the type of LLM span its model opens."""
    # The SDK's chat-completions model merges HEADERS_OVERRIDE into the headers of each request it sends
    # (its own hook for per-call headers, also used by its LiteLLM / any-llm models); its Responses model
    # does the same with a private variable of its module. Putting the W3C traceparent of the generation /
    # response span there makes the gateway span a child of it: an exact join, also when the SDK leaves
    # the response id out of its span (trace_include_sensitive_data off). When a future SDK drops them,
    # calls are still joined: by response id, else by order within the rollout.
    found: dict[str, _Headers] = {}
    try:
        from agents.models.chatcmpl_helpers import HEADERS_OVERRIDE

        found["generation"] = HEADERS_OVERRIDE
    except ImportError:
        pass
    try:
        from agents.models.openai_responses import _HEADERS_OVERRIDE

        found["response"] = _HEADERS_OVERRIDE
    except ImportError:
        pass
    return found


@dataclasses.dataclass(slots=True)
class _Open(OpenSpan):
    """An SDK span or trace we are recording (an SDK trace, and the SDK's bookkeeping spans, folded into
    the span they start under)."""

    #: Tool calls of the generations under this span that no function span has claimed yet (shared
    #: with the SDK spans folded into this one).
    tool_calls: list[_convert.ToolCall] = dataclasses.field(default_factory=list)
    headers_token: Token[dict[str, str] | None] | None = None
    headers: _Headers | None = None
    #: The calling agent set for an LLM span's requests (put back when the span ends).
    agent_token: Token[str | None] | None = None


class AglTracingProcessor(TracingProcessor):
    """Records Agents SDK traces and spans as OpenTelemetry spans following the GenAI conventions.

    Agents become ``invoke_agent`` spans, generations / responses ``chat`` spans (with usage and, with
    ``capture_content=True``, the messages), function tools ``execute_tool`` spans with the tool call
    id and error status, handoffs and guardrails ``agl.handoff`` / ``agl.guardrail`` spans. The SDK's
    traces and its ``task`` and ``turn`` bookkeeping spans get no span of their own (what runs in them
    nests under their parent; an SDK trace's agents under the span current where the trace started,
    the rollout's). Every span carries the rollout identity of the context the SDK trace started in, and
    the agent name.

    The model's requests to an agl gateway (the runner's, or one in ``AGL_GATEWAY_URLS``) carry the
    calling agent's name in ``x-agl-agent-name`` (:mod:`agl_core.capture.agent_header`): the SDK starts a
    generation / response span in the task that then sends the model request, inside the span's ``with``
    block, so the name set when the span starts is in effect for that request, and is put back when the
    span ends. With the SDK's tracing disabled (``set_tracing_disabled(True)``, ``RunConfig(
    tracing_disabled=True)``) no processor is called and no name is sent; ``base_url`` of
    ``llm.for_agent(name)`` names an agent then.
    """

    def __init__(
        self, *, tracer_provider: trace.TracerProvider | None = None, capture_content: bool = False
    ) -> None:
        self.capture_content = capture_content
        self._tracer = adapter_tracer(tracer_provider)
        self._open: OpenSpans[str, _Open] = OpenSpans()
        self._headers = _headers_overrides()
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
        parent = self._open.get(parent_key)
        if parent is not None:  # the rollout was read where the SDK trace started
            rollout, agent = parent.rollout, agent or parent.agent
        else:
            rollout = rollout_attributes()
        span = start_span(
            self._tracer,
            name,
            source=semconv.SOURCE_OPENAI_AGENTS,
            attributes=attrs,
            rollout=rollout,
            parent=parent,
            agent=agent,
            kind=kind,
        )
        return self._open.add(key, _Open(span, rollout, agent))

    # --- traces --------------------------------------------------------------------------------------
    # Every hook catches its own errors inline (the SDK calls them several times per LLM call).
    def on_trace_start(self, trace: Any) -> None:
        try:
            # An SDK trace (one Runner.run, or the user's ``trace()`` block) gets no span: its agents nest
            # under the span current where it started, the rollout's or the user's own.
            if self.enabled:
                current = get_current_span()
                self._open.add(trace.trace_id, _Open(current, rollout_attributes(), None, folded=True))
        except Exception:
            self.hook_errors.report("on_trace_start")

    def on_trace_end(self, trace: Any) -> None:
        try:
            self._open.pop(trace.trace_id)
        except Exception:
            self.hook_errors.report("on_trace_end")

    # --- spans ---------------------------------------------------------------------------------------
    def on_span_start(self, span: Any) -> None:
        try:
            if not self.enabled:
                return
            data = span.span_data
            parent_key = span.parent_id or span.trace_id
            parent = self._open.get(parent_key)
            if _convert.is_bookkeeping(data) and parent is not None:
                agent = _convert.agent_name(data) or parent.agent
                self._open.add(
                    span.span_id, _Open(parent.span, parent.rollout, agent, True, parent.tool_calls)
                )
                return
            name, attrs, agent, llm = _convert.start_info(data)
            opened = self._start(
                span.span_id, parent_key, name, attrs, agent, SpanKind.CLIENT if llm else SpanKind.INTERNAL
            )
            if llm and opened.agent:
                agent_header.install_httpx_hook(_HOOK_USER)  # a processor added without instrument()
                opened.agent_token = agent_header.set_agent(opened.agent)
            headers = self._headers.get(data.type) if llm else None
            if headers is not None:
                context = opened.span.get_span_context()
                traceparent = (
                    f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
                )
                opened.headers = headers
                opened.headers_token = headers.set(
                    {**(headers.get() or {}), semconv.HEADER_TRACEPARENT: traceparent}
                )
        except Exception:
            self.hook_errors.report("on_span_start")

    def on_span_end(self, span: Any) -> None:
        try:
            opened = self._open.end(span.span_id)  # None for a folded span
            parent = self._open.get(span.parent_id or span.trace_id)
            if opened is None:
                return
            if opened.agent_token is not None:
                agent_header.reset_agent(opened.agent_token)
            if opened.headers_token is not None and opened.headers is not None:
                # ValueError: ended in another context than it started in; nothing of ours is left there
                try:
                    opened.headers.reset(opened.headers_token)
                except ValueError:
                    pass
            data = span.span_data
            kind = data.type
            otel_span = opened.span
            attrs = _convert.end_attributes(data, capture_content=self.capture_content)
            if kind == "generation" and parent is not None:
                parent.tool_calls.extend(_convert.tool_calls(data.output))
            elif kind == "response" and parent is not None:
                parent.tool_calls.extend(_convert.response_tool_calls(getattr(data, "response", None)))
            elif kind == "function" and parent is not None:
                call_id = _convert.match_tool_call(data.name, data.input, parent.tool_calls)
                if call_id:
                    attrs[semconv.GEN_AI_TOOL_CALL_ID] = call_id
            elif kind == "handoff" and data.to_agent:
                otel_span.update_name(_convert.span_name(data))
            if attrs:
                otel_span.set_attributes(attrs)
            # success leaves the status UNSET, as OpenTelemetry asks of instrumentation libraries
            if span.error:
                mark_span_failed(otel_span, *_convert.error_description(span.error))
            otel_span.end()
        except Exception:
            self.hook_errors.report("on_span_end")

    def shutdown(self) -> None:
        self.force_flush()

    def force_flush(self) -> None:
        """Spans go out through the OpenTelemetry tracer provider; flush that to export them."""


# --- instrument / uninstrument -----------------------------------------------------------------------
#: Who holds :mod:`agl_core.capture.agent_header`'s httpx hook while the SDK is instrumented.
_HOOK_USER = "openai_agents"


@dataclasses.dataclass
class _Installed:
    processor: AglTracingProcessor
    #: The SDK's processors before ``instrument(replace_processors=True)``; ``None`` when agl only added.
    replaced: tuple[Any, ...] | None
    #: The SDK's own uploaders to OpenAI that agl switched off (put back by ``uninstrument()``).
    removed_uploaders: tuple[Any, ...] = ()


def _uploads_to_openai(processor: Any) -> bool:
    """Whether ``processor`` is the SDK's batch processor exporting to OpenAI's trace ingest endpoint."""
    from agents.tracing.processors import BackendSpanExporter, BatchTraceProcessor

    return isinstance(processor, BatchTraceProcessor) and isinstance(
        getattr(processor, "_exporter", None), BackendSpanExporter
    )


def _sdk_processors() -> tuple[Any, ...] | None:
    # The SDK can add or replace processors but has no public way to list them; uninstrument() needs the
    # list to take agl's out and leave the user's. None when a future SDK keeps them elsewhere.
    from agents.tracing import get_trace_provider

    multi = getattr(get_trace_provider(), "_multi_processor", None)
    processors = getattr(multi, "_processors", None)
    return tuple(processors) if isinstance(processors, (tuple, list)) else None


def _install(
    tracer_provider: trace.TracerProvider | None,
    capture_content: bool,
    replace_processors: bool,
    keep_openai_export: bool,
) -> _Installed:
    installed = _add_processor(tracer_provider, capture_content, replace_processors, keep_openai_export)
    agent_header.install_httpx_hook(_HOOK_USER)
    return installed


def _add_processor(
    tracer_provider: trace.TracerProvider | None,
    capture_content: bool,
    replace_processors: bool,
    keep_openai_export: bool,
) -> _Installed:
    from agents.tracing import add_trace_processor, set_trace_processors

    processor = AglTracingProcessor(tracer_provider=tracer_provider, capture_content=capture_content)
    replaced = None
    if not replace_processors and not keep_openai_export:
        current = _sdk_processors()
        if current is None:
            logger.warning(
                "agl: cannot list the Agents SDK's trace processors to switch off its upload to OpenAI;"
                " call agents.set_tracing_disabled(True) or instrument(replace_processors=True)"
            )
        else:
            uploaders = tuple(p for p in current if _uploads_to_openai(p))
            if uploaders:
                set_trace_processors([p for p in current if p not in uploaders])
                add_trace_processor(processor)
                return _Installed(processor, None, uploaders)
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
    return _Installed(processor, replaced)


def _uninstall(installed: _Installed) -> None:
    from agents.tracing import set_trace_processors

    installed.processor.enabled = False
    agent_header.uninstall_httpx_hook(_HOOK_USER)
    if installed.replaced is not None:
        set_trace_processors(list(installed.replaced))
        return
    current = _sdk_processors()
    if current is None:
        logger.warning(
            "agl: cannot list the Agents SDK's trace processors; agl's stays registered, switched off"
        )
        return
    kept = [p for p in current if p is not installed.processor]
    set_trace_processors([*installed.removed_uploaders, *kept])


_instrumentor: Instrumentor[_Installed] = Instrumentor(_uninstall)


def instrument(
    *,
    tracer_provider: trace.TracerProvider | None = None,
    capture_content: bool = False,
    replace_processors: bool = False,
    keep_openai_export: bool = False,
) -> AglTracingProcessor:
    """Record the Agents SDK's traces as OpenTelemetry spans; returns the processor.

    Adds :class:`AglTracingProcessor` next to the processors already registered, and switches off the
    SDK's default one, which uploads every trace to OpenAI's servers (``keep_openai_export=True`` keeps
    it); ``replace_processors=True`` makes agl's the only one. ``uninstrument()`` restores what was
    there. Calling it again while instrumented returns the same processor and changes nothing.

    The model requests to an agl gateway then carry the calling agent's name (``x-agl-agent-name``, see
    :class:`AglTracingProcessor`).
    """
    installed = _instrumentor.instrument(
        lambda: _install(tracer_provider, capture_content, replace_processors, keep_openai_export)
    )
    return installed.processor


def uninstrument() -> None:
    """Take agl's processor out of the SDK (and agl's header hook off httpx, unless another adapter still
    uses it); with ``replace_processors=True`` the previous ones come back."""
    _instrumentor.uninstrument()


def is_instrumented() -> bool:
    return _instrumentor.is_instrumented()
