"""Rollouts through the store: a round of them queued, waited for and cut off at the step deadline, and
the held-out scorer built on it (the trainer's validation and ``agl eval`` both score with
:func:`score_tasks`).

Nothing here imports torch: the store is reached through :class:`RolloutClient` (a
:class:`~agl_core.store.StoreClient` is one), progress through :class:`Progress`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from agl_core.pipeline.transitions import episode_rewards
from agl_core.records import Rollout, RolloutStatus, Span, Task

from ..cpu import release_openmp_threads
from ..reporting.results import EvalResult
from ..stats import mean_se

__all__ = [
    "PatientClient",
    "Progress",
    "RolloutClient",
    "RolloutQueue",
    "RolloutRound",
    "Scored",
    "ScoredRollout",
    "rollout_rewards",
    "score_tasks",
    "wait_for_store",
]


class RolloutClient(Protocol):
    """What rollouts need of the store (:class:`~agl_core.store.StoreClient` has it all)."""

    def enqueue_rollouts(self, requests: Iterable[dict[str, Any]]) -> list[Rollout]: ...

    def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]: ...

    def cancel_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]: ...

    def all_spans(self, rollout_ids: Sequence[str]) -> list[Span]: ...

    def mark_consumed(self, rollout_ids: Sequence[str]) -> int: ...


T = TypeVar("T")


def wait_for_store(
    call: Callable[[], T], *, patience_s: float, warn: Callable[[str], None] | None = None
) -> T:
    """``call()``, tried again with backoff while the store is unreachable
    (:class:`~agl_core.store.StoreUnavailableError`, a store restarting) for up to ``patience_s`` seconds,
    then raising; other errors go through at once. ``warn`` gets a line when the store first fails and
    one when it answers again."""
    from agl_core.store import StoreUnavailableError

    deadline = time.monotonic() + patience_s
    delay = 0.25
    warned = False
    while True:
        try:
            result = call()
        except StoreUnavailableError as exc:
            if time.monotonic() + delay > deadline:
                raise
            if not warned and warn is not None:
                warn(f"  the store is unreachable ({exc}); retrying up to {patience_s:g} s")
                warned = True
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
            continue
        if warned and warn is not None:
            warn("  the store is back")
        return result


class PatientClient:
    """A :class:`RolloutClient` that waits out a store restart: a call that finds the store unreachable
    (:class:`~agl_core.store.StoreUnavailableError`) is tried again, with backoff, for up to
    ``patience_s`` seconds, then raises. Other errors go through at once.

    Retrying ``enqueue_rollouts`` after a request that reached the store but lost its answer queues the
    rollouts twice; the ones the trainer did not get ids for are run by the runners and never trained on.
    """

    def __init__(
        self, client: RolloutClient, *, patience_s: float = 300.0, warn: Callable[[str], None] | None = None
    ) -> None:
        self.client = client
        self.patience_s = patience_s
        self._warn = warn

    def _call(self, name: str, *args: Any) -> Any:
        return wait_for_store(
            lambda: getattr(self.client, name)(*args), patience_s=self.patience_s, warn=self._warn
        )

    def enqueue_rollouts(self, requests: Iterable[dict[str, Any]]) -> list[Rollout]:
        return self._call("enqueue_rollouts", list(requests))  # type: ignore[no-any-return]

    def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        return self._call("get_rollouts", rollout_ids)  # type: ignore[no-any-return]

    def cancel_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        return self._call("cancel_rollouts", rollout_ids)  # type: ignore[no-any-return]

    def all_spans(self, rollout_ids: Sequence[str]) -> list[Span]:
        return self._call("all_spans", rollout_ids)  # type: ignore[no-any-return]

    def mark_consumed(self, rollout_ids: Sequence[str]) -> int:
        return self._call("mark_consumed", rollout_ids)  # type: ignore[no-any-return]


class Progress(Protocol):
    """Where a job shows what it does (:class:`~agl_trainer.reporting.display.Display` is one)."""

    def line(self, text: str) -> None: ...

    def rollouts(self, label: str, done: int, failed: int, total: int) -> None: ...


@dataclasses.dataclass(frozen=True)
class RolloutRound:
    """The rollouts of one round, by how they ended: succeeded, failed (or timed out), still running at the
    deadline (then cancelled)."""

    done: list[Rollout]
    failed: list[Rollout]
    late: list[Rollout]

    def __add__(self, other: RolloutRound) -> RolloutRound:
        return RolloutRound(self.done + other.done, self.failed + other.failed, self.late + other.late)

    @property
    def finished_ids(self) -> list[str]:
        """Rollout ids of the succeeded and failed rollouts (the ones whose spans are complete)."""
        return [r.rollout_id for r in [*self.done, *self.failed]]


class RolloutQueue:
    """Runs rounds of rollouts through the store for the workers to pick up.

    ``flush`` is called once a round is over, before its spans are read (the gateway batches its spans;
    the runner flushes the agent's before completing). ``inflight``, when given, is a file naming the
    round's rollouts while it runs, so a run killed mid-round can cancel them when resumed
    (:meth:`cancel_inflight`).
    """

    def __init__(
        self,
        client: RolloutClient,
        progress: Progress,
        *,
        step_timeout_s: float,
        flush: Callable[[], object] = lambda: None,
        inflight: Path | None = None,
        run: str | None = None,
    ) -> None:
        self.client = client
        #: The training run (its output folder's name) every rollout queued here is tagged with
        #: (``metadata["run"]``), so a store shared by runs tells them apart.
        self.run_name = run
        self.progress = progress
        self.step_timeout_s = step_timeout_s
        self._flush = flush
        self._inflight = inflight
        #: The rollouts in flight, by who started them (a round, the asynchronous pipeline).
        self._inflight_ids: dict[str, list[str]] = {}

    def tagged(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``requests`` with the run's name in their metadata (when the queue has one)."""
        if self.run_name is None:
            return requests
        return [{**r, "metadata": {**(r.get("metadata") or {}), "run": self.run_name}} for r in requests]

    def flush(self) -> None:
        """Export the spans buffered for the store (the gateway's), before reading finished rollouts'."""
        self._flush()

    def note_inflight(self, owner: str, rollout_ids: Sequence[str]) -> None:
        """Record ``owner``'s rollouts in flight (all of them; empty when none) in the ``inflight`` file,
        beside other owners', so a run killed now can cancel them when resumed."""
        if rollout_ids:
            self._inflight_ids[owner] = list(rollout_ids)
        else:
            self._inflight_ids.pop(owner, None)
        if self._inflight is None:
            return
        ids = [rid for owned in self._inflight_ids.values() for rid in owned]
        if ids:
            tmp = self._inflight.with_suffix(".tmp")
            tmp.write_text(json.dumps({"rollout_ids": ids}))
            tmp.replace(self._inflight)
        else:
            self._inflight.unlink(missing_ok=True)

    def run(
        self, label: str, requests: list[dict[str, Any]], *, while_progressing: bool = False
    ) -> RolloutRound:
        """Enqueue ``requests``, wait until all are done or ``step_timeout_s`` passed, cancel the rest.
        ``while_progressing`` (a held-out pass, whose score must not depend on the machine's speed): wait
        as long as rollouts keep finishing, and cancel the rest only after ``step_timeout_s`` in which
        none did."""
        release_openmp_threads()  # this thread waits while generation computes (agl_trainer.cpu)
        queued = self.client.enqueue_rollouts(self.tagged(requests))
        ids = [r.rollout_id for r in queued]
        self.note_inflight("round", ids)
        deadline = time.monotonic() + self.step_timeout_s
        seen = 0
        while True:
            rollouts = self.client.get_rollouts(ids)
            ok = sum(r.status == RolloutStatus.SUCCEEDED for r in rollouts)
            bad = sum(r.status.finished and r.status != RolloutStatus.SUCCEEDED for r in rollouts)
            self.progress.rollouts(label, ok, bad, len(ids))
            if while_progressing and ok + bad > seen:
                seen, deadline = ok + bad, time.monotonic() + self.step_timeout_s
            if ok + bad == len(ids) or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
        late = [r for r in rollouts if not r.status.finished]
        if late:
            self.client.cancel_rollouts([r.rollout_id for r in late])
        self._flush()
        self.note_inflight("round", [])
        done = [r for r in rollouts if r.status == RolloutStatus.SUCCEEDED]
        failed = [r for r in rollouts if r.status.finished and r.status != RolloutStatus.SUCCEEDED]
        for r in failed[:3]:
            # the runner stores the root cause on the error's first line, the traceback after it
            cause = error_line(r.attempts[-1].error if r.attempts else None)
            self.progress.line(f"  rollout {r.rollout_id} {r.status.value}: {cause}")
        if len(failed) > 3:
            self.progress.line(f"  ... and {len(failed) - 3} more failed rollouts (agl inspect ROLLOUT_ID)")
        if late:
            waited = "with none finishing for" if while_progressing else "after"
            limit = f"runner.step_timeout_s={self.step_timeout_s:g}s"
            self.progress.line(f"  {len(late)} rollouts were not done {waited} {limit} and were cancelled")
        return RolloutRound(done, failed, late)

    def cancel_inflight(self) -> None:
        """Cancel the rollouts of a round a killed run left in flight (named in the ``inflight`` file)."""
        path = self._inflight
        if path is None or not path.is_file():
            return
        ids = json.loads(path.read_text()).get("rollout_ids", [])
        if ids:
            self.client.cancel_rollouts(ids)
            self.progress.line(f"cancelled {len(ids)} rollouts left over from the interrupted step")
        path.unlink()


def rollout_rewards(
    done: Sequence[Rollout], spans_of: Callable[[list[str]], Sequence[Span]]
) -> dict[str, float]:
    """Episode reward of each succeeded rollout: the value the runner recorded, or (for agents that call
    ``emit_reward`` themselves) the one in its spans (``spans_of(rollout_ids)``)."""
    out = {r.rollout_id: r.reward for r in done if r.reward is not None}
    missing = [r.rollout_id for r in done if r.reward is None]
    if missing:
        from_spans = episode_rewards(spans_of(missing))
        out.update({rid: v for rid, v in from_spans.items() if math.isfinite(v)})
    return out


@dataclasses.dataclass(frozen=True)
class ScoredRollout:
    """One scored rollout: its reward, 0 for a failed or late one (``status`` says which)."""

    rollout_id: str
    task_id: str
    status: RolloutStatus
    reward: float


@dataclasses.dataclass(frozen=True)
class Scored:
    """:func:`score_tasks`' answer: the score, every rollout behind it (in task order), and, when asked
    for, each rollout's spans by rollout id."""

    result: EvalResult
    rollouts: list[ScoredRollout]
    spans: dict[str, list[Span]]


def score_tasks(
    queue: RolloutQueue,
    tasks: Sequence[Task],
    *,
    step: int,
    rollouts_per_task: int,
    max_attempts: int,
    split: str = "val",
    label: str | None = None,
    keep_spans: bool = False,
) -> Scored:
    """Roll out each task ``rollouts_per_task`` times and score the policy on them: a task's score is the
    mean reward of its rollouts (a failed rollout scores 0), the result the mean over tasks with its
    standard error. The pass waits while rollouts keep finishing (a busy machine is slow, not wrong); a
    rollout cancelled after ``runner.step_timeout_s`` without progress is not scored, and the result
    counts it as ``unfinished`` (its task is left out when none of its rollouts finished).

    The rollouts carry ``metadata["split"] = split``: agents see it as ``llm.split`` (``"val"`` makes
    ``llm.evaluating`` true, so they decode greedily) and group ids ``val<step>:<task id>``.
    """
    requests = [
        {
            "task_id": t.task_id,
            "input": t.input,
            "group_id": f"val{step}:{t.task_id}",
            "metadata": {"split": split, "step": step},
            "max_attempts": max_attempts,
        }
        for t in tasks
        for _ in range(rollouts_per_task)
    ]
    client = queue.client
    finished = queue.run(label or f"validation @ step {step}", requests, while_progressing=True)
    rewards = rollout_rewards(finished.done, client.all_spans)
    per_task: dict[str, list[float]] = {t.task_id: [] for t in tasks}
    scored: dict[str, list[ScoredRollout]] = {t.task_id: [] for t in tasks}
    for r in [*finished.done, *finished.failed]:
        reward = rewards.get(r.rollout_id, 0.0) if r.status == RolloutStatus.SUCCEEDED else 0.0
        per_task[r.task_id or ""].append(reward)
        scored[r.task_id or ""].append(ScoredRollout(r.rollout_id, r.task_id, r.status, reward))
    scores = {tid: sum(v) / len(v) for tid, v in per_task.items() if v}
    mean, se = mean_se(list(scores.values()))
    spans: dict[str, list[Span]] = {}
    if keep_spans:
        ids = [r.rollout_id for r in [*finished.done, *finished.failed, *finished.late]]
        for span in client.all_spans(ids):
            spans.setdefault(span.rollout_id or "", []).append(span)
    client.mark_consumed(finished.finished_ids)
    result = EvalResult(step, mean, se, len(scores), len(finished.failed), scores, len(finished.late))
    return Scored(result, [r for rows in scored.values() for r in rows], spans)


def error_line(error: str | None) -> str:
    """The one line that names a stored error: the first (the runner puts the root cause there), or the
    last when the text is a bare traceback (stored by another writer)."""
    lines = [line.strip() for line in (error or "").strip().splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[-1] if lines[0].startswith("Traceback") else lines[0]
