"""One training step: rollout rounds -> a batch (spans -> transitions -> credit -> group advantages) -> the
policy update -> the step's metrics.

The update is injected (:class:`Learner`), so a step runs, and tests, without torch: the trainer passes
the torch or verl update (:mod:`agl_trainer.run.learner`), a test a recording fake.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from agl_core.policies import BASE, trained_policy
from agl_core.records import Rollout, RolloutStatus, Span, Task, Transition

from ..config import AlgorithmConfig, TrainerConfig
from ..learning.algo import Advantaged
from ..learning.batch import Batch, build_batch, trainable_transitions
from ..reporting.results import UNNAMED_AGENT, StepMetrics, StepOutcome
from .rollouts import RolloutQueue, RolloutRound, error_line, rollout_rewards

__all__ = [
    "Batch",
    "GenerationCounters",
    "Learner",
    "StepOutcome",
    "TrainStep",
    "UpdateStats",
    "agent_counts",
    "build_batch",
    "episodes",
    "trainable_transitions",
]


class UpdateStats(Protocol):
    """What a step reports of an update (:class:`agl_trainer.learning.update.UpdateStats` has it)."""

    @property
    def loss(self) -> float: ...

    @property
    def grad_norm(self) -> float: ...

    @property
    def tokens(self) -> int: ...


class Learner(Protocol):
    """The policy as a step sees it: the version being served, and the update that trains it."""

    @property
    def policy_version(self) -> int:
        """The policy version the gateway serves now."""

    def update(self, samples: Sequence[Advantaged], group_of: Mapping[str, str]) -> UpdateStats:
        """Train on ``samples`` (``group_of``: rollout id -> group id) and serve the result as the next
        policy version before returning."""


@dataclasses.dataclass(frozen=True)
class GenerationCounters:
    """The transformers backend's running totals since it started: seconds generating (of which
    prefilling prompts and decoding tokens), tokens generated, prompt tokens prefilled and those taken
    from its prefix cache instead."""

    seconds: float
    tokens: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefilled_tokens: int = 0
    reused_tokens: int = 0

    def __sub__(self, earlier: GenerationCounters) -> GenerationCounters:
        return GenerationCounters(
            *(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(earlier), strict=True))
        )


@dataclasses.dataclass
class Meter:
    """Running totals a learner keeps for the step metrics: seconds spent publishing new weights, and the
    serving backend's generation counters (``generation()``; None when the backend does not count them,
    as with vLLM)."""

    publish_s: float = 0.0
    generation: Callable[[], GenerationCounters] | None = None

    def reading(self) -> tuple[float, GenerationCounters | None]:
        return self.publish_s, (self.generation() if self.generation is not None else None)


def peak_rss_mb() -> float | None:
    """This process's peak resident memory so far, in MB (None where the platform does not say)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024, 1)


def agent_counts(calls: Sequence[Transition], trained: Sequence[Transition]) -> dict[str, dict[str, int]]:
    """LLM calls and trained transitions per agent name, in order of first appearance."""
    counts: dict[str, dict[str, int]] = {}
    for key, group in (("calls", calls), ("trained", trained)):
        for t in group:
            counts.setdefault(t.agent_name or UNNAMED_AGENT, {"calls": 0, "trained": 0})[key] += 1
    return counts


def episodes(
    algorithm: AlgorithmConfig, finished: RolloutRound, spans_of: Callable[[list[str]], Sequence[Span]]
) -> tuple[list[Rollout], list[Span]]:
    """The finished rollouts a step trains on, and the spans of their last attempts (``spans_of(ids)``
    gives the spans of those rollouts): the succeeded ones, and the timed-out ones when
    ``algorithm.rewards.timeout_episode_reward`` gives them an episode reward."""
    rewards_config = algorithm.rewards
    # a timed-out rollout has no episode reward; it is trained only when the config gives it one
    used = finished.done + [
        r
        for r in finished.failed
        if r.status == RolloutStatus.TIMED_OUT and rewards_config.timeout_episode_reward is not None
    ]
    # a retried rollout keeps the spans of its earlier attempts (even late LLM calls of a timed-out
    # one); only its last attempt is the episode being trained
    last_attempts = {r.attempts[-1].attempt_id for r in used if r.attempts}
    spans = [
        s
        for s in spans_of([r.rollout_id for r in used])
        if s.attempt_id is None or s.attempt_id in last_attempts
    ]
    return used, spans


