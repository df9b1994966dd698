"""What a job measures: a training step's metrics, a held-out score, and the mean ± standard error behind it.

Plain frozen records and arithmetic; no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["UNNAMED_AGENT", "EvalResult", "StepMetrics", "mean_se"]

#: The name ``StepMetrics.agents`` gives to LLM calls no agent claimed.
UNNAMED_AGENT = "(unnamed)"


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for fewer than two values)."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


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
    #: Intermediate rewards applied, by kind (``agl_core.credit.REWARD_KINDS``).
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


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Score on the validation split: the mean over tasks of each task's mean reward (a failed or late
    rollout scores 0), its standard error, and the number of tasks."""

    step: int
    mean: float
    se: float
    n: int
    rollouts_failed: int
    task_scores: dict[str, float]

    def describe(self) -> str:
        failed = f", {self.rollouts_failed} rollouts failed" if self.rollouts_failed else ""
        return f"{self.mean:.3f} ± {self.se:.3f} (SE, n={self.n} tasks{failed})"
