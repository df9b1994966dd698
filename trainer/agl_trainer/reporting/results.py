"""What a job measures: a training step's metrics, a held-out score, and the mean ± standard error behind it;
what ``agl dev`` found out about each of its rollouts.

Plain frozen records and arithmetic; no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from agl_core.records import RolloutStatus

if TYPE_CHECKING:
    from ..learning.batch import Batch

__all__ = ["UNNAMED_AGENT", "DevResult", "DevRollout", "EvalResult", "StepMetrics", "StepOutcome"]

#: The name ``StepMetrics.agents`` gives to LLM calls no agent claimed.
UNNAMED_AGENT = "(unnamed)"


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    step: int
    policy_version: int
    rollouts: int
    rollouts_failed: int
    rollouts_late: int
    transitions: int
    trained_transitions: int
    mean_reward: float | None
    loss: float | None
    grad_norm: float | None
    tokens: int
    tokens_per_s: float
    groups_skipped: int
    problems: dict[str, int]
    #: Rollouts that finished but gave no trained transition, counted by reason.
    untrained: dict[str, int]
    #: Intermediate rewards applied, by kind (``agl_core.pipeline.credit.REWARD_KINDS``).
    reward_events: dict[str, int]
    #: Per agent name (:data:`UNNAMED_AGENT` for calls no agent claimed): its LLM calls in the step's rollouts
    #: and how many went into the update, ``{"writer": {"calls": 12, "trained": 8}}``.
    agents: dict[str, dict[str, int]]
    #: Every task rolled out this step, the redrawn ones (``train.resample_rounds``) included.
    tasks: list[str]
    #: Tasks drawn beyond ``tasks_per_step`` because too few groups had differing rewards.
    redrawn_tasks: int
    seconds: float
    #: Every rollout of the step (succeeded, failed and late), for ``agl inspect ROLLOUT_ID``.
    rollout_ids: list[str] = dataclasses.field(default_factory=list)
    #: Why the step trained nothing (None when it trained); also counted in ``problems``.
    warning: str | None = None
    #: Training from stored traces: transitions of the step with the token ids the model saw (from the
    #: gateway), and those rebuilt from recorded messages with the policy's chat template. ``None`` in a
    #: run that ran its own rollouts (all exact).
    exact_transitions: int | None = None
    retokenised_transitions: int | None = None
    #: With ``policies``: per policy (and ``base`` for agents the base model serves), the agents it served
    #: this step, their LLM calls and the calls' mean reward (after credit), the transitions its update
    #: trained on, its loss and gradient norm (``None`` when it was not updated) and its update count so far.
    policies: dict[str, dict[str, Any]] | None = None
    #: With ``train.mode: async``: the staleness of the trained calls (policy versions behind the one
    #: updated -> calls), the groups dropped as too stale, the rollouts in flight while the update ran and
    #: those that finished during it, the update's and the wait's seconds. ``None`` in sync mode.
    pipeline: dict[str, Any] | None = None
    #: Where the step's time went, in seconds: ``rollouts`` (waiting for the step's rollouts, every round),
    #: ``generation`` (the transformers backend generating, inside the rollouts; absent with vLLM) and its
    #: parts ``prefill`` (prompts through the model) and ``decode`` (one token per row per pass),
    #: ``transitions`` (fetching the spans and building the batch), ``update`` (the optimizer step),
    #: ``publish`` (serving the new weights), ``validation`` (a held-out evaluation run after the step).
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Tokens the transformers backend generated per second of generating, this step (None with vLLM).
    generation_tokens_per_s: float | None = None
    #: Share of the step's prompt tokens the transformers backend took from its prefix cache instead of
    #: prefilling them (None with vLLM, or when no prompt was served).
    prefix_reuse: float | None = None
    #: The trainer process's peak resident memory so far, in MB (the kernel's high-water mark).
    peak_rss_mb: float | None = None
    #: The update's KL to the reference model (``algorithm.kl_coef`` > 0; k3 estimator), its approximate
    #: KL to the behaviour policy, and the fraction of tokens whose ratio was clipped (``None`` without an
    #: update).
    kl: float | None = None
    approx_kl: float | None = None
    clip_fraction: float | None = None


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Score on the validation split: the mean over tasks of each task's mean reward (a failed rollout
    scores 0), its standard error, and the number of tasks. A rollout that never finished (cancelled after
    ``runner.step_timeout_s`` with no rollout of the pass finishing) is not scored at all: it is counted
    in ``unfinished``, and a task none of whose rollouts finished is left out of ``n``."""

    step: int
    mean: float
    se: float
    n: int
    rollouts_failed: int
    task_scores: dict[str, float]
    #: Rollouts of the pass that did not finish and are not scored (0: the pass is complete).
    unfinished: int = 0

    def describe(self) -> str:
        failed = f", {self.rollouts_failed} rollouts failed" if self.rollouts_failed else ""
        text = f"{self.mean:.3f} ± {self.se:.3f} (SE, n={self.n} tasks{failed})"
        if self.unfinished:
            text += f" INCOMPLETE: {self.unfinished} rollouts did not finish and are not scored"
        return text


@dataclasses.dataclass(frozen=True)
class DevRollout:
    """One rollout of a dev run (``agl dev``, ``Trainer.dev``): how it ended and what training would make
    of it, without training."""

    rollout_id: str
    task_id: str
    #: How it ended; a rollout still running at ``runner.step_timeout_s`` is cancelled.
    status: RolloutStatus
    #: Its episode reward; ``None`` when it recorded none (or did not succeed).
    reward: float | None
    #: LLM calls of its last attempt that went through the gateway.
    llm_calls: int
    #: Transitions made from its spans: one per LLM call joined to the gateway's token ids.
    transitions: int
    #: Of those, the ones an update would train on (agents selected by ``algorithm.agents``, tokens there).
    trained: int
    #: Why the rollout, or some of its LLM calls, would not train (the reasons ``agl train`` and
    #: ``agl inspect`` give); empty when every call trains.
    reasons: tuple[str, ...] = ()

    @property
    def trains(self) -> bool:
        """Whether the rollout gives the update anything (a group also needs rewards that differ)."""
        return self.trained > 0


@dataclasses.dataclass(frozen=True)
class DevResult:
    """A dev run's rollouts, in the order they were asked for, and where they are kept."""

    rollouts: tuple[DevRollout, ...]
    #: Where the rollouts and their spans are kept, for ``agl inspect ROLLOUT_ID --store STORE``: a SQLite
    #: file or ``store.url``; ``None`` when they were in a temporary store, deleted at the end.
    store: str | None

    @property
    def trainable(self) -> int:
        """How many rollouts would give the update transitions."""
        return sum(r.trains for r in self.rollouts)


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What a step did: its metrics, the batch it trained on and how many redraw rounds it took."""

    metrics: StepMetrics
    batch: Batch
    redraw_rounds: int
