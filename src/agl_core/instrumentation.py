"""The contract every framework adapter (``agl_langchain``, ``agl_openai_agents``, ``agl_autogen``) is
built on; it imports no framework.

- :class:`Instrumentor`: a framework's ``instrument()`` / ``uninstrument()`` / ``is_instrumented()``.
  ``instrument()`` twice is harmless; ``uninstrument()`` undoes exactly what ``instrument()`` did.
  :class:`Patches` records the attribute replacements of an adapter that has to monkey-patch, so that
  the exact originals can be put back.
- :class:`HookErrors`: a hook catches its own errors, logs the first failure of each hook once and lets
  the agent run on (an exception raised by the agent's code always reaches the agent unchanged).
- :class:`OpenSpan` / :class:`OpenSpans`: what an adapter keeps per framework run (or span) id while the
  run is open, and :func:`start_span`, which opens the OTel span of a run under its parent's.
- :func:`adapter_tracer`: the tracer adapters record with (lean spans on an SDK provider).
- :func:`span_attributes`: the attributes every adapter span carries (rollout identity, ``agl.source``,
  agent name) merged with the adapter's own.
- :func:`read_usage` / :func:`usage_attributes`: a framework's token-usage record as GenAI attributes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from . import semconv
from .otel.lean_spans import LeanTracer, lean_tracer

__all__ = [
    "HookErrors",
    "Instrumentor",
    "OpenSpan",
    "OpenSpans",
    "Patches",
    "adapter_tracer",
    "mark_span_failed",
    "read_usage",
    "span_attributes",
    "start_span",
    "usage_attributes",
]

logger = logging.getLogger("agl.adapters")

K = TypeVar("K")
R = TypeVar("R", bound="OpenSpan")
InstalledT = TypeVar("InstalledT")


# --- hooks never break the agent ---------------------------------------------------------------------
class HookErrors:
    """Collects the failures of one adapter's hooks; logs the first failure of each hook.

    A hook that fails is reported and returns normally; the agent runs on, untraced at that point.
    """

    def __init__(self, framework: str) -> None:
        self.framework = framework
        self.failed: set[str] = set()
        self._lock = threading.Lock()

    def report(self, hook: str) -> None:
        """Call from an ``except`` block: logs the current exception if ``hook`` has not failed before."""
        with self._lock:
            first = hook not in self.failed
            self.failed.add(hook)
        if first:
            logger.exception(
                "agl: %s hook %s failed; the agent continues untraced there", self.framework, hook
            )

    def call(self, hook: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, or ``None`` (reported) if it raises."""
        try:
            return fn(*args, **kwargs)
        except Exception:
            self.report(hook)
            return None


# --- instrument / uninstrument -----------------------------------------------------------------------
class Instrumentor(Generic[InstalledT]):
    """The instrumentation state of one framework in this process (an adapter keeps one instance behind
    its module-level ``instrument()`` / ``uninstrument()`` / ``is_instrumented()``).

    ``instrument(install)`` calls ``install()`` (which hooks agl into the framework) and returns what it
    returned; called again while instrumented it returns that same value and calls nothing, whatever
    ``install`` is. :meth:`uninstrument` hands the value to ``uninstall``, which must undo ``install``:
    put back the exact originals or, where that cannot be done (another instrumentor wrapped the same
    thing afterwards), leave agl's hook in place switched off and log why. Called while not instrumented
    it does nothing. Both are thread-safe.
    """

    def __init__(self, uninstall: Callable[[InstalledT], None]) -> None:
        self._uninstall = uninstall
        self._lock = threading.Lock()
        #: ``(what install returned,)`` while instrumented (a tuple: ``install`` may return ``None``).
        self._state: tuple[InstalledT] | None = None

    def instrument(self, install: Callable[[], InstalledT]) -> InstalledT:
        with self._lock:
            if self._state is None:
                self._state = (install(),)
            return self._state[0]

    def uninstrument(self) -> None:
        with self._lock:
            if self._state is not None:
                (installed,), self._state = self._state, None
                self._uninstall(installed)

    def is_instrumented(self) -> bool:
        return self._state is not None


class Patches:
    """Attribute replacements made by an adapter that has to monkey-patch, in the order made.

    :meth:`restore` puts each original back where agl's replacement is still in place. Where something
    else replaced agl's in turn (another instrumentor, wrapping after agl), taking agl's out would take
    theirs out too: that one stays, and :meth:`restore` returns ``False``.
    """

    def __init__(self) -> None:
        self._made: list[tuple[Any, str, Any, Any]] = []  # (owner, attribute, original, replacement)

    def replace(self, owner: Any, attribute: str, replacement: Any) -> None:
        """Set ``owner.attribute`` (defined on ``owner`` itself, not inherited) to ``replacement``."""
        original = vars(owner)[attribute]
        setattr(owner, attribute, replacement)
        self._made.append((owner, attribute, original, replacement))

    def restore(self) -> bool:
        """Put the originals back, last replacement first; ``False`` if one could not be (see above)."""
        clean = True
        for owner, attribute, original, replacement in reversed(self._made):
            if vars(owner).get(attribute) is replacement:
                setattr(owner, attribute, original)
            else:
                clean = False
        self._made.clear()
        return clean


