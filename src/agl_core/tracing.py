"""Tracing for the agent side: OTLP export, the rollout context, rewards.

The rollout a piece of code belongs to travels in the OpenTelemetry context (a context variable), not in
process-global state, so one process can run many rollouts at once in threads or asyncio tasks. Every span
agl creates inside :func:`rollout_scope` carries the rollout's attributes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource as OtelResource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Status, StatusCode

from . import semconv, settings
from .otel.lean_spans import NO_PROVIDER_HOOKS, LeanSpan
from .pipeline.rewards import Reward, RewardSink, StoredReward, make_reward

__all__ = [
    "RolloutContext",
    "RolloutSpanProcessor",
    "context_rollout_attributes",
    "current_rollout",
    "emit_error",
    "emit_reward",
    "get_tracer",
    "join_rollout",
    "make_otlp_exporter",
    "rollout_attributes",
    "rollout_identity",
    "rollout_scope",
    "setup_tracing",
]

logger = logging.getLogger(__name__)

_ROLLOUT_KEY = otel_context.create_key("agl.rollout")
_INSTRUMENTATION_NAME = "agl"


@dataclasses.dataclass(frozen=True)
class RolloutContext:
    """Identity of the rollout the current code runs in."""

    rollout_id: str
    attempt_id: str | None = None
    task_id: str | None = None

    @functools.cached_property
    def identity(self) -> Mapping[str, str]:
        """:func:`rollout_attributes` of this rollout, built once: shared, so never to be changed (a plain
        dict: ``{**identity, ...}`` copies a dict in one step, a mapping proxy key by key)."""
        return rollout_attributes(self)


def current_rollout() -> RolloutContext | None:
    """The rollout of the calling context, or ``None`` outside any rollout."""
    value = otel_context.get_value(_ROLLOUT_KEY)
    return value if isinstance(value, RolloutContext) else None


_NO_IDENTITY: Mapping[str, str] = {}


def rollout_identity() -> Mapping[str, str]:
    """The current rollout's identity attributes as :func:`rollout_attributes` gives them, built once per
    rollout (empty outside a rollout), for hooks that run on every span: shared, so never to be changed."""
    rollout = current_rollout()
    return rollout.identity if rollout is not None else _NO_IDENTITY


def rollout_attributes(rollout: RolloutContext | None = None) -> dict[str, str]:
    """The ``agl.*`` identity attributes to stamp on a span (empty outside a rollout)."""
    rollout = rollout or current_rollout()
    if rollout is None:
        return {}
    attrs = {semconv.ROLLOUT_ID: rollout.rollout_id}
    if rollout.attempt_id:
        attrs[semconv.ATTEMPT_ID] = rollout.attempt_id
    if rollout.task_id:
        attrs[semconv.TASK_ID] = rollout.task_id
    return attrs


class RolloutSpanProcessor(SpanProcessor):
    """Stamps the rollout's identity on every span started inside a rollout that does not carry it.

    Spans from instrumentation that knows nothing of agl (OpenInference instrumentors, a framework's own
    telemetry) then land in the right rollout in the store. The rollout is the one of the context the
    span starts in, else the one its parent span carries. :func:`setup_tracing` installs it; add it to
    your own tracer provider when you export spans some other way.
    """

    #: Tells adapters' lean spans (agl_core.otel.lean_spans) what on_start and on_end below do.
    lean_spans_rollout_hook = True

    def on_start(self, span: SdkSpan, parent_context: otel_context.Context | None = None) -> None:
        # Runs for every span of the provider: the attributes view is built once (the SDK makes a new
        # one on each access).
        attributes = span.attributes
        if attributes and semconv.ROLLOUT_ID in attributes:
            return
        attrs = context_rollout_attributes(parent_context)
        if attrs:
            span.set_attributes(attrs)

    def on_end(self, span: ReadableSpan) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


_IDENTITY_KEYS = (semconv.ROLLOUT_ID, semconv.ATTEMPT_ID, semconv.TASK_ID)


def context_rollout_attributes(context: otel_context.Context | None = None) -> dict[str, Any]:
    """:func:`rollout_attributes` of ``context`` (default: the current one); where it holds no rollout,
    the identity attributes of its current span, when that is an SDK or adapter span that carries them (code a
    framework runs in a context of its own, under a span started inside the rollout)."""
    value = otel_context.get_value(_ROLLOUT_KEY, context)
    if isinstance(value, RolloutContext):
        return rollout_attributes(value)
    parent = trace.get_current_span(context)
    inherited = (
        parent.attributes if isinstance(parent, (ReadableSpan, LeanSpan)) and parent.attributes else {}
    )
    return {k: inherited[k] for k in _IDENTITY_KEYS if k in inherited}


def get_tracer(tracer_provider: trace.TracerProvider | None = None) -> trace.Tracer:
    provider = tracer_provider or trace.get_tracer_provider()
    return provider.get_tracer(_INSTRUMENTATION_NAME)


@contextlib.contextmanager
def rollout_scope(
    rollout_id: str,
    attempt_id: str | None = None,
    task_id: str | None = None,
    *,
    tracer_provider: trace.TracerProvider | None = None,
) -> Iterator[trace.Span]:
    """Run the enclosed code as part of a rollout, under a root ``agl.rollout`` span.

    An exception escaping the block marks the span as failed and is re-raised.
    """
    rollout = RolloutContext(rollout_id, attempt_id, task_id)
    # A new trace per rollout: the rollout span must not hang under whatever span the caller had open.
    root = trace.set_span_in_context(trace.INVALID_SPAN)
    token = otel_context.attach(otel_context.set_value(_ROLLOUT_KEY, rollout, root))
    try:
        attrs: dict[str, Any] = rollout_attributes(rollout)
        attrs[semconv.SOURCE] = semconv.SOURCE_RUNNER
        with get_tracer(tracer_provider).start_as_current_span(
            semconv.SPAN_ROLLOUT, attributes=attrs
        ) as span:
            yield span
    finally:
        otel_context.detach(token)


@contextlib.contextmanager
def join_rollout(rollout: RolloutContext, parent: trace.SpanContext | None = None) -> Iterator[None]:
    """Run the enclosed code as part of a rollout whose ``agl.rollout`` span was opened elsewhere (in
    another process): spans started inside carry the rollout's identity and hang under ``parent``, the
    context of that span (none: they start a trace of their own)."""
    current = trace.NonRecordingSpan(parent) if parent is not None else trace.INVALID_SPAN
    token = otel_context.attach(
        otel_context.set_value(_ROLLOUT_KEY, rollout, trace.set_span_in_context(current))
    )
    try:
        yield
    finally:
        otel_context.detach(token)


_warned_outside_rollout = False


def _warn_outside_rollout() -> None:
    global _warned_outside_rollout
    if not _warned_outside_rollout:
        _warned_outside_rollout = True
        logger.warning(
            "agl: emit_reward was called outside a rollout, so the reward belongs to no rollout; pass"
            " rollout_id=... (or trace_id= / span_id=) to attach it to a finished rollout in the store"
        )


def emit_reward(
    value: float,
    *,
    name: str = "episode",
    attributes: Mapping[str, Any] | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    rollout_id: str | None = None,
    trace_id: str | None = None,
    span_id: str | None = None,
    reward_id: str | None = None,
    source: str | None = None,
    time: datetime | float | None = None,
    store: str | RewardSink | None = None,
    token: str | None = None,
) -> StoredReward | None:
    """Record a reward for the current rollout as an ``agl.reward`` span, or attach one to a finished
    rollout, trace or span in the store.

    The last ``episode`` reward of a rollout (by time) is its episode reward. A reward with any other
    ``name`` (``emit_reward(0.3, name="step")``) is an intermediate reward of one LLM call, added to that
    call's reward after credit assignment (:mod:`agl_core.pipeline.credit`; trainer config
    ``algorithm.rewards.explicit``). The call is the one the reward was emitted during, else, of the calls
    that ended before it, the one that ended last within the nearest enclosing step (agent turn, graph
    node, tool) that ran any of them, else the last one of the rollout; a reward emitted before any call
    ended goes to the first call. Emit it right after the call it judges, in the same step. ``value`` must
    be a finite number.

    With a target (``rollout_id``, ``trace_id``, or ``span_id`` with the span's ``trace_id`` or
    ``rollout_id``), the reward is sent to the store instead, at any time and from any process
    (:mod:`agl_core.pipeline.rewards`): ``store`` is a store URL (default ``AGL_STORE_URL``, with ``token`` or
    ``AGL_STORE_TOKEN``), a ``StoreClient`` or a store backend. ``reward_id`` makes retrying safe (the
    same reward under the same id is stored once; default: a new id), ``source`` says who gave it and
    ``time`` when (an aware ``datetime`` or Unix seconds; default: when stored). Returns what was stored.
    Without a target it records the reward for the current rollout and returns ``None``; outside a
    rollout it logs a warning once (saying to pass ``rollout_id=``) and the span has no rollout id.
    """
    if rollout_id is not None or trace_id is not None or span_id is not None:
        if attributes:
            raise ValueError("emit_reward: attributes are recorded only on rewards emitted during a rollout")
        return _send_reward(
            make_reward(
                value,
                rollout_id=rollout_id,
                trace_id=trace_id,
                span_id=span_id,
                name=name,
                source=source,
                reward_id=reward_id,
                time=time,
            ),
            store,
            token,
        )
    reward = float(value)
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise ValueError(f"emit_reward: reward must be a finite number, got {value!r}")
    if not context_rollout_attributes():
        # An agent run outside agl (in production, in a notebook) keeps running: instrumentation never
        # breaks it. The span is still recorded, without a rollout id.
        _warn_outside_rollout()
    attrs: dict[str, Any] = rollout_attributes()  # identity first: the store finds it fastest there
    attrs.update(attributes or {})
    attrs[semconv.REWARD_VALUE] = reward
    attrs[semconv.REWARD_NAME] = name
    with get_tracer(tracer_provider).start_as_current_span(semconv.SPAN_REWARD, attributes=attrs):
        pass
    return None


def _send_reward(reward: Reward, store: str | RewardSink | None, token: str | None) -> StoredReward:
    if store is not None and not isinstance(store, str):
        return store.add_rewards([reward])[0]
    from .store.client import StoreClient  # httpx: imported only where a reward is sent

    with StoreClient(store, token=token) as client:
        return client.add_rewards([reward])[0]


def emit_error(
    error: BaseException | str,
    *,
    tracer_provider: trace.TracerProvider | None = None,
) -> None:
    """Record an error of the current rollout as an ``agl.error`` span with ERROR status."""
    attrs: dict[str, Any] = rollout_attributes()
    attrs[semconv.ERROR_TYPE] = type(error).__name__ if isinstance(error, BaseException) else "error"
    with get_tracer(tracer_provider).start_as_current_span(
        semconv.SPAN_ERROR, attributes=attrs, record_exception=False, set_status_on_exception=False
    ) as span:
        if isinstance(error, BaseException):
            span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)))


def make_otlp_exporter(
    endpoint: str | None = None,
    *,
    token: str | None = None,
    timeout_s: float = 10.0,
    spool_dir: str | os.PathLike[str] | None = None,
    max_spool_bytes: int | None = None,
) -> SpanExporter:
    """An OTLP/HTTP protobuf span exporter aimed at the collector-store.

    ``endpoint`` is a store base URL or a full ``.../v1/traces`` URL. Without one, the standard
    ``OTEL_EXPORTER_OTLP_*`` variables decide when set (the OpenTelemetry SDK's exporter then sends), and
    ``AGL_STORE_URL`` otherwise. agl's exporter (:class:`~agl_core.otel.spool.SpoolingSpanExporter`) keeps
    spans the store has not acknowledged in a bounded spool and retries them, in memory or, with
    ``spool_dir``, on disk; ``max_spool_bytes`` bounds it (default 256 MiB).
    """
    url: str | None
    if endpoint is not None:
        url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
    elif settings.otlp_env_configured():
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        token = settings.store_token(token)
        headers = {"authorization": f"Bearer {token}"} if token else None
        return OTLPSpanExporter(headers=headers, timeout=timeout_s)  # it reads OTEL_EXPORTER_OTLP_* itself
    else:
        url = settings.store_url() + "/v1/traces"
    from .otel.spool import DEFAULT_MAX_SPOOL_BYTES, SpoolingSpanExporter

    return SpoolingSpanExporter(
        url,
        token=settings.store_token(token),
        timeout_s=timeout_s,
        spool_dir=spool_dir,
        max_spool_bytes=DEFAULT_MAX_SPOOL_BYTES if max_spool_bytes is None else max_spool_bytes,
    )


class _SwitchableExporter(SpanExporter):
    """Forwards to an OTLP exporter that :func:`setup_tracing` can re-aim later in the process
    (OpenTelemetry allows setting the global tracer provider only once)."""

    def __init__(self, inner: SpanExporter, endpoint: str) -> None:
        self._inner = inner
        #: where spans go (the store URL asked for)
        self.endpoint = endpoint

    def switch(self, inner: SpanExporter, endpoint: str) -> None:
        old, self._inner = self._inner, inner
        self.endpoint = endpoint
        old.shutdown()

    def export(self, spans: Any) -> Any:
        return self._inner.export(spans)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._inner.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self._inner.shutdown()


_global_setup: tuple[TracerProvider, _SwitchableExporter] | None = None


def setup_tracing(
    endpoint: str | None = None,
    *,
    token: str | None = None,
    service_name: str = "agl-agent",
) -> TracerProvider:
    """Send this process's spans (through the global tracer provider) to the collector-store over OTLP.

    If the process already has an SDK tracer provider (the user's own tracing), agl adds its exporter to
    it instead of replacing it. A :class:`RolloutSpanProcessor` is added too, so spans from other
    instrumentation (OpenInference) made during a rollout are attributed to it. Returns the provider spans
    go through; call ``force_flush()`` on it before relying on the store having them.

    Once tracing is set up, calling it again without an ``endpoint`` keeps the exporter as it is, and so
    does any call made during a rollout (from the agent function, where the runner has already aimed the
    exporter at the run's store): the run's spans are never sent elsewhere, and a different endpoint asked
    for there is logged as a warning. Outside a rollout, a new ``endpoint`` re-aims agl's exporter.
    """
    global _global_setup
    if _global_setup is not None:
        provider, switchable = _global_setup
        rollout = current_rollout()
        if endpoint is None or rollout is not None:
            if endpoint is not None and endpoint.rstrip("/") != switchable.endpoint:
                logger.warning(
                    "setup_tracing(%r) was called during rollout %s; its spans keep going to %s, where this"
                    " run reads them. Call setup_tracing once at start-up, outside the agent function.",
                    endpoint,
                    rollout.rollout_id if rollout is not None else "?",
                    switchable.endpoint,
                )
            return provider
        provider.force_flush()
        switchable.switch(make_otlp_exporter(endpoint, token=token), endpoint.rstrip("/"))
        return provider
    exporter = make_otlp_exporter(endpoint, token=token)
    switchable = _SwitchableExporter(exporter, settings.store_url(endpoint))
    processor = BatchSpanProcessor(switchable, schedule_delay_millis=200)
    existing = trace.get_tracer_provider()
    if isinstance(existing, TracerProvider):
        provider = existing
    else:
        provider = TracerProvider(resource=OtelResource.create({"service.name": service_name}))
        trace.set_tracer_provider(provider)
    provider.add_span_processor(RolloutSpanProcessor())
    provider.add_span_processor(processor)
    _global_setup = (provider, switchable)
    return provider


_NOWHERE_WARNED = False


def export_from_environment() -> TracerProvider | None:
    """What an adapter does at its first span in a process that set no tracer provider (``instrument()``
    alone, outside agl's runner): send the process's spans to the store ``AGL_STORE_URL`` names, or where
    the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` say
    (:func:`setup_tracing`); with neither set, warn once that nothing is recorded and what to set.
    Returns the provider set up, or ``None``."""
    global _NOWHERE_WARNED
    if _global_setup is not None:
        return _global_setup[0]
    if os.environ.get("AGL_STORE_URL") or settings.otlp_env_configured():
        provider = setup_tracing()
        logger.info(
            "agl: an instrumented agent's spans go to %s", _global_setup[1].endpoint if _global_setup else "?"
        )
        return provider
    if not _NOWHERE_WARNED:
        _NOWHERE_WARNED = True
        logger.warning(
            "agl: an instrumented agent started a span, but this process sends spans nowhere, so nothing is"
            " recorded. Set AGL_STORE_URL=http://127.0.0.1:4318 (where `agl store serve` listens) or"
            " OTEL_EXPORTER_OTLP_ENDPOINT before the agent starts, or call"
            " agl_core.setup_tracing(URL) at start-up."
        )
    return None


NO_PROVIDER_HOOKS.append(export_from_environment)


def mark_span_error(span: trace.Span, error: BaseException) -> None:
    """Set ERROR status with the exception's type and message on ``span``."""
    span.set_attribute(semconv.ERROR_TYPE, type(error).__name__)
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
