"""Process mode: each worker slot owns a worker process (spawned) that runs the agent.

The slot, in the runner's process, claims the rollout, keeps its lease, opens its ``agl.rollout`` span and
sends the job to its worker process; the worker process runs the agent under that span, writes the
reward or error span through its own OTLP tracer provider, flushes it and answers with the outcome. Store
coordination stays with the slot, so an attempt is always reported even when the worker dies:

* past the rollout timeout the slot kills the worker (its whole process group), records ``timed_out``
  with an ``agl.error`` span of type ``RolloutTimeout``, and starts a fresh worker for the next rollout;
* a worker that dies (segfault, ``os._exit``) fails the attempt with a message and is replaced;
* a rollout cancelled in the store while it runs gets its worker killed and replaced too.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from ..records import Attempt, Rollout, RolloutStatus
from ..tracing import RolloutContext, rollout_scope
from ._engine import SlotThreads
from ._outcome import Outcome, end_with_error, halted_outcome, interpret, logger, timeout_outcome
from ._state import Backoff, RunState
from ._worker import worker_main

_SLICE_S = 0.1  # how often a waiting slot looks at the stop signals
_READY_TIMEOUT_S = 120.0  # a worker process must import the agent within this


class _Worker:
    """One worker process and the runner's end of its pipe."""

    def __init__(self, process: BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self._killed = False

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None  # wrapped only once started
        return pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        """Kill the worker and every process it started (its process group), and reap it."""
        if self._killed:
            return
        self._killed = True
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (AttributeError, ProcessLookupError, PermissionError, OSError):
            self.process.kill()
        self.process.join(10.0)
        self.conn.close()

    def close(self) -> None:
        """Ask the worker to exit; kill it if it does not within a second."""
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(1.0)
        if self.process.is_alive():
            self.kill()
        else:
            self.conn.close()

    def death_note(self) -> str:
        self.process.join(5.0)
        code = self.process.exitcode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how = f"was killed by {name}"
        else:
            how = f"exited with code {code}"
        return (
            f"the worker process running the agent (pid {self.pid}) {how} before the agent returned"
            " (os._exit, a crash in native code, or killed from outside); a new worker process takes the next"
            " rollout"
        )


class ProcessEngine:
    def __init__(self, state: RunState, *, otlp_endpoint: str, token: str | None) -> None:
        self.state = state
        self.otlp_endpoint = otlp_endpoint
        self.token = token
        self._context = multiprocessing.get_context("spawn")
        self._slots = SlotThreads()
        self._workers: dict[str, _Worker] = {}
        self._lock = threading.Lock()

    def start(self) -> None:
        # multiprocessing marks a spawned process while it imports the parent's main module; a runner
        # started then comes from a script without an entry-point guard and would spawn without end.
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            raise RuntimeError(
                "a process-mode runner was started while a worker process imported the main module: guard "
                "the script's entry point with 'if __name__ == \"__main__\":'"
            )
        self._slots.start(self.state.workers, self._slot)

    def join(self, deadline: float) -> bool:
        return self._slots.join(deadline)

    def close(self) -> None:
        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
        for worker in workers:
            worker.close()

    def kill(self) -> None:
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.kill()

    def _spawn(self, worker_id: str) -> _Worker | None:
        """Start a worker process and wait until it has imported the agent; ``None`` if it failed."""
        mine, theirs = self._context.Pipe()
        process = self._context.Process(
            target=worker_main,
            args=(theirs, self.state.agent, self.otlp_endpoint, self.token),
            name=f"agl-{worker_id}",
            daemon=True,
        )
        try:
            process.start()
        except Exception as exc:
            logger.error("agl runner: cannot start a worker process for %s: %s", worker_id, exc)
            mine.close()
            theirs.close()
            return None
        theirs.close()
        worker = _Worker(process, mine)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline and not self.state.stopping.is_set():
            ready = wait([mine, process.sentinel], _SLICE_S)
            if mine in ready:
                try:
                    if mine.recv() == "ready":
                        with self._lock:
                            self._workers[worker_id] = worker
                        return worker
                except (EOFError, OSError):
                    pass
                break
            if process.sentinel in ready:
                break
        if not self.state.stopping.is_set():
            process.join(1.0)
            how = (
                "is not ready in time" if process.exitcode is None else f"exited with code {process.exitcode}"
            )
            logger.error(
                "agl runner: the worker process for %s %s before it was ready; its error is printed above",
                worker_id,
                how,
            )
        worker.kill()
        return None

    def _drop(self, worker_id: str, worker: _Worker) -> None:
        with self._lock:
            if self._workers.get(worker_id) is worker:
                del self._workers[worker_id]
        worker.kill()

    def _slot(self, worker_id: str) -> None:
        state = self.state
        worker: _Worker | None = None
        backoff = Backoff(first_s=1.0, cap_s=30.0)
        while not state.stopping.is_set():
            if worker is None or not worker.alive():
                if worker is not None:
                    self._drop(worker_id, worker)
                try:
                    worker = self._spawn(worker_id)
                except Exception as exc:  # the runner's own bug must not kill the slot
                    state.report_internal_error(worker_id, exc)
                    worker = None
                if worker is None:
                    state.stopping.wait(backoff.next())
                    continue
                backoff.reset()
            claimed = state.claim(worker_id)
            if claimed is None:
                continue
            rollout, attempt = claimed
            outcome: Outcome | None = Outcome(
                RolloutStatus.FAILED, error="the runner failed before the agent ran"
            )
            try:
                outcome, keep = self._serve(worker, rollout, attempt)
                if not keep:
                    self._drop(worker_id, worker)
                    worker = None
            except Exception as exc:  # the runner's own bug must not kill the slot
                state.report_internal_error(worker_id, exc)
            finally:
                state.finish(rollout, attempt, outcome)
        if worker is not None:
            with self._lock:
                self._workers.pop(worker_id, None)
            worker.close()

    def _serve(self, worker: _Worker, rollout: Rollout, attempt: Attempt) -> tuple[Outcome | None, bool]:
        """Run one rollout on ``worker``; returns the outcome and whether the worker may be kept."""
        state = self.state
        provider = state.tracer_provider
        ended = threading.Event()
        with (
            state.heartbeats.keep(attempt.attempt_id, lambda status: ended.set()),
            rollout_scope(
                rollout.rollout_id, attempt.attempt_id, rollout.task_id, tracer_provider=provider
            ) as span,
        ):
            llm = state.llm_for(rollout, attempt)
            if isinstance(llm, str):
                return interpret(None, RuntimeError(llm), provider), True
            context = span.get_span_context()
            job = (
                RolloutContext(rollout.rollout_id, attempt.attempt_id, rollout.task_id),
                context.trace_id,
                context.span_id,
                rollout.input,
                llm,
            )
            try:
                worker.conn.send(job)
            except (BrokenPipeError, OSError):
                return end_with_error(
                    span, ChildProcessError(worker.death_note()), RolloutStatus.FAILED, provider
                ), False
            deadline = state.deadline(time.monotonic())
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                timeout = _SLICE_S if remaining is None else max(0.0, min(remaining, _SLICE_S))
                ready = wait([worker.conn, worker.process.sentinel], timeout)
                if worker.conn in ready:
                    try:
                        return worker.conn.recv(), True
                    except (EOFError, OSError):
                        ready = [worker.process.sentinel]
                if worker.process.sentinel in ready:
                    return end_with_error(
                        span, ChildProcessError(worker.death_note()), RolloutStatus.FAILED, provider
                    ), False
                if remaining is not None and remaining <= 0:
                    worker.kill()
                    assert state.rollout_timeout_s is not None
                    return timeout_outcome(
                        span, state.rollout_timeout_s, "its worker process was killed", provider
                    ), False
                if state.halt.is_set():
                    worker.kill()
                    return (
                        halted_outcome(span, "its worker process was killed", provider, state.stop_reason),
                        False,
                    )
                if ended.is_set():  # cancelled or reclaimed in the store: stop the work for real
                    worker.kill()
                    return None, False
