"""Adapter spans without the OpenTelemetry SDK's per-span machinery.

An adapter records two or more spans per LLM call from inside the framework's own hooks, on the agent's
path. The SDK's ``Tracer.start_span`` / ``Span.end`` build two span objects per span (the mutable ``Span``
and, at its end, a ``ReadableSpan`` copy), a lock, validated bounded attribute and event containers, and
run the sampler, the tracer's metrics and every processor's ``on_start`` / ``_on_ending`` / ``on_end``.

:func:`lean_tracer` returns, for an SDK tracer provider whose processors need nothing of a live SDK span, a
tracer whose spans keep what they record in a few slots and, when they end, build the one
``ReadableSpan`` the processors and exporters receive: the same object the SDK would hand them (same ids,
parent, resource, instrumentation scope, attributes, events, status, times), so the OTLP exporters, the
batch processor and any ``on_end`` see no difference. Where it cannot promise that it returns the SDK's own
tracer:

- a provider that is not the SDK's, or an SDK tracer of a shape this module does not know;
- a processor whose ``on_start`` or ``_on_ending`` is its own (it may read or change the live SDK span
  there): only the SDK's batch and simple processors, agl's :class:`~agl_core.tracing.RolloutSpanProcessor`
  and processors that keep ``SpanProcessor``'s do-nothing hooks qualify (checked again whenever the
  provider's processors change);
- span limits other than the SDK's defaults of unlimited value length (attribute counts are enforced).

What stays the SDK's: the id generator, the sampler (asked as the SDK asks it, except that the default
parent-based always-on sampler is answered without the call), a tracer switched off by the provider's
configurator (a non-recording span), and attribute cleaning (values of types OpenTelemetry does not
allow are dropped with the SDK's warning; sequences become tuples).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import (
    Event,
    ReadableSpan,
    SpanLimits,
    SpanProcessor,
    SynchronousMultiSpanProcessor,
    sampling,
)
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util import types
from opentelemetry.util._decorator import _agnosticcontextmanager

from ..semconv import ROLLOUT_ID as _ROLLOUT_ID

__all__ = ["LeanSpan", "LeanTracer", "lean_tracer"]

_UNSET = Status(StatusCode.UNSET)
# Trace flags of a sampled span whose trace id is random (the W3C "random" flag, where the API has it).
_RANDOM = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)
_SAMPLED = TraceFlags.SAMPLED
_PLAIN_TYPES = frozenset((str, bool, int, float))
# A child's flags: the parent's sampled and random-id flags (the SDK keeps only those).
_KEPT_FLAGS = TraceFlags.SAMPLED | _RANDOM
#: Every value a span's flags take here, made once.
_FLAGS = {flags: TraceFlags(flags) for flags in (0, _SAMPLED, _RANDOM, _SAMPLED | _RANDOM)}
_SAMPLED_DECISIONS = (sampling.Decision.RECORD_AND_SAMPLE,)
_RECORDING_DECISIONS = (sampling.Decision.RECORD_ONLY, sampling.Decision.RECORD_AND_SAMPLE)

#: Processors whose ``on_start`` / ``_on_ending`` ask nothing of the span they get.
_QUIET_PROCESSORS: tuple[type[SpanProcessor], ...] = (BatchSpanProcessor, SimpleSpanProcessor)


class _Hooks(NamedTuple):
    processors: tuple[SpanProcessor, ...] | None  # None: not looked at yet
    lean: bool
    starts: tuple[Callable[..., None], ...]
    ends: tuple[Callable[[ReadableSpan], None], ...]


def _silent_start(processor: SpanProcessor) -> bool:
    return isinstance(processor, _QUIET_PROCESSORS) or type(processor).on_start is SpanProcessor.on_start


def _rollout_processor(processor: SpanProcessor) -> bool:
    """agl's :class:`~agl_core.tracing.RolloutSpanProcessor` (marked by a class attribute: that module
    imports this one): its ``on_start`` only stamps the rollout on a span that lacks it, its ``on_end``
    does nothing."""
    return getattr(type(processor), "lean_spans_rollout_hook", False) is True


def _silent_end(processor: SpanProcessor) -> bool:
    return type(processor).on_end is SpanProcessor.on_end or _rollout_processor(processor)


def _quiet(processor: SpanProcessor) -> bool:
    """Whether a processor lets spans be lean: it asks nothing of the live span (no ``_on_ending`` of its
    own, an ``on_start`` that does nothing or is agl's rollout processor's)."""
    if isinstance(processor, _QUIET_PROCESSORS):
        return True
    ending = getattr(type(processor), "_on_ending", None)
    if ending is not None and ending is not getattr(SpanProcessor, "_on_ending", None):
        return False
    return _silent_start(processor) or _rollout_processor(processor)


class LeanTracer(trace.Tracer):
    """Starts :class:`LeanSpan` s for an SDK tracer (see the module's docstring for when it is used); falls
    back to that tracer whenever the provider's processors stop qualifying."""

    def __init__(self, sdk: SdkTracer) -> None:
        self.sdk = sdk
        self.processor: SynchronousMultiSpanProcessor = sdk.span_processor  # type: ignore[assignment]
        self.scope = sdk._instrumentation_scope
        limits: SpanLimits = sdk._span_limits
        self.max_attributes: int | None = limits.max_span_attributes
        self.max_event_attributes: int | None = limits.max_event_attributes
        self._enabled: Callable[[], bool] = getattr(sdk, "_is_enabled", lambda: True)
        self._ids = sdk.id_generator
        random_ids = getattr(self._ids, "is_trace_id_random", lambda: False)()
        #: Trace flags of a new sampled root span.
        self._root_flags: int = _SAMPLED | (_RANDOM if random_ids else 0)
        self._hooks = _Hooks(None, False, (), ())

    def hooks(self) -> _Hooks:
        """The provider's processors as this tracer calls them. The provider keeps them in a tuple it
        replaces when one is added, so they are looked at again only when that tuple changes."""
        processors = self.processor._span_processors
        hooks = self._hooks
        if processors is not hooks.processors:
            hooks = self._hooks = _Hooks(
                processors,
                all(_quiet(p) for p in processors),
                # on_start only where it does something: agl's rollout processor (the only one that
                # both does something there and lets spans be lean)
                tuple(p.on_start for p in processors if not _silent_start(p)),
                # on_end where it does something
                tuple(p.on_end for p in processors if not _silent_end(p)),
            )
        return hooks

    def start_span(
        self,
        name: str,
        context: otel_context.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        hooks = self.hooks()
        if links or not hooks.lean:
            return self.sdk.start_span(
                name, context, kind, attributes, links, start_time, record_exception, set_status_on_exception
            )
        return self._begin(
            hooks, name, context, None, kind, dict(attributes) if attributes else {}, start_time
        )

    def start_child(
        self, name: str, parent: trace.Span | None, kind: SpanKind, attributes: dict[str, Any]
    ) -> trace.Span:
        """``start_span(name, context, kind, attributes)`` with ``context`` holding ``parent`` (``None``:
        the current context), for an adapter's hook: ``attributes`` is a new dict the span keeps (not
        copied), and no context is built for the parent unless a processor or the sampler needs one."""
        hooks = self.hooks()
        if not hooks.lean:
            context = trace.set_span_in_context(parent) if parent is not None else None
            return self.sdk.start_span(name, context, kind, attributes)
        return self._begin(hooks, name, None, parent, kind, attributes, None)

    def _begin(
        self,
        hooks: _Hooks,
        name: str,
        context: otel_context.Context | None,
        parent_span: trace.Span | None,
        kind: SpanKind,
        attrs: dict[str, Any],
        start_time: int | None,
    ) -> trace.Span:
        """Start a lean span under ``parent_span`` if given, else under ``context``'s span."""
        current = (parent_span or trace.get_current_span(context)).get_span_context()
        if not self._enabled():
            return trace.NonRecordingSpan(current)
        parent: SpanContext | None = current
        if parent is not None and parent.is_valid:
            trace_id = parent.trace_id
            flags = parent.trace_flags & _KEPT_FLAGS  # the SDK keeps the parent's random-id flag
        else:
            parent = None
            trace_id = self._ids.generate_trace_id()
            flags = self._root_flags
        sampler = self.sdk.sampler
        if sampler is sampling.DEFAULT_ON:
            # What it answers, without asking: the parent's decision (a root: sampled), its trace state.
            recording = sampled = parent is None or parent.trace_flags.sampled
            trace_state = parent.trace_state if parent is not None else None
        else:
            if parent_span is not None:
                context = trace.set_span_in_context(parent_span)
            result = sampler.should_sample(context, trace_id, name, kind, attrs, ())
            sampled = result.decision in _SAMPLED_DECISIONS
            recording = result.decision in _RECORDING_DECISIONS
            trace_state = result.trace_state
            flags = (flags | _SAMPLED) if sampled else (flags & _RANDOM)
            attrs = dict(result.attributes) if result.attributes else {}
        span_context = SpanContext(trace_id, self._ids.generate_span_id(), False, _FLAGS[flags], trace_state)
        if not recording:
            return trace.NonRecordingSpan(span_context)
        span = LeanSpan(self, name, span_context, parent, kind, attrs, start_time or time.time_ns())
        # agl's rollout processor: its on_start does nothing to a span that carries the rollout already
        if hooks.starts and _ROLLOUT_ID not in attrs:
            started_in = trace.set_span_in_context(parent_span) if parent_span is not None else context
            for on_start in hooks.starts:
                on_start(span, parent_context=started_in)
        return span

    @_agnosticcontextmanager
    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Iterator[trace.Span]:
        with _current(self.start_span, args, kwargs) as span:
            yield span


@contextlib.contextmanager
def _current(
    start_span: Callable[..., trace.Span], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[trace.Span]:
    """``Tracer.start_as_current_span`` for a tracer's ``start_span`` (its arguments by keyword after the
    name and context, as OpenTelemetry's own instrumentations pass them)."""
    end_on_exit = kwargs.pop("end_on_exit", True)
    record_exception = kwargs.get("record_exception", True)
    set_status_on_exception = kwargs.get("set_status_on_exception", True)
    span = start_span(*args, **kwargs)
    with trace.use_span(
        span,
        end_on_exit=end_on_exit,
        record_exception=record_exception,
        set_status_on_exception=set_status_on_exception,
    ) as current:
        yield current


class LeanSpan(trace.Span):
    """A recording span of a :class:`LeanTracer`. Like the SDK's span it ignores changes once ended, but
    it takes no lock: an adapter's span is written by the hooks of one run, one after the other.

    It offers the read side of an SDK span that processors' ``on_start`` and agl's rollout processor use
    (``name``, ``context``, ``parent``, ``kind``, ``attributes``, ``start_time``)."""

    __slots__ = ("_tracer", "_name", "_context", "_parent", "_kind", "_attributes", "_events", "_status",
                 "_start_time", "_end_time")  # fmt: skip

    def __init__(
        self,
        tracer: LeanTracer,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: dict[str, Any],
        start_time: int,
    ) -> None:
        self._tracer = tracer
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._attributes = attributes
        self._events: list[Event] = []
        self._status = _UNSET
        self._start_time = start_time
        self._end_time: int | None = None

    # --- read side -----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def context(self) -> SpanContext:
        return self._context

    @property
    def parent(self) -> SpanContext | None:
        return self._parent

    @property
    def kind(self) -> SpanKind:
        return self._kind

    @property
    def attributes(self) -> Mapping[str, Any]:
        return self._attributes

    @property
    def start_time(self) -> int:
        return self._start_time

    @property
    def end_time(self) -> int | None:
        return self._end_time

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end_time is None

    # --- write side ----------------------------------------------------------------------------------
    def set_attribute(self, key: str, value: types.AttributeValue) -> None:
        if self._end_time is None:
            self._attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, types.AttributeValue]) -> None:
        if self._end_time is None:
            self._attributes.update(attributes)

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # The SDK's rules: UNSET never replaces a status, and nothing replaces OK.
        if self._end_time is not None or self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if status.status_code is not StatusCode.UNSET:
            self._status = status

    def add_event(self, name: str, attributes: types.Attributes = None, timestamp: int | None = None) -> None:
        if self._end_time is None:
            event_attributes = BoundedAttributes(
                self._tracer.max_event_attributes, attributes, immutable=True
            )
            self._events.append(Event(name, event_attributes, timestamp or time.time_ns()))

    def add_link(self, context: SpanContext, attributes: types.Attributes = None) -> None:
        # Links are only taken at start (the lean tracer leaves spans started with links to the SDK).
        pass

    def record_exception(
        self,
        exception: BaseException,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        # The SDK's own (the event's attributes differ between its versions); it only calls add_event.
        SdkSpan.record_exception(self, exception, attributes, timestamp, escaped)  # type: ignore[arg-type]

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            return
        self._end_time = end_time if end_time is not None else time.time_ns()
        tracer = self._tracer
        attributes: Mapping[str, Any] = self._attributes
        limit = tracer.max_attributes
        if (limit is not None and len(attributes) > limit) or not _PLAIN_TYPES.issuperset(
            map(type, attributes.values())
        ):
            # The SDK's cleaning and limits, one attribute at a time as it takes them: values of types
            # OpenTelemetry does not allow are dropped (with its warning), sequences become tuples, the
            # oldest attributes go past the limit.
            bounded = BoundedAttributes(limit, immutable=False)
            for key, value in self._attributes.items():
                bounded[key] = value
            attributes = bounded
        readable = ReadableSpan(
            name=self._name,
            context=self._context,
            parent=self._parent,
            resource=tracer.sdk.resource,
            attributes=attributes,
            events=tuple(self._events),
            kind=self._kind,
            status=self._status,
            start_time=self._start_time,
            end_time=self._end_time,
            instrumentation_scope=tracer.scope,
        )
        for on_end in tracer.hooks().ends:
            on_end(readable)


#: Called when an adapter's span starts while the process has no tracer provider yet;
#: :mod:`agl_core.tracing` adds :func:`~agl_core.tracing.export_from_environment` when it is imported.
NO_PROVIDER_HOOKS: list[Callable[[], object]] = []


class _GlobalTracer(trace.Tracer):
    """The global provider's tracer, asked for before the process set one: each span asks again until
    there is one (an adapter instrumented before :func:`~agl_core.setup_tracing` still records lean). A
    span started while there is none sets up the export the environment names, or warns once that
    nothing is recorded (:func:`~agl_core.tracing.export_from_environment`)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._tracer: trace.Tracer | None = None

    def _resolve(self) -> trace.Tracer:
        if self._tracer is not None:
            return self._tracer
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider):
            for hook in NO_PROVIDER_HOOKS:  # agl_core.tracing's: export where the environment says, or warn
                hook()
            provider = trace.get_tracer_provider()
            if isinstance(provider, trace.ProxyTracerProvider):
                return provider.get_tracer(self._name)
        self._tracer = lean_tracer(provider, self._name)
        return self._tracer

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        return self._resolve().start_span(*args, **kwargs)

    @_agnosticcontextmanager
    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Iterator[trace.Span]:
        with _current(self._resolve().start_span, args, kwargs) as span:
            yield span


def lean_tracer(tracer_provider: trace.TracerProvider, name: str) -> trace.Tracer:
    """The tracer an adapter records its spans with: a :class:`LeanTracer` over ``tracer_provider``'s SDK
    tracer where the module's conditions hold, else the provider's own tracer."""
    if isinstance(tracer_provider, trace.ProxyTracerProvider):
        return _GlobalTracer(name)
    tracer = tracer_provider.get_tracer(name)
    if not isinstance(tracer_provider, SdkTracerProvider) or type(tracer) is not SdkTracer:
        return tracer
    processor = getattr(tracer, "span_processor", None)
    limits = getattr(tracer, "_span_limits", None)
    if (
        not isinstance(processor, SynchronousMultiSpanProcessor)
        or not isinstance(getattr(processor, "_span_processors", None), tuple)
        or not hasattr(tracer, "_instrumentation_scope")
        or not isinstance(limits, SpanLimits)
        or limits.max_span_attribute_length is not None
    ):
        return tracer
    return LeanTracer(tracer)
