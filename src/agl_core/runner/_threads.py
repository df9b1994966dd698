"""Thread mode: each worker slot runs every rollout's agent in a fresh thread and waits for it.

A thread cannot be stopped from outside. When a rollout runs past its timeout, the slot records it as
timed out at once and goes on with the next rollout; the agent's thread runs on detached and whatever it
returns later is dropped. ``max_abandoned`` bounds how many such threads may pile up: at the bound, slots
wait for one to end before taking more work.
"""

from __future__ import annotations

import contextvars
import threading
import time
from typing import Any

from ..records import Attempt, Rollout, RolloutStatus
from ..tracing import rollout_scope
from ._engine import SlotThreads
from ._outcome import Outcome, call_agent, halted_outcome, interpret, logger, timeout_outcome
from ._state import RunState

_SLICE_S = 0.1  # how often a waiting slot looks at the stop signals


class _AgentCall:
    """One agent call on its own thread; the slot and the thread agree under a lock on who reports."""

    def __init__(self, engine: ThreadEngine, rollout: Rollout) -> None:
        self.engine = engine
        self.rollout = rollout
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.abandoned_at: float | None = None
        self._lock = threading.Lock()

    def run(self, agent: Any, llm: Any) -> None:
        result, error = call_agent(agent, self.rollout.input, llm)
        with self._lock:
            abandoned_at = self.abandoned_at
            if abandoned_at is None:
                self.result, self.error = result, error
                self.done.set()
        if abandoned_at is not None:
            logger.warning(
                "agl runner: the agent of rollout %s returned %.1f s after it was timed out; its result is"
                " dropped",
                self.rollout.rollout_id,
                time.monotonic() - abandoned_at,
            )
            self.engine.abandoned_ended()

    def wait(self, deadline: float | None, halt: threading.Event) -> str:
        """``"done"``, ``"timeout"`` or ``"halt"``; in the last two cases the call is abandoned."""
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                ended = "timeout"
            elif halt.is_set():
                ended = "halt"
            elif self.done.wait(_SLICE_S if remaining is None else min(remaining, _SLICE_S)):
                return "done"
            else:
                continue
            with self._lock:
                if self.done.is_set():
                    return "done"
                self.abandoned_at = time.monotonic()
                self.engine.abandoned_started()
            return ended


class ThreadEngine:
    def __init__(self, state: RunState, *, max_abandoned: int) -> None:
        self.state = state
        self.max_abandoned = max_abandoned
        self._slots = SlotThreads()
        self._lock = threading.Lock()
        self._abandoned = 0
        self._waiting_noted = False

    def start(self) -> None:
        self._slots.start(self.state.workers, self._slot)

    def join(self, deadline: float) -> bool:
        return self._slots.join(deadline)

    def close(self) -> None:
        with self._lock:
            if self._abandoned and self.state.stop_reason is not None:
                logger.info(
                    "agl runner: %d cancelled agent thread(s) are still running (%s); Python cannot stop a"
                    " thread, so they end with the process",
                    self._abandoned,
                    self.state.stop_reason,
                )
            elif self._abandoned:
                logger.warning(
                    "agl runner: %d timed-out agent thread(s) are still running; they are left behind",
                    self._abandoned,
                )

    def kill(self) -> None:
        pass  # threads cannot be stopped; the process exiting ends them

    def abandoned_started(self) -> None:
        with self._lock:
            self._abandoned += 1

    def abandoned_ended(self) -> None:
        with self._lock:
            self._abandoned -= 1

    def _room_for_work(self, worker_id: str) -> bool:
        with self._lock:
            full = self._abandoned > 0 and self._abandoned >= self.max_abandoned
            note = full and not self._waiting_noted
            self._waiting_noted = full
        if note:
            logger.warning(
                "agl runner: %d timed-out agent thread(s) are still running (the limit is %d); worker %s"
                " waits for one to end before taking more work. Threads cannot be stopped: run hanging agents"
                " in mode 'process', where they are killed at the timeout",
                self._abandoned,
                self.max_abandoned,
                worker_id,
            )
        return not full

    def _slot(self, worker_id: str) -> None:
        state = self.state
        while not state.stopping.is_set():
            if not self._room_for_work(worker_id):
                state.stopping.wait(state.poll_s)
                continue
            claimed = state.claim(worker_id)
            if claimed is None:
                continue
            rollout, attempt = claimed
            outcome: Outcome | None = Outcome(
                RolloutStatus.FAILED, error="the runner failed before the agent ran"
            )
            try:
                outcome = self._serve(rollout, attempt)
            except Exception as exc:  # the runner's own bug must not kill the worker
                state.report_internal_error(worker_id, exc)
            finally:
                state.finish(rollout, attempt, outcome)

    def _serve(self, rollout: Rollout, attempt: Attempt) -> Outcome | None:
        state = self.state
        provider = state.tracer_provider
        with (
            state.heartbeats.keep(attempt.attempt_id),
            rollout_scope(
                rollout.rollout_id, attempt.attempt_id, rollout.task_id, tracer_provider=provider
            ) as span,
        ):
            llm = state.llm_for(rollout, attempt)
            if isinstance(llm, str):
                return interpret(None, RuntimeError(llm), provider)
            call = _AgentCall(self, rollout)
            context = contextvars.copy_context()  # the rollout's identity travels with the agent's thread
            thread = threading.Thread(
                target=context.run,
                args=(call.run, state.agent, llm),
                name=f"agl-agent-{rollout.rollout_id}",
                daemon=True,
            )
            thread.start()
            ended = call.wait(state.deadline(time.monotonic()), state.halt)
            if ended == "done":
                return interpret(call.result, call.error, provider)
            if ended == "timeout":
                assert state.rollout_timeout_s is not None
                return timeout_outcome(
                    span, state.rollout_timeout_s, "its thread was left running detached", provider
                )
            return halted_outcome(span, "its thread was left running detached", provider, state.stop_reason)
