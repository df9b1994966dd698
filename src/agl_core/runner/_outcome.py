"""How an attempt ended: turning the agent's result, or the runner's verdict, into an outcome and its
spans. Light on purpose: worker processes import it (and not the store or the gateway)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import traceback
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from ..records import RolloutStatus
from ..tracing import emit_error, emit_reward
from ._types import LLM, RolloutTimeout

logger = logging.getLogger("agl_core.runner")

#: Longest error text stored with an attempt (the end of a traceback says the most).
_MAX_ERROR_CHARS = 8000


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How an attempt ended, as reported to the store."""

    status: RolloutStatus
    reward: float | None = None
    error: str | None = None


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of ``exc``'s chain (``raise ... from``, or raised while handling another):
    the error that started it, not the framework's wrapper."""
    seen = {id(exc)}
    while True:
        inner = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if inner is None or id(inner) in seen:
            return exc
        seen.add(id(inner))
        exc = inner


def error_summary(exc: BaseException) -> str:
    """One line naming the root cause: ``Type: first line of its message`` (notes left out)."""
    cause = root_cause(exc)
    message = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {message[0]}" if message else type(cause).__name__


def failure_text(exc: BaseException) -> str:
    """What is stored on the failed attempt: the root cause on the first line (:func:`error_summary`),
    then the exception with its traceback (its end kept when long)."""
    summary = error_summary(exc)[:500]
    trace_text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"{summary}\n\n{trace_text[-(_MAX_ERROR_CHARS - len(summary) - 2) :]}"


def call_agent(agent: Callable[..., Any], task_input: Any, llm: LLM) -> tuple[Any, BaseException | None]:
    """Call a sync agent (or run an async one to completion in a new event loop); returns its result or
    what it raised. ``SystemExit`` from agent code is a failure like any other, not an exit."""
    try:
        result = agent(task_input, llm)
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
        return result, None
    except (Exception, SystemExit) as exc:
        return None, exc


def interpret(
    result: Any, exc: BaseException | None, tracer_provider: trace.TracerProvider | None
) -> Outcome:
    """Turn what the agent returned (or raised) into the attempt's outcome and write its ``agl.reward`` or
    ``agl.error`` span in the current rollout context."""
    if exc is None and result is not None:
        try:
            reward = float(result)
        except (TypeError, ValueError):
            exc = TypeError(
                f"the agent returned {result!r:.200}, which is not a reward; return a number, or None and "
                "call agl_core.emit_reward"
            )
        else:
            try:
                emit_reward(reward, tracer_provider=tracer_provider)
            except ValueError as bad:
                exc = bad
            else:
                return Outcome(RolloutStatus.SUCCEEDED, reward)
    if exc is None:
        return Outcome(RolloutStatus.SUCCEEDED)
    emit_error(exc, tracer_provider=tracer_provider)
    text = failure_text(exc) if exc.__traceback__ is not None else error_summary(exc)
    return Outcome(RolloutStatus.FAILED, error=text)


def end_with_error(
    span: trace.Span,
    error: BaseException,
    status: RolloutStatus,
    tracer_provider: trace.TracerProvider | None,
) -> Outcome:
    """Record an outcome the runner decided (timeout, crash, shutdown): an ``agl.error`` span under the
    rollout span, which is marked failed too."""
    emit_error(error, tracer_provider=tracer_provider)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    return Outcome(status, error=f"{type(error).__name__}: {error}")


def timeout_outcome(
    span: trace.Span, limit_s: float, how: str, tracer_provider: trace.TracerProvider | None
) -> Outcome:
    error = RolloutTimeout(
        f"the agent ran longer than the rollout timeout of {limit_s:g} s and {how}; raise the limit with "
        "'agl run --rollout-timeout SECONDS' or 'runner.rollout_timeout_s' in the trainer config"
    )
    return end_with_error(span, error, RolloutStatus.TIMED_OUT, tracer_provider)


def halted_outcome(
    span: trace.Span, how: str, tracer_provider: trace.TracerProvider | None, reason: str | None = None
) -> Outcome:
    """The outcome of a rollout still running when the runner's grace period ran out: failed, or, when
    the runner was stopped on purpose with a ``reason`` (the run it served is over), cancelled."""
    if reason is not None:
        error = RuntimeError(f"cancelled: {reason}; the rollout was still running, and {how}")
        return end_with_error(span, error, RolloutStatus.CANCELLED, tracer_provider)
    error = RuntimeError(
        f"the runner was stopped before the agent finished (its grace period ran out) and {how}"
    )
    return end_with_error(span, error, RolloutStatus.FAILED, tracer_provider)
