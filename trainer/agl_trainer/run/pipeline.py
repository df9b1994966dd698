"""Asynchronous training (``train.mode: async``): rollouts keep running while the policy updates.

In sync mode a step rolls out its task groups, waits for the slowest rollout, then updates while no
rollout runs. Here :class:`AsyncTrainStep` keeps ``(max_staleness + 1) x tasks_per_step`` task groups in
flight through the store at all times:

* a step trains on the first ``tasks_per_step`` groups whose rollouts are all finished (a group is never
  split; one past ``runner.step_timeout_s`` since it was queued has its unfinished rollouts cancelled and
  counts as finished, as in sync mode), oldest first when several are ready;
* a group with a call more than ``max_staleness`` policy versions behind the policy being updated (the
  ``agl.policy.version`` the gateway recorded on each call) is dropped, counted, and replaced by a new
  group of a fresh task;
* the loss weighs each token by the importance ratio against the gateway's recorded behaviour logprobs,
  clipped (PPO-clip, :func:`agl_trainer.learning.update.batch_loss`), so calls of an older version train
  correctly;
* the groups queued while the update runs, and those queued after it, fill the pipeline again.

With ``max_staleness: 0`` this is sync training that does not wait for the slowest group of a step. The
rollouts in flight are named in the run's ``inflight`` file, so ``--resume`` cancels them (no step is
repeated or skipped; their tasks are drawn again later).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agl_core import semconv
from agl_core.records import Rollout, RolloutStatus, Span, Task

from ..config import TrainerConfig
from ..learning.algo import Advantaged
from ..learning.batch import build_batch
from ..reporting.results import StepOutcome
from .rollouts import RolloutQueue, RolloutRound
from .step import Learner, Meter, TrainStep, UpdateStats, episodes

__all__ = ["AsyncTrainStep"]

#: How often the pipeline asks the store how its rollouts are doing.
POLL_S = 0.25


@dataclasses.dataclass
class _Group:
    """A task group in flight: its rollouts, and the policy version and time it was queued at."""

    group_id: str
    task: Task
    rollout_ids: list[str]
    version: int
    queued_at: float
    cancelled: bool = False


class _WatchedLearner:
    """The learner, with a look at the pipeline before and after each update (what ran during it)."""

    def __init__(self, learner: Learner, before: Callable[[], None], after: Callable[[], None]) -> None:
        self._learner = learner
        self._before = before
        self._after = after

    @property
    def policy_version(self) -> int:
        return self._learner.policy_version

    @property
    def updates(self) -> Mapping[str, int] | None:
        """Each policy's update count, with ``policies`` (see
        :class:`~agl_trainer.run.learner.TorchLearner`)."""
        return getattr(self._learner, "updates", None)

    @property
    def meter(self) -> Meter | None:
        """The learner's publish and generation counters (see :class:`~agl_trainer.run.step.Meter`)."""
        return getattr(self._learner, "meter", None)

    def update(self, samples: Sequence[Advantaged], group_of: Mapping[str, str]) -> UpdateStats:
        self._before()
        try:
            return self._learner.update(samples, group_of)
        finally:
            self._after()


