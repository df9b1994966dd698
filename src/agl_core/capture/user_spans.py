"""Spans for agents written without a framework: the tool calls and agent turns that an adapter would
record, written by the agent's own code.

* :func:`tool_call` (a context manager) and :func:`tool` (a decorator) record one tool call each as an
  ``execute_tool`` span: ``gen_ai.tool.name``, ``gen_ai.tool.call.id`` (the id of the model's tool call,
  which is how credit finds the LLM call that requested it), ``agl.source = "user"``, the rollout's
  identity, and ERROR status with ``error.type`` when it failed. These are the spans the ``tool_error`` /
  ``tool_success`` rewards count (:mod:`agl_core.pipeline.credit`).
* :func:`agent_span` records an agent's turn as an ``invoke_agent`` span naming the agent; spans started
  inside it (tool calls, rewards) belong to that agent.

The spans go through the tracer provider given, else the global one: during a rollout run by the runner,
that is the run's exporter to its store, exactly as for an adapter's spans. Outside a rollout they are
recorded without a rollout id (or not at all when no tracing is set up). Recording never breaks the
agent: a failure of agl's own code is logged once and the agent runs on; an exception raised by the
agent's code passes through unchanged.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, ParamSpec, Protocol, TypeVar, cast, overload

from opentelemetry import context as otel_context
from opentelemetry import trace

from .. import semconv
from ..instrumentation import HookErrors, mark_span_failed, span_attributes
from ..tracing import context_rollout_attributes, get_tracer, mark_span_error

__all__ = ["Tool", "ToolCall", "agent_span", "current_tool_call", "tool", "tool_call"]

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)

_hook_errors = HookErrors("agl_core")
_current: contextvars.ContextVar[ToolCall | None] = contextvars.ContextVar("agl_tool_call", default=None)

#: Description of a failure marked with :meth:`ToolCall.fail` and no message.
_FAILED = "the tool call failed"


class ToolCall:
    """The tool call a :func:`tool_call` block (or a :func:`tool` function) is recording.

    ``name`` and ``call_id`` are as given. :meth:`fail` marks the call failed without an exception.
    """

    def __init__(self, name: str, call_id: str | None, span: trace.Span | None) -> None:
        self.name = name
        self.call_id = call_id
        self._span = span
        self._failed = False
        self._open = True

    @property
    def failed(self) -> bool:
        """True once :meth:`fail` was called or an exception ended the call."""
        return self._failed

    def fail(self, message: str = _FAILED, *, error_type: str = semconv.ERROR_TYPE_TOOL_RESULT) -> None:
        """Mark the call failed although nothing was raised: the tool's failure went back to the model as
        the tool's result (an error message in the ``tool`` message). The span gets ERROR status with
        ``message`` and ``error.type = error_type`` (default ``"tool_error"``, what the LangChain adapter
        writes for the same case), and counts as a ``tool_error`` in credit. Call it inside the block;
        after the block has ended it changes nothing."""
        if not self._open:
            return
        self._failed = True
        if self._span is not None:
            _hook_errors.call("ToolCall.fail", mark_span_failed, self._span, error_type, str(message))

    def _end(self, error: BaseException | None) -> None:
        self._open = False
        if error is not None:
            self._failed = True


def current_tool_call() -> ToolCall | None:
    """The innermost tool call being recorded in the calling context (inside :func:`tool_call` or a
    :func:`tool` function), or ``None``: lets a decorated tool that returns its error to the model mark
    the call failed (``agl_core.current_tool_call().fail(message)``)."""
    return _current.get()


class _UserSpan:
    """A span of the agent's own code, current while the block runs; an exception escaping the block
    marks it failed (``error.type`` = the exception's class) and propagates unchanged."""

    hook = "user span"

    def __init__(
        self, name: str, attributes: Mapping[str, Any], tracer_provider: trace.TracerProvider | None
    ) -> None:
        self._name = name
        self._attributes = attributes
        self._provider = tracer_provider
        self._span: trace.Span | None = None
        self._token: contextvars.Token[otel_context.Context] | None = None

    def _start(self) -> trace.Span | None:
        try:
            attrs = span_attributes(
                semconv.SOURCE_USER, self._attributes, rollout=context_rollout_attributes()
            )
            span = get_tracer(self._provider).start_span(self._name, attributes=attrs)
        except Exception:
            _hook_errors.report(f"{self.hook} start")
            return None
        try:
            self._token = otel_context.attach(trace.set_span_in_context(span))
        except Exception:
            _hook_errors.report(f"{self.hook} start")
        self._span = span
        return span

    def _finish(self, error: BaseException | None) -> None:
        span, self._span = self._span, None
        if self._token is not None:
            token, self._token = self._token, None
            try:
                otel_context.detach(token)
            except Exception:
                _hook_errors.report(f"{self.hook} end")
        if span is None:
            return
        try:
            if error is not None:
                mark_span_error(span, error)
            span.end()
        except Exception:
            _hook_errors.report(f"{self.hook} end")


class _ToolSpan(_UserSpan):
    hook = "tool_call"

    def __init__(
        self,
        name: str,
        call_id: str | None,
        arguments: Any,
        tracer_provider: trace.TracerProvider | None,
    ) -> None:
        self.tool_name = str(name)
        self.call_id = str(call_id) if call_id is not None and call_id != "" else None
        attrs: dict[str, Any] = {
            semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL,
            semconv.GEN_AI_TOOL_NAME: self.tool_name,
        }
        if self.call_id is not None:
            attrs[semconv.GEN_AI_TOOL_CALL_ID] = self.call_id
        if arguments is not None:
            encoded = _hook_errors.call("tool_call arguments", _json, arguments)
            if encoded is not None:
                attrs[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] = encoded
        super().__init__(f"{semconv.OP_EXECUTE_TOOL} {self.tool_name}", attrs, tracer_provider)
        self._handle: ToolCall | None = None
        self._current: contextvars.Token[ToolCall | None] | None = None

    def __enter__(self) -> ToolCall:
        handle = ToolCall(self.tool_name, self.call_id, self._start())
        self._handle = handle
        self._current = _current.set(handle)
        return handle

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._current is not None:
            token, self._current = self._current, None
            try:
                _current.reset(token)
            except ValueError:  # left in another context than it was entered in: nothing to restore
                pass
        if self._handle is not None:
            self._handle._end(exc)
        self._finish(exc)


def _json(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def tool_call(
    name: str,
    *,
    call_id: str | None = None,
    arguments: Any = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> AbstractContextManager[ToolCall]:
    """Record the enclosed block as one tool call: an ``execute_tool {name}`` span, current while the
    block runs, yielding its :class:`ToolCall`.

    ``call_id``: the id of the tool call in the model's response (``message.tool_calls[i].id`` with the
    OpenAI client, the ``tool_use`` block's ``id`` with Anthropic's); with it, ``tool_error`` /
    ``tool_success`` rewards go to the LLM call that requested the tool, else to the call that ended last
    before the block started. ``arguments``: recorded as ``gen_ai.tool.call.arguments`` when given (a
    string as it is, anything else as JSON). ``tracer_provider``: default the global one.

    An exception escaping the block marks the span failed (``error.type`` = the exception's class) and
    propagates unchanged; :meth:`ToolCall.fail` marks a failure that was handed back to the model instead.
    One ``with`` per call of this function::

        for call in reply.choices[0].message.tool_calls or []:
            with agl_core.tool_call(call.function.name, call_id=call.id) as recorded:
                result = run_tool(call)
                if result.startswith("error:"):
                    recorded.fail(result)
    """
    return _ToolSpan(name, call_id, arguments, tracer_provider)


class _AgentSpan(_UserSpan):
    hook = "agent_span"

    def __enter__(self) -> trace.Span:
        span = self._start()
        return span if span is not None else trace.INVALID_SPAN

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._finish(exc)


def agent_span(
    name: str, *, tracer_provider: trace.TracerProvider | None = None
) -> AbstractContextManager[trace.Span]:
    """Record the enclosed block as a turn of the agent ``name``: an ``invoke_agent {name}`` span with
    ``gen_ai.agent.name = name``, current while the block runs (yields the span). Tool calls and rewards
    recorded inside belong to that agent. It does not name the block's LLM calls: a plain client's calls
    reach the gateway without trace context, so name them with :meth:`agl_core.LLM.for_agent`.

    An exception escaping the block marks the span failed and propagates unchanged."""
    agent = str(name)
    attrs = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT, semconv.GEN_AI_AGENT_NAME: agent}
    return _AgentSpan(f"{semconv.OP_INVOKE_AGENT} {agent}", attrs, tracer_provider)


class Tool(Protocol[P, R_co]):
    """A function that :func:`tool` records as a tool call each time it runs."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co:
        """Run the function, recorded as a tool call without a call id."""
        ...

    def for_call(self, call_id: str | None) -> Callable[P, R_co]:
        """The function recorded under ``call_id``, the id of the model's tool call it answers:
        ``lookup.for_call(call.id)(**json.loads(call.function.arguments))``."""
        ...


def _recorded(fn: Callable[..., Any], name: str, provider: trace.TracerProvider | None) -> Any:
    def for_call(call_id: str | None) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                with _ToolSpan(name, call_id, None, provider):
                    return await fn(*args, **kwargs)

            return run_async

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with _ToolSpan(name, call_id, None, provider):
                return fn(*args, **kwargs)

        return run

    recorded = for_call(None)
    recorded.for_call = for_call  # type: ignore[attr-defined]
    return recorded


@overload
def tool(fn: Callable[P, R], /) -> Tool[P, R]: ...


@overload
def tool(
    *, name: str | None = None, tracer_provider: trace.TracerProvider | None = None
) -> Callable[[Callable[P, R]], Tool[P, R]]: ...


def tool(
    fn: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> Tool[P, R] | Callable[[Callable[P, R]], Tool[P, R]]:
    """Decorate a function (plain or ``async def``) so that each run is recorded as a tool call, as by
    :func:`tool_call`: ``@agl_core.tool`` or ``@agl_core.tool(name="search")`` (default name: the
    function's ``__name__``).

    Call ``fn.for_call(call_id)(...)`` to record the run under the id of the model's tool call it answers
    (see :func:`tool_call` on why that matters); calling ``fn(...)`` records it without one. An exception
    raised by the function marks the span failed and propagates unchanged; a function that hands its
    failure back to the model as its result marks it with ``agl_core.current_tool_call().fail(message)``.
    """

    def decorate(function: Callable[P, R]) -> Tool[P, R]:
        label = name or getattr(function, "__name__", None) or "tool"
        return cast("Tool[P, R]", _recorded(function, label, tracer_provider))

    return decorate(fn) if fn is not None else decorate
