"""The runner: pulls queued rollouts from the store and runs the user's agent on them.

An agent is a plain function ``agent(task, llm) -> float | None``: ``task`` is the task's input (what the
dataset holds), ``llm`` tells it which OpenAI-compatible endpoint and model to use. Returning a number
records it as the episode reward; an agent may instead call :func:`agl_core.emit_reward` itself. An
exception fails the attempt (with its traceback) and never stops the runner.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
import threading
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from .gateway.app import rollout_base_url
from .records import Attempt, Rollout, RolloutStatus
from .store.base import Store, StoreError
from .tracing import emit_error, emit_reward, rollout_scope

__all__ = ["LLM", "LLM_RESOURCE", "Runner", "load_agent"]

logger = logging.getLogger(__name__)

#: Name of the store resource holding the gateway endpoint: ``{"base_url": str, "model": str}``.
LLM_RESOURCE = "llm"


@dataclasses.dataclass(frozen=True)
class LLM:
    """Where the agent sends its LLM calls during a rollout."""

    base_url: str
    model: str
    api_key: str = "agl"
    policy_version: int | None = None


AgentFn = Callable[[Any, LLM], Any]


def load_agent(spec: str, *, search_paths: tuple[Path, ...] = ()) -> AgentFn:
    """Import ``module:function``. ``search_paths`` are tried before ``sys.path``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"agent must be given as 'module:function', got {spec!r}")
    for path in reversed(search_paths):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import agent module {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"module {module_name!r} has no callable {attr!r}")
    return fn


class Runner:
    """Runs ``agent`` on queued rollouts in ``workers`` threads until :meth:`stop`.

    Spans go through ``tracer_provider``; after each rollout the provider is flushed, so by the time the
    store reports a rollout finished, its spans are stored.
    """

    def __init__(
        self,
        agent: AgentFn,
        store: Store,
        tracer_provider: TracerProvider,
        *,
        workers: int = 1,
        poll_s: float = 0.05,
        lease_s: float = 60.0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.agent = agent
        self.store = store
        self.tracer_provider = tracer_provider
        self.workers = workers
        self.poll_s = poll_s
        self.lease_s = lease_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._flush_lock = threading.Lock()

    def start(self) -> Runner:
        for i in range(self.workers):
            worker_id = f"worker-{uuid.uuid4().hex[:6]}-{i}"
            thread = threading.Thread(target=self._loop, args=(worker_id,), name=worker_id, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        self._threads.clear()

    def _loop(self, worker_id: str) -> None:
        while not self._stop.is_set():
            try:
                claimed = self.store.dequeue_rollout(worker_id, lease_s=self.lease_s)
            except StoreError as exc:
                logger.warning("agl runner %s: cannot dequeue: %s", worker_id, exc)
                self._stop.wait(1.0)
                continue
            if claimed is None:
                self._stop.wait(self.poll_s)
                continue
            try:
                self.run_one(*claimed)
            except StoreError as exc:  # e.g. the rollout was cancelled between the last heartbeat and the end
                logger.warning("agl runner %s: cannot report rollout %s: %s", worker_id, claimed[0].rollout_id, exc)

    def run_one(self, rollout: Rollout, attempt: Attempt) -> Rollout:
        """Run the agent on one claimed rollout and report the outcome to the store."""
        resource = self.store.get_resource(LLM_RESOURCE)
        if resource is None:
            raise StoreError(f"the store has no {LLM_RESOURCE!r} resource; the trainer publishes it at start")
        llm = LLM(
            base_url=rollout_base_url(resource.value["base_url"], rollout.rollout_id, attempt.attempt_id),
            model=resource.value["model"],
            policy_version=resource.value.get("policy_version"),
        )
        status, reward, error = RolloutStatus.SUCCEEDED, None, None
        beating = _Heartbeat(self.store, attempt.attempt_id, self.lease_s)
        with beating, rollout_scope(
            rollout.rollout_id, attempt.attempt_id, rollout.task_id, tracer_provider=self.tracer_provider
        ):
            try:
                result = self.agent(rollout.input, llm)
                if result is not None:
                    reward = float(result)
                    emit_reward(reward, tracer_provider=self.tracer_provider)
            except Exception as exc:  # the agent's failure is data, not a crash
                status = RolloutStatus.FAILED
                error = "".join(traceback.format_exception(exc))[-8000:]
                emit_error(exc, tracer_provider=self.tracer_provider)
        with self._flush_lock:
            self.tracer_provider.force_flush()
        if beating.stopped_as is not None:
            logger.warning(
                "agl runner: rollout %s ended as %s while the agent ran; its result is dropped",
                rollout.rollout_id, beating.stopped_as.value,
            )
            return self.store.get_rollouts([rollout.rollout_id])[0]
        return self.store.complete_attempt(attempt.attempt_id, status, reward=reward, error=error)


class _Heartbeat:
    """Keeps an attempt's lease alive from a background thread while the agent runs, and notices when
    the store has ended the attempt (cancelled, or reclaimed after a missed lease)."""

    def __init__(self, store: Store, attempt_id: str, lease_s: float) -> None:
        self.store = store
        self.attempt_id = attempt_id
        self.interval_s = lease_s / 3
        self.lease_s = lease_s
        self.stopped_as: RolloutStatus | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"agl-heartbeat-{attempt_id}", daemon=True)

    def _beat(self) -> None:
        while not self._done.wait(self.interval_s):
            try:
                attempt = self.store.heartbeat(self.attempt_id, lease_s=self.lease_s)
            except StoreError as exc:
                logger.warning("agl runner: heartbeat for %s failed: %s", self.attempt_id, exc)
                continue
            if attempt.status != RolloutStatus.RUNNING:
                self.stopped_as = attempt.status
                return

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