class AsyncTrainStep:
    """Training steps over a pipeline of task groups in flight (see the module docstring); the same
    ``run(step, tasks, draw)`` as :class:`~agl_trainer.run.step.TrainStep`."""

    def __init__(self, config: TrainerConfig, queue: RolloutQueue, learner: Learner) -> None:
        self.config = config
        self.queue = queue
        self.learner = learner
        watched = _WatchedLearner(learner, self._update_starts, self._update_ends)
        self.steps = TrainStep(config, queue, watched)
        self.max_staleness = config.train.max_staleness
        self.depth = (self.max_staleness + 1) * config.train.tasks_per_step
        self._groups: dict[str, _Group] = {}
        self._serial = 0
        self._running_at_update: set[str] = set()
        self._update_started = 0.0
        #: The metrics' ``pipeline`` figures of the step being trained (the update's filled in by it).
        self._figures: dict[str, Any] = {}

    # -- the pipeline -----------------------------------------------------------------------------------

    @property
    def on_phase(self) -> Callable[[str], object]:
        """Told what the step is doing now (its update; rollouts run all the time here)."""
        return self.steps.on_phase

    @on_phase.setter
    def on_phase(self, value: Callable[[str], object]) -> None:
        self.steps.on_phase = value

    def _queue(self, tasks: Sequence[Task], step: int) -> None:
        """Queue a group of ``rollouts_per_task`` rollouts for each task."""
        if not tasks:
            return
        config, version = self.config, self.learner.policy_version
        requests, names = [], []
        for task in tasks:
            self._serial += 1
            group_id = f"async{self._serial}:{task.task_id}"
            names.append((group_id, task))
            requests += [
                {
                    "task_id": task.task_id,
                    "input": task.input,
                    "group_id": group_id,
                    "metadata": {"split": "train", "step": step, "policy_version": version},
                    "max_attempts": config.runner.max_attempts,
                }
                for _ in range(config.train.rollouts_per_task)
            ]
        queued = self.queue.client.enqueue_rollouts(self.queue.tagged(requests))
        now = time.monotonic()
        for group_id, task in names:
            ids = [r.rollout_id for r in queued if r.group_id == group_id]
            self._groups[group_id] = _Group(group_id, task, ids, version, now)
        self._note_inflight()

    def _note_inflight(self) -> None:
        self.queue.note_inflight("async", [rid for g in self._groups.values() for rid in g.rollout_ids])

    def _fill(self, step: int, tasks: Sequence[Task], draw: Callable[[int], list[Task]] | None) -> None:
        """Queue groups until ``depth`` are in flight: ``tasks`` first, then ``draw(n)`` more."""
        missing = self.depth - len(self._groups)
        if missing <= 0:
            return
        chosen = list(tasks[:missing])
        if len(chosen) < missing and draw is not None:
            chosen += draw(missing - len(chosen))
        self._queue(chosen, step)

    def _statuses(self) -> dict[str, Rollout]:
        ids = [rid for g in self._groups.values() for rid in g.rollout_ids]
        return {r.rollout_id: r for r in self.queue.client.get_rollouts(ids)} if ids else {}

    def _ready(self, rollouts: Mapping[str, Rollout]) -> list[_Group]:
        """The groups whose rollouts are all finished, oldest first; groups past ``step_timeout_s`` have
        their unfinished rollouts cancelled (they are ready at the next look)."""
        now, ready = time.monotonic(), []
        for group in self._groups.values():
            states = [rollouts[rid] for rid in group.rollout_ids if rid in rollouts]
            if all(r.status.finished for r in states):
                ready.append(group)
            elif not group.cancelled and now - group.queued_at >= self.queue.step_timeout_s:
                self.queue.client.cancel_rollouts([r.rollout_id for r in states if not r.status.finished])
                group.cancelled = True
        return sorted(ready, key=lambda g: g.queued_at)

    def _take(self, group: _Group, rollouts: Mapping[str, Rollout]) -> RolloutRound:
        del self._groups[group.group_id]
        states = [rollouts[rid] for rid in group.rollout_ids if rid in rollouts]
        done = [r for r in states if r.status == RolloutStatus.SUCCEEDED]
        late = [r for r in states if group.cancelled and r.status == RolloutStatus.CANCELLED]
        failed = [r for r in states if r not in done and r not in late]
        return RolloutRound(done, failed, late)

    # -- the update, watched ------------------------------------------------------------------------------

    def _update_starts(self) -> None:
        rollouts = self._statuses()
        self._running_at_update = {rid for rid, r in rollouts.items() if not r.status.finished}
        self._update_started = time.monotonic()

    def _update_ends(self) -> None:
        running = self._running_at_update
        finished = [rid for rid, r in self._statuses().items() if rid in running and r.status.finished]
        self._figures.update(
            in_flight_at_update=len(running),
            finished_during_update=len(finished),
            update_s=round(time.monotonic() - self._update_started, 3),
        )

    # -- a step ---------------------------------------------------------------------------------------------

    def run(
        self, step: int, tasks: list[Task], draw: Callable[[int], list[Task]] | None = None
    ) -> StepOutcome:
        """Fill the pipeline (``tasks``, then ``draw(n)``), wait for ``tasks_per_step`` finished groups
        recent enough to train, update on them and measure the step."""
        config = self.config
        started = time.monotonic()
        self.steps.begin()
        self._fill(step, tasks, draw)
        wanted = config.train.tasks_per_step
        finished = RolloutRound([], [], [])
        used: list[Rollout] = []
        spans: list[Span] = []
        taken: list[Task] = []
        dropped = 0
        version = self.learner.policy_version  # the version this step's update starts from
        waited = 0.0
        while len(taken) < wanted:
            rollouts = self._statuses()
            ready = self._ready(rollouts)
            if not ready:
                states = [r.status for r in rollouts.values()]
                done = sum(s == RolloutStatus.SUCCEEDED for s in states)
                bad = sum(s.finished and s != RolloutStatus.SUCCEEDED for s in states)
                self.queue.progress.rollouts(f"rollouts for step {step} (async)", done, bad, len(rollouts))
                t0 = time.monotonic()
                time.sleep(POLL_S)
                waited += time.monotonic() - t0
                continue
            self.queue.flush()  # the gateway's spans of the finished calls
            for group in ready[: wanted - len(taken)]:
                round_ = self._take(group, rollouts)
                group_used, group_spans = episodes(config.algorithm, round_, self.queue.client.all_spans)
                behind = _staleness(group_spans, version)
                if behind > self.max_staleness:
                    dropped += 1
                    self.queue.client.mark_consumed(round_.finished_ids)
                    continue
                finished += round_
                used += group_used
                spans += group_spans
                taken.append(group.task)
            self._note_inflight()
            if dropped and len(taken) < wanted and draw is not None:
                self._fill(step, [], draw)  # replace the dropped groups by fresh ones
        batch = build_batch(config, used, spans)
        self._figures = {
            "max_staleness": self.max_staleness,
            "staleness": _histogram(batch.samples, version),
            "dropped_groups": dropped,
            "wait_s": round(waited, 3),
            # filled in by the update (none when the batch trains nothing)
            "in_flight_at_update": 0,
            "finished_during_update": 0,
            "update_s": 0.0,
        }
        return self.steps.conclude(
            step,
            finished,
            spans,
            batch,
            tasks=taken,
            started=started,
            pipeline=self._figures,
            # the update overlaps the next groups' rollouts: the wait for this step's groups is what
            # the step spent on rollouts
            phases={"rollouts": waited},
        )

    def close(self) -> None:
        """Cancel the groups still in flight (the run is over)."""
        ids = [rid for g in self._groups.values() for rid in g.rollout_ids]
        if ids:
            self.queue.client.cancel_rollouts(ids)
        self._groups.clear()
        self._note_inflight()


def _staleness(spans: Sequence[Span], version: int) -> int:
    """How many policy versions the oldest call in ``spans`` is behind ``version`` (0 without calls)."""
    versions = [
        v for s in spans if isinstance(v := s.attributes.get(semconv.POLICY_VERSION), int) and v <= version
    ]
    return version - min(versions) if versions else 0


def _histogram(samples: Sequence[Advantaged], version: int) -> dict[str, int]:
    """Trained calls by how many versions behind ``version`` the policy that made them was."""
    counts = Counter(
        version - s.transition.policy_version for s in samples if s.transition.policy_version is not None
    )
    return {str(k): counts[k] for k in sorted(counts)}
