"""Async mode: ``workers`` concurrent tasks on one event loop (on a thread of its own), for ``async def``
agents. A rollout past its timeout has its task cancelled. Store calls and span flushes, which block, run
on a small thread pool beside the loop.

An agent that blocks the event loop (a sync sleep or HTTP call inside ``async def``) holds up every
rollout of the runner, timeouts included; run such an agent in mode ``process``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from typing import Any

from ..records import Attempt, Rollout, RolloutStatus
from ..tracing import rollout_scope
from ._outcome import Outcome, halted_outcome, interpret, logger, timeout_outcome
from ._state import RunState

_SLICE_S = 0.1  # how often a waiting task looks at the stop signals
_CANCEL_WAIT_S = 1.0  # how long a cancelled agent may take to unwind before it is left behind


class AsyncEngine:
    def __init__(self, state: RunState) -> None:
        self.state = state
        self._thread = threading.Thread(target=self._run_loop, name="agl-runner-loop", daemon=True)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(64, state.workers + 4), thread_name_prefix="agl-runner-io"
        )

    def start(self) -> None:
        self._thread.start()

    def join(self, deadline: float) -> bool:
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def kill(self) -> None:
        pass

    def _run_loop(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - the loop thread reports, it must not vanish silently
            logger.error("agl runner: the event loop stopped: %r", exc)

    async def _main(self) -> None:
        prefix = uuid.uuid4().hex[:6]
        await asyncio.gather(*(self._slot(f"worker-{prefix}-{i}") for i in range(self.state.workers)))

    async def _io(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _slot(self, worker_id: str) -> None:
        state = self.state
        while not state.stopping.is_set():
            claimed = await self._io(state.claim, worker_id)
            if claimed is None:
                continue
            rollout, attempt = claimed
            outcome: Outcome | None = Outcome(
                RolloutStatus.FAILED, error="the runner failed before the agent ran"
            )
            try:
                outcome = await self._serve(rollout, attempt)
            except Exception as exc:  # the runner's own bug must not end the slot
                state.report_internal_error(worker_id, exc)
            finally:
                await self._io(state.finish, rollout, attempt, outcome)

    async def _serve(self, rollout: Rollout, attempt: Attempt) -> Outcome | None:
        state = self.state
        provider = state.tracer_provider
        loop = asyncio.get_running_loop()
        ended = asyncio.Event()
        with (
            state.heartbeats.keep(attempt.attempt_id, lambda status: loop.call_soon_threadsafe(ended.set)),
            rollout_scope(
                rollout.rollout_id, attempt.attempt_id, rollout.task_id, tracer_provider=provider
            ) as span,
        ):
            llm = await self._io(state.llm_for, rollout, attempt)
            if isinstance(llm, str):
                return interpret(None, RuntimeError(llm), provider)
            # The task copies this context: the agent runs inside the rollout.
            try:
                task = asyncio.ensure_future(state.agent(rollout.input, llm))
            except Exception as exc:  # e.g. a wrong signature: raised before any coroutine exists
                return interpret(None, exc, provider)
            deadline = state.deadline(time.monotonic())
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    how = await self._cancel(task, rollout)
                    assert state.rollout_timeout_s is not None
                    return timeout_outcome(span, state.rollout_timeout_s, how, provider)
                if state.halt.is_set():
                    return halted_outcome(
                        span, await self._cancel(task, rollout), provider, state.stop_reason
                    )
                if ended.is_set():  # cancelled or reclaimed in the store: stop the work
                    await self._cancel(task, rollout)
                    return None
                await asyncio.wait(
                    {task}, timeout=_SLICE_S if remaining is None else min(remaining, _SLICE_S)
                )
                if task.done():
                    break
            if task.cancelled():
                return interpret(None, asyncio.CancelledError("the agent's task was cancelled"), provider)
            error = task.exception()
            return interpret(None if error else task.result(), error, provider)

    @staticmethod
    async def _cancel(task: asyncio.Future[Any], rollout: Rollout) -> str:
        task.cancel()
        await asyncio.wait({task}, timeout=_CANCEL_WAIT_S)
        if not task.done():
            logger.warning(
                "agl runner: the agent of rollout %s ignored its cancellation; it is left running",
                rollout.rollout_id,
            )
            return "its task was cancelled, but it ignored the cancellation and runs on"
        if not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log it as never retrieved
        return "its task was cancelled"