class TrainStep:
    """Runs training steps: rollouts through ``queue``, the batch, ``learner.update`` on it."""

    def __init__(self, config: TrainerConfig, queue: RolloutQueue, learner: Learner) -> None:
        self.config = config
        self.queue = queue
        self.learner = learner
        #: Told what the step is doing now (``rollouts``, ``update``): run.json's phase.
        self.on_phase: Callable[[str], object] = lambda what: None
        meter = getattr(learner, "meter", None)
        self.meter: Meter = meter if isinstance(meter, Meter) else Meter()
        self.begin()

    def begin(self) -> None:
        """Start measuring a step: the publish and generation counters as they are now."""
        self._mark = self.meter.reading()

    def _episodes(self, finished: RolloutRound) -> tuple[list[Rollout], list[Span]]:
        return episodes(self.config.algorithm, finished, self.queue.client.all_spans)

    def run(
        self, step: int, tasks: list[Task], draw: Callable[[int], list[Task]] | None = None
    ) -> StepOutcome:
        """Roll out ``tasks``, update the policy on the result (the learner publishes it). With
        ``train.resample_rounds``, ``draw(n)`` gives ``n`` more tasks when fewer than ``tasks_per_step``
        groups have differing rewards."""
        config = self.config
        step_start = time.monotonic()
        self.begin()
        rollouts_s = transitions_s = 0.0
        finished = RolloutRound([], [], [])
        used: list[Rollout] = []
        spans: list[Span] = []
        drawn, first_draw, extra_rounds = list(tasks), len(tasks), 0
        while True:
            prefix = f"step{step}" if not extra_rounds else f"step{step}.{extra_rounds}"
            requests = [
                {
                    "task_id": t.task_id,
                    "input": t.input,
                    "group_id": f"{prefix}:{t.task_id}",
                    "metadata": {"split": "train", "step": step, "round": extra_rounds},
                    "max_attempts": config.runner.max_attempts,
                }
                for t in tasks
                for _ in range(config.train.rollouts_per_task)
            ]
            label = f"rollouts of step {step}" + (f" (redraw {extra_rounds})" if extra_rounds else "")
            self.on_phase("rollouts")
            t0 = time.monotonic()
            this_round = self.queue.run(label, requests)
            t1 = time.monotonic()
            finished += this_round
            # each round fetches only its own spans; the batch is rebuilt over all rounds' episodes
            round_used, round_spans = self._episodes(this_round)
            used, spans = used + round_used, spans + round_spans
            batch = build_batch(config, used, spans)
            rollouts_s, transitions_s = rollouts_s + t1 - t0, transitions_s + time.monotonic() - t1
            missing = config.train.tasks_per_step - batch.signal_groups
            if draw is None or missing <= 0 or extra_rounds >= config.train.resample_rounds:
                break
            extra_rounds += 1
            tasks = draw(missing)
            drawn += tasks
        return self.conclude(
            step,
            finished,
            spans,
            batch,
            tasks=drawn,
            redrawn=len(drawn) - first_draw,
            extra_rounds=extra_rounds,
            started=step_start,
            phases={"rollouts": rollouts_s, "transitions": transitions_s},
        )

    def conclude(
        self,
        step: int,
        finished: RolloutRound,
        spans: Sequence[Span],
        batch: Batch,
        *,
        tasks: Sequence[Task],
        redrawn: int = 0,
        extra_rounds: int = 0,
        started: float,
        pipeline: dict[str, Any] | None = None,
        phases: Mapping[str, float] | None = None,
    ) -> StepOutcome:
        """Update the policy on ``batch`` (built from ``finished``'s episodes and their ``spans``) and
        measure the step; ``pipeline``: the asynchronous mode's own figures for the metrics; ``phases``:
        the seconds the caller measured (rollouts, transitions) since :meth:`begin`."""
        config = self.config
        rewards = list(rollout_rewards(finished.done, lambda ids: spans).values())
        stats: UpdateStats | None = None
        update_s = 0.0
        if batch.samples:
            self.on_phase("update")
            t0 = time.monotonic()
            stats = self.learner.update(batch.samples, batch.group_of)
            update_s = time.monotonic() - t0
        publish_before, generation_before = self._mark
        publish_now, generation_now = self.meter.reading()
        publish_s = publish_now - publish_before
        timing = {name: round(v, 3) for name, v in (phases or {}).items()}
        generation_tps = prefix_reuse = None
        if generation_before is not None and generation_now is not None:
            generated = generation_now - generation_before
            timing["generation"] = round(generated.seconds, 3)
            timing["prefill"] = round(generated.prefill_s, 3)
            timing["decode"] = round(generated.decode_s, 3)
            if generated.seconds > 0:
                generation_tps = round(generated.tokens / generated.seconds, 1)
            prompt_tokens = generated.prefilled_tokens + generated.reused_tokens
            if prompt_tokens:
                prefix_reuse = round(generated.reused_tokens / prompt_tokens, 4)
        timing["update"] = round(max(update_s - publish_s, 0.0), 3)
        timing["publish"] = round(publish_s, 3)
        # lets `agl store serve --retention consumed` drop spans that training has used
        self.queue.client.mark_consumed(finished.finished_ids)
        report = batch.report
        warning = None if batch.samples else nothing_trained_reason(finished, batch)
        problems = batch.result.reasons()
        if warning is not None:
            problems["step trained nothing"] = 1
        metrics = StepMetrics(
            step=step,
            policy_version=self.learner.policy_version,
            rollouts=len(finished.done),
            rollouts_failed=len(finished.failed),
            rollouts_late=len(finished.late),
            transitions=len(batch.result.transitions),
            trained_transitions=len(batch.samples),
            mean_reward=sum(rewards) / len(rewards) if rewards else None,
            loss=stats.loss if stats else None,
            grad_norm=stats.grad_norm if stats else None,
            tokens=stats.tokens if stats else 0,
            tokens_per_s=(stats.tokens / (update_s - publish_s)) if stats and update_s > publish_s else 0.0,
            groups_skipped=report.skipped_no_variance + report.skipped_singleton,
            problems=problems,
            untrained=dict(Counter(batch.untrained.values())),
            reward_events=batch.credit.counts(),
            agents=agent_counts(batch.result.transitions, [s.transition for s in batch.samples]),
            tasks=[t.task_id for t in tasks],
            redrawn_tasks=redrawn,
            seconds=time.monotonic() - started,
            rollout_ids=[r.rollout_id for r in finished.done + finished.failed + finished.late],
            warning=warning,
            policies=policy_metrics(config, batch, stats, getattr(self.learner, "updates", None)),
            pipeline=pipeline,
            phases=timing,
            generation_tokens_per_s=generation_tps,
            prefix_reuse=prefix_reuse,
            peak_rss_mb=peak_rss_mb(),
            kl=_stat(stats, "kl_to_reference"),
            approx_kl=_stat(stats, "approx_kl"),
            clip_fraction=_stat(stats, "clip_fraction"),
        )
        return StepOutcome(metrics, batch, extra_rounds)


