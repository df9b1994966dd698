"""What every runner mode shares: claiming work from the store, the rollout's LLM endpoint, heartbeats,
and reporting outcomes, all waiting out store outages."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from opentelemetry.sdk.trace import TracerProvider

from ..capture.agent_header import register_gateway
from ..records import Attempt, Resource, Rollout, RolloutStatus
from ..store.base import StoreError, StoreUnavailableError
from ..urls import rollout_base_url
from ._outcome import Outcome, failure_text, logger
from ._types import LLM, LLM_RESOURCE, RunnerCounts


class RunnerStore(Protocol):
    """What a runner uses of a store: every :class:`~agl_core.store.Store` backend and
    :class:`~agl_core.store.StoreClient` provide it (see :class:`~agl_core.store.Store` for the contract)."""

    def dequeue_rollout(self, worker_id: str, *, lease_s: float = 60.0) -> tuple[Rollout, Attempt] | None: ...

    def heartbeat(self, attempt_id: str, *, lease_s: float = 60.0) -> Attempt: ...

    def complete_attempt(
        self,
        attempt_id: str,
        status: RolloutStatus,
        *,
        reward: float | None = None,
        error: str | None = None,
    ) -> Rollout: ...

    def get_resource(self, name: str) -> Resource | None: ...


def _split_of(rollout: Rollout) -> str | None:
    split = (rollout.metadata or {}).get("split")
    return split if isinstance(split, str) else None


class Backoff:
    """Growing waits between retries against an unavailable store: 0.2 s doubling up to ``cap_s``."""

    def __init__(self, first_s: float = 0.2, cap_s: float = 5.0) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self._next = first_s

    def next(self) -> float:
        delay, self._next = self._next, min(self._next * 2, self.cap_s)
        return delay

    def reset(self) -> None:
        self._next = self.first_s


class Heartbeats:
    """One thread keeping the leases of a runner's running attempts alive. It notices when the store has
    ended an attempt (cancelled it, or timed it out after a missed lease) and calls the attempt's
    ``on_end`` once with the status the store gave it."""

    def __init__(self, store: RunnerStore, lease_s: float) -> None:
        self.store = store
        self.lease_s = lease_s
        self.interval_s = lease_s / 3
        self._attempts: dict[str, Callable[[RolloutStatus], object]] = {}
        self._ended: dict[str, RolloutStatus] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._failing = False  # warn once per streak of failed beats, not once per attempt and tick
        self._thread = threading.Thread(target=self._beat, name="agl-heartbeats", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    @contextlib.contextmanager
    def keep(
        self, attempt_id: str, on_end: Callable[[RolloutStatus], object] = lambda status: None
    ) -> Iterator[None]:
        """Keep the lease of ``attempt_id`` alive while the block runs. If the store ends the attempt in
        the meantime, ``on_end(status)`` is called once, on the heartbeat thread (its result is ignored)."""
        with self._lock:
            self._attempts[attempt_id] = on_end
        try:
            yield
        finally:
            with self._lock:
                self._attempts.pop(attempt_id, None)

    def ended_as(self, attempt_id: str) -> RolloutStatus | None:
        """The status the store ended this attempt with while it ran, or ``None``."""
        with self._lock:
            return self._ended.get(attempt_id)

    def forget(self, attempt_id: str) -> None:
        with self._lock:
            self._ended.pop(attempt_id, None)

    def _beat(self) -> None:
        while not self._closed.wait(self.interval_s):
            with self._lock:
                attempts = list(self._attempts.items())
            for attempt_id, on_end in attempts:
                try:
                    attempt = self.store.heartbeat(attempt_id, lease_s=self.lease_s)
                except Exception as exc:  # a missed beat is retried on the next tick
                    log = logger.debug if self._failing else logger.warning
                    self._failing = True
                    log(
                        "agl runner: heartbeat for attempt %s failed (%s); retrying every %.1f s",
                        attempt_id,
                        exc,
                        self.interval_s,
                    )
                    continue
                self._failing = False
                if attempt.status != RolloutStatus.RUNNING:
                    with self._lock:
                        if attempt_id not in self._attempts:
                            continue
                        self._attempts.pop(attempt_id)
                        self._ended[attempt_id] = attempt.status
                    try:
                        on_end(attempt.status)
                    except Exception as exc:  # the worker already moved on (its event loop closed)
                        logger.debug("agl runner: end callback of attempt %s failed: %s", attempt_id, exc)


#: How long an idle worker waits for its turn to ask the store before it returns to its loop (to see a stop
#: or a limit): the waiting workers wake this often, so it is not the poll interval (64 waiting workers
#: waking every 50 ms cost a 16-rollout step a third of its time on 2 cores).
TURN_WAIT_S = 0.5


class RunState:
    """What the workers of one runner share: the agent, the store, counters and the stop signals.

    ``stopping``: take no new rollouts. ``halt``: the grace period is over; end running rollouts now.
    """

    def __init__(
        self,
        agent: Callable[..., Any],
        store: RunnerStore,
        tracer_provider: TracerProvider,
        *,
        workers: int,
        rollout_timeout_s: float | None,
        poll_s: float,
        lease_s: float,
    ) -> None:
        self.agent = agent
        self.store = store
        self.tracer_provider = tracer_provider
        self.workers = workers
        self.rollout_timeout_s = rollout_timeout_s
        self.poll_s = poll_s
        self.lease_s = lease_s
        self.stopping = threading.Event()
        self.halt = threading.Event()
        #: Why the runner was stopped on purpose (``Runner.stop(reason=...)``): rollouts still running
        #: then are cancelled, not failed, and that is reported as such.
        self.stop_reason: str | None = None
        self.heartbeats = Heartbeats(store, lease_s)
        self._lock = threading.Lock()
        # the turn to ask the store for work: one idle worker at a time (see claim)
        self._turn = threading.Lock()
        # flushes, shared: one force_flush exports the spans of every worker that asked before it began
        self._flush_cond = threading.Condition()
        self._flushes_started = 0
        self._flushes_done = 0  # one flush at a time: a flush is running while started > done
        self._counts: dict[str, int] = {
            "succeeded": 0,
            "failed": 0,
            "timed_out": 0,
            "dropped": 0,
            "running": 0,
        }
        self._store_down_since: float | None = None

    # -- counters -------------------------------------------------------------------------------------
    def counts(self) -> RunnerCounts:
        with self._lock:
            return RunnerCounts(**self._counts)

    def _add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    # -- store access with back-off -----------------------------------------------------------------
    def _store_failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            first = self._store_down_since is None
            if first:
                self._store_down_since = time.monotonic()
        if first:
            logger.warning(
                "agl runner: %s failed (%s); retrying with back-off until the store answers", what, exc
            )
        else:
            logger.debug("agl runner: %s failed again: %s", what, exc)

    def _store_ok(self) -> None:
        if self._store_down_since is None:
            return
        with self._lock:
            since, self._store_down_since = self._store_down_since, None
        if since is not None:
            logger.warning("agl runner: the store answers again after %.1f s", time.monotonic() - since)

    def claim(self, worker_id: str) -> tuple[Rollout, Attempt] | None:
        """Dequeue one rollout for ``worker_id``; ``None`` when nothing is queued (after waiting a poll
        interval) or the runner is stopping. Store failures are waited out, never raised.

        Idle workers take turns: one asks the store while the others wait for the turn. A worker that finds
        the queue empty keeps the turn through its poll interval, so an idle runner asks the store once per
        ``poll_s`` however many workers it has (every worker polling on its own, 128 idle workers sent 2,500
        requests a second to the store, starving the agents and the model of the CPU); one that gets a
        rollout passes the turn on at once, so a burst of queued rollouts is taken as fast as the store
        answers, one after another."""
        backoff = Backoff()
        while not self.stopping.is_set():
            if not self._turn.acquire(timeout=max(self.poll_s, TURN_WAIT_S)):
                return None  # another worker is asking; the caller comes back
            try:
                try:
                    claimed = self.store.dequeue_rollout(worker_id, lease_s=self.lease_s)
                except Exception as exc:  # the store is down or refused: back off, never die
                    self._store_failed("taking a rollout from the store", exc)
                    self.stopping.wait(backoff.next())  # holding the turn: one worker probes the store
                    continue
                self._store_ok()
                if claimed is None:
                    self.stopping.wait(self.poll_s)
                    return None
            finally:
                self._turn.release()
            self._add("running")
            return claimed
        return None

    def llm_for(self, rollout: Rollout, attempt: Attempt) -> LLM | str:
        """The rollout's LLM endpoint, or a message saying why there is none. Waits out store outages."""
        backoff = Backoff()
        while True:
            try:
                resource = self.store.get_resource(LLM_RESOURCE)
                break
            except StoreUnavailableError as exc:
                if self.halt.is_set():
                    return f"the store could not be reached to read the {LLM_RESOURCE!r} resource: {exc}"
                self._store_failed("reading the LLM endpoint", exc)
                self.halt.wait(backoff.next())
            except Exception as exc:
                return f"the store did not give the {LLM_RESOURCE!r} resource: {type(exc).__name__}: {exc}"
        self._store_ok()
        value = resource.value if resource is not None else None
        if not isinstance(value, dict) or "base_url" not in value or "model" not in value:
            return (
                f"the store has no usable {LLM_RESOURCE!r} resource (got {value!r:.200}); the trainer "
                "publishes it ({'base_url': ..., 'model': ...}) when it starts"
            )
        # The adapters may name the calling agent (x-agl-agent-name) on requests to this gateway only.
        with contextlib.suppress(ValueError):  # not an http(s) URL: the agent's client will say so
            register_gateway(value["base_url"])
        return LLM(
            base_url=rollout_base_url(value["base_url"], rollout.rollout_id, attempt.attempt_id),
            model=value["model"],
            # the gateway's token when it asks for one (a gateway other machines reach)
            api_key=str(value.get("api_key") or "agl"),
            policy_version=value.get("policy_version"),
            split=_split_of(rollout),
        )

    def flush(self) -> None:
        """Export every span ended before this call. Workers finishing together share one export: a
        flush that began before the call does not count (it may have missed this worker's spans), and
        the next one covers every worker that asked meanwhile, so a burst of finishing rollouts costs
        two exports, not one each."""
        with self._flush_cond:
            needed = self._flushes_started + 1
            while self._flushes_done < needed:
                if self._flushes_started > self._flushes_done:  # another worker's flush is running
                    self._flush_cond.wait()
                    continue
                self._flushes_started += 1
                number = self._flushes_started
                self._flush_cond.release()
                try:
                    self.tracer_provider.force_flush()
                except Exception as exc:
                    logger.warning("agl runner: flushing spans failed: %s", exc)
                finally:
                    self._flush_cond.acquire()
                    self._flushes_done = number
                    self._flush_cond.notify_all()

    def finish(self, rollout: Rollout, attempt: Attempt, outcome: Outcome | None) -> None:
        """Flush the spans, then report ``outcome`` to the store (``None``: the result is dropped). A
        store outage is waited out until the runner halts."""
        try:
            self._finish(rollout, attempt, outcome)
        finally:
            self.heartbeats.forget(attempt.attempt_id)
            self._add("running", -1)

    def _finish(self, rollout: Rollout, attempt: Attempt, outcome: Outcome | None) -> None:
        self.flush()
        ended = self.heartbeats.ended_as(attempt.attempt_id)
        if outcome is None or ended is not None:
            # a cancelled rollout is one the trainer no longer needs (a step's deadline, the end of an
            # asynchronous run): expected, so not a warning
            logger.log(
                logging.INFO if ended == RolloutStatus.CANCELLED else logging.WARNING,
                "agl runner: rollout %s attempt %s was ended as %s by the store while the agent ran; its"
                " result is dropped",
                rollout.rollout_id,
                attempt.attempt_id,
                ended.value if ended else "finished",
            )
            self._add("dropped")
            return
        backoff = Backoff()
        unexpected = 0
        while True:
            try:
                self.store.complete_attempt(
                    attempt.attempt_id, outcome.status, reward=outcome.reward, error=outcome.error
                )
                break
            except StoreError as exc:
                if not isinstance(exc, StoreUnavailableError):  # e.g. cancelled or reclaimed in the meantime
                    logger.log(
                        logging.INFO if "as 'cancelled'" in str(exc) else logging.WARNING,
                        "agl runner: the store did not take the result of attempt %s: %s",
                        attempt.attempt_id,
                        exc,
                    )
                    self._add("dropped")
                    return
                error: BaseException = exc
            except Exception as exc:  # an in-process store's own error (a locked database): retry a few times
                unexpected += 1
                error = exc
            if self.halt.is_set() or unexpected > 5:
                logger.error(
                    "agl runner: could not report attempt %s as %s (%s); the store times it out when its"
                    " lease runs out",
                    attempt.attempt_id,
                    outcome.status.value,
                    error,
                )
                return
            self._store_failed(f"reporting attempt {attempt.attempt_id}", error)
            self.halt.wait(backoff.next())
        self._store_ok()
        key = {RolloutStatus.SUCCEEDED: "succeeded", RolloutStatus.TIMED_OUT: "timed_out"}.get(
            outcome.status, "failed"
        )
        self._add(key)

    def deadline(self, start: float) -> float | None:
        return None if self.rollout_timeout_s is None else start + self.rollout_timeout_s

    def report_internal_error(self, worker_id: str, exc: BaseException) -> None:
        logger.error(
            "agl runner: worker %s hit an internal error and goes on: %s", worker_id, failure_text(exc)
        )
