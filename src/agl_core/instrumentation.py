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

__all__ = [
    "HookErrors",
    "Instrumentor",
    "OpenSpan",
    "OpenSpans",
    "Patches",
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
    context = trace.set_span_in_context(parent.span) if parent is not None else otel_context.get_current()
    attrs = span_attributes(source, attributes, rollout=rollout, agent=agent)
    return tracer.start_span(name, context=context, kind=kind, attributes=attrs)


def mark_span_failed(span: trace.Span, error_type: str, description: str) -> None:
    """ERROR status and ``error.type`` on ``span``, for a failure the framework reports without an
    exception (for one with, :func:`agl_core.tracing.mark_span_error`)."""
    span.set_attribute(semconv.ERROR_TYPE, error_type)
    span.set_status(Status(StatusCode.ERROR, description))


# --- token usage -------------------------------------------------------------------------------------
_INPUT_KEYS = ("input_tokens", "prompt_tokens")
_OUTPUT_KEYS = ("output_tokens", "completion_tokens")


def _count(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def read_usage(usage: object) -> tuple[int | None, int | None]:
    """``(input tokens, output tokens)`` of a usage record: a mapping or an object, with the Responses
    names (``input_tokens`` / ``output_tokens``) or the Chat Completions ones (``prompt_tokens`` /
    ``completion_tokens``). A count that is missing or not a whole number is ``None``."""
    if usage is None:
        return None, None
    # Called once per LLM call: the record's kind is checked once, not per key.
    if isinstance(usage, Mapping):
        get: Callable[[str], object] = usage.get
    else:

        def get(key: str) -> object:
            return getattr(usage, key, None)

    return _first_count(get, _INPUT_KEYS), _first_count(get, _OUTPUT_KEYS)


def _first_count(get: Callable[[str], object], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        count = _count(get(key))
        if count is not None:
            return count
    return None


def usage_attributes(input_tokens: object, output_tokens: object) -> dict[str, int]:
    """``gen_ai.usage.input_tokens`` / ``output_tokens`` for the counts that are whole numbers."""
    attrs = {}
    for attribute, value in (
        (semconv.GEN_AI_USAGE_INPUT_TOKENS, input_tokens),
        (semconv.GEN_AI_USAGE_OUTPUT_TOKENS, output_tokens),
    ):
        count = _count(value)
        if count is not None:
            attrs[attribute] = count
    return attrs