def _stat(stats: UpdateStats | None, name: str) -> float | None:
    """An optional figure of an update (``None`` without an update, or when its backend has none)."""
    value = getattr(stats, name, None) if stats is not None else None
    return float(value) if isinstance(value, (int, float)) else None


def policy_metrics(
    config: TrainerConfig,
    batch: Batch,
    stats: UpdateStats | None,
    updates: Mapping[str, int] | None = None,
) -> dict[str, dict[str, Any]] | None:
    """The step's metrics per policy (``policies`` in the config; ``None`` without): which agents each
    served, their calls and the calls' mean reward, what its update trained on and how it went. ``base``
    counts the agents the base model served (not trained)."""
    router = config.router()
    if router is None:
        return None
    out: dict[str, dict[str, Any]] = {
        name: {
            "agents": [],
            "calls": 0,
            "trained": 0,
            "reward": None,
            "loss": None,
            "grad_norm": None,
            "updates": 0,
        }
        for name in (*router.names, BASE)
    }
    # each call's reward after credit where it was credited (the trained agents), else its episode's
    credited = {t.span_id: t.reward for t in batch.credit.transitions if t.span_id is not None}
    rewards: dict[str, list[float]] = {}
    for t in batch.result.transitions:
        policy = trained_policy(router, t.agent_name, t.policy_name) or BASE
        row = out[policy]
        row["calls"] += 1
        name = t.agent_name or UNNAMED_AGENT
        if name not in row["agents"]:
            row["agents"].append(name)
        reward = credited.get(t.span_id, t.reward) if t.span_id is not None else t.reward
        rewards.setdefault(policy, []).append(reward)
    for policy, values in rewards.items():
        out[policy]["reward"] = sum(values) / len(values)
    for s in batch.samples:
        trained = trained_policy(router, s.transition.agent_name, s.transition.policy_name)
        if trained is not None:  # the base model is never updated
            out[trained]["trained"] += 1
    per_policy = getattr(stats, "per_policy", None) or {}
    for name, own in per_policy.items():
        out[name]["loss"], out[name]["grad_norm"] = own.loss, own.grad_norm
    # each policy's updates so far: the update's count, else the learner's (a step that trained nothing)
    for name, count in (getattr(stats, "updates", None) or updates or {}).items():
        if name in out:
            out[name]["updates"] = count
    return out