# --- open spans --------------------------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class OpenSpan:
    """A framework run (or span) being recorded, from its start to its end: what its children inherit.

    Adapters subclass it to keep more per run (an Agents SDK generation's tool calls...).
    """

    span: trace.Span
    #: Rollout identity attributes the run was started with (its children inherit them where the
    #: framework runs them in a context that has lost the rollout).
    rollout: Mapping[str, AttributeValue]
    #: The agent the run belongs to (names the LLM and tool spans under it).
    agent: str | None
    #: A run recorded as its parent's span (a bookkeeping step): its end does not end the span.
    folded: bool = False


class OpenSpans(Generic[K, R]):
    """The open runs of one adapter object, by the framework's run / span id.

    Each operation is a single dict operation (atomic under the GIL); a run's start and end never race,
    so no lock is needed across threads.
    """

    def __init__(self) -> None:
        self._open: dict[K, R] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._open

    def __len__(self) -> int:
        return len(self._open)

    def get(self, key: K | None) -> R | None:
        return self._open.get(key) if key is not None else None

    def add(self, key: K, record: R) -> R:
        self._open[key] = record
        return record

    def pop(self, key: K) -> R | None:
        return self._open.pop(key, None)

    def end(self, key: K) -> R | None:
        """Take the run out; its record when its span is its own to end (not a folded run), else ``None``."""
        record = self._open.pop(key, None)
        return record if record is not None and not record.folded else None


def adapter_tracer(tracer_provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """The tracer an adapter records with (default provider: the global one). For an OpenTelemetry SDK
    provider whose processors ask nothing of a live span (the batch and simple processors, agl's rollout
    processor), its spans are built once, when they end, instead of through the SDK's span machinery
    (:mod:`agl_core.otel.lean_spans`); processors and exporters receive the same spans either way."""
    return lean_tracer(tracer_provider or trace.get_tracer_provider(), "agl")


def span_attributes(
    source: str,
    attributes: Mapping[str, Any],
    *,
    rollout: Mapping[str, AttributeValue],
    agent: str | None = None,
) -> dict[str, Any]:
    """The start attributes of an adapter span: the rollout identity (first: the store finds it fastest
    there), ``agl.source`` (one of ``semconv.SOURCE_*``), the adapter's own ``attributes``, and
    ``gen_ai.agent.name`` = ``agent`` unless ``attributes`` names one."""
    attrs: dict[str, Any] = {**rollout, semconv.SOURCE: source, **attributes}
    if agent and semconv.GEN_AI_AGENT_NAME not in attrs:
        attrs[semconv.GEN_AI_AGENT_NAME] = agent
    return attrs


def start_span(
    tracer: trace.Tracer,
    name: str,
    *,
    source: str,
    attributes: Mapping[str, Any],
    rollout: Mapping[str, AttributeValue],
    parent: OpenSpan | None = None,
    agent: str | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> trace.Span:
    """Start (not make current) the span of a framework run: a child of ``parent``'s span, else of the
    current context's; attributes as :func:`span_attributes` merges them."""
    attrs = span_attributes(source, attributes, rollout=rollout, agent=agent)
    if type(tracer) is LeanTracer:
        return tracer.start_child(name, parent.span if parent is not None else None, kind, attrs)
    context = trace.set_span_in_context(parent.span) if parent is not None else otel_context.get_current()
    return tracer.start_span(name, context=context, kind=kind, attributes=attrs)


def mark_span_failed(span: trace.Span, error_type: str, description: str) -> None:
    """ERROR status and ``error.type`` on ``span``, for a failure the framework reports without an
    exception (for one with, :func:`agl_core.tracing.mark_span_error`)."""
    span.set_attribute(semconv.ERROR_TYPE, error_type)
    span.set_status(Status(StatusCode.ERROR, description))


# --- token usage -------------------------------------------------------------------------------------
# Called on every LLM call, on the agent's path: written as few Python calls as it takes.


def _count(value: object) -> int | None:
    if type(value) is int:
        return value
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def read_usage(usage: object) -> tuple[int | None, int | None]:
    """``(input tokens, output tokens)`` of a usage record: a mapping or an object, with the Responses
    names (``input_tokens`` / ``output_tokens``) or the Chat Completions ones (``prompt_tokens`` /
    ``completion_tokens``); of two, the first that holds a count. A count that is missing or not a whole
    number is ``None``."""
    if usage is None:
        return None, None
    if type(usage) is dict or isinstance(usage, Mapping):
        get = usage.get
        first_in, second_in = get("input_tokens"), get("prompt_tokens")
        first_out, second_out = get("output_tokens"), get("completion_tokens")
    else:
        first_in, second_in = getattr(usage, "input_tokens", None), getattr(usage, "prompt_tokens", None)
        first_out = getattr(usage, "output_tokens", None)
        second_out = getattr(usage, "completion_tokens", None)
    counted_in = _count(first_in)
    if counted_in is None:
        counted_in = _count(second_in)
    counted_out = _count(first_out)
    if counted_out is None:
        counted_out = _count(second_out)
    return counted_in, counted_out


def usage_attributes(input_tokens: object, output_tokens: object) -> dict[str, int]:
    """``gen_ai.usage.input_tokens`` / ``output_tokens`` for the counts that are whole numbers."""
    attrs = {}
    count = _count(input_tokens)
    if count is not None:
        attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = count
    count = _count(output_tokens)
    if count is not None:
        attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = count
    return attrs