#: Why a step trained nothing when its rollouts worked but every group tied (not a failure of the run).
TIED_GROUPS = "every task group was skipped: equal rewards within each group give no learning signal"


def first_error(rollouts: Sequence[Rollout]) -> str:
    """The first line of the first stored error among ``rollouts`` (the runner puts the root cause
    there), with its rollout id; empty when none has one."""
    for r in rollouts:
        cause = error_line(r.attempts[-1].error if r.attempts else None)
        if cause:
            return f"{cause} (rollout {r.rollout_id})"
    return ""


def nothing_trained_reason(finished: RolloutRound, batch: Batch) -> str:
    """Why a step's batch holds no sample, in words a user can act on."""
    total = len(finished.done) + len(finished.failed) + len(finished.late)
    if not finished.done and finished.failed and not finished.late:
        cause = first_error(finished.failed)
        return f"all {total} rollouts failed" + (f"; first error: {cause}" if cause else "")
    if not finished.done and finished.late and not finished.failed:
        return f"all {total} rollouts were late (runner.step_timeout_s) and were cancelled"
    if not finished.done:
        cause = first_error(finished.failed)
        return f"no rollout succeeded ({len(finished.failed)} failed, {len(finished.late)} late)" + (
            f"; first error: {cause}" if cause else ""
        )
    if not batch.result.transitions:
        reasons = Counter(batch.untrained.values()).most_common(1)
        return "the rollouts gave no LLM calls to train on" + (f" ({reasons[0][0]})" if reasons else "")
    if batch.report.skipped_no_variance or batch.report.skipped_singleton:
        return TIED_GROUPS
    return "no LLM call could be trained (see the reasons above)"
