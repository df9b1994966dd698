"""LightningRL's advantage estimation: per rollout, within the group of rollouts of the same task.

Pure functions over transitions (no torch). The estimators, by update rule:

* ``grpo``: ``(r - mean_g) / std_g`` (group-normalised, as in GRPO)
* ``ppo``: ``r - mean_g`` (PPO-clip with the group mean as baseline, no critic)
* ``reinforce_pp``: ``r - mean_g``, then normalised over the whole batch (REINFORCE++ with baseline)
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

from agl_core.records import Transition

from ..config.algorithm import RL_ALGORITHMS

__all__ = ["ALGORITHMS", "Advantaged", "GroupReport", "compute_advantages", "group_advantages"]

ALGORITHMS = RL_ALGORITHMS  # one list, in the config


@dataclasses.dataclass(frozen=True)
class Advantaged:
    transition: Transition
    advantage: float


@dataclasses.dataclass(frozen=True)
class GroupReport:
    groups: int
    #: Groups whose rollouts all scored the same: they carry no learning signal and are skipped.
    skipped_no_variance: int
    #: Groups with a single rollout (no baseline): skipped.
    skipped_singleton: int


def group_advantages(
    transitions: Sequence[Transition],
    group_of: Mapping[str, str],
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    scores: Mapping[str, float] | None = None,
) -> tuple[list[Advantaged], GroupReport]:
    """GRPO-style advantages: ``(r_t - mean_g) / std_g`` for each call ``t`` of a rollout in group ``g``.

    The group's mean and (population) standard deviation are taken over its rollouts' scores: ``scores``
    where given (``agl_core.pipeline.credit.CreditResult.scores``, which count intermediate rewards), else the
    reward of the rollout's last call (the episode reward under the episode / last / discounted
    strategies). ``group_of`` maps rollout id to group id; rollouts missing from it form a group of their own.
    """
    last_scores: dict[str, float] = {}
    last_index: dict[str, int] = {}
    for t in transitions:
        if t.call_index >= last_index.get(t.rollout_id, -1):
            last_index[t.rollout_id] = t.call_index
            last_scores[t.rollout_id] = t.reward
    given = scores or {}
    rollout_scores = {r: given.get(r, score) for r, score in last_scores.items()}
    members: dict[str, list[str]] = defaultdict(list)
    for rollout_id in rollout_scores:
        members[group_of.get(rollout_id, rollout_id)].append(rollout_id)
    stats: dict[str, tuple[float, float]] = {}
    no_variance = singleton = 0
    for group, rollout_ids in members.items():
        values = [rollout_scores[r] for r in rollout_ids]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        if len(values) == 1:
            singleton += 1
        elif std < eps:
            no_variance += 1
        else:
            stats[group] = (mean, std)
    out = []
    for t in transitions:
        group = group_of.get(t.rollout_id, t.rollout_id)
        if group not in stats:
            continue
        mean, std = stats[group]
        out.append(Advantaged(t, (t.reward - mean) / (std + eps) if scale_by_std else t.reward - mean))
    return out, GroupReport(len(members), no_variance, singleton)


def compute_advantages(
    transitions: Sequence[Transition],
    group_of: Mapping[str, str],
    algorithm: str = "grpo",
    *,
    eps: float = 1e-6,
    scores: Mapping[str, float] | None = None,
) -> tuple[list[Advantaged], GroupReport]:
    """Advantages for ``algorithm`` (one of :data:`ALGORITHMS`); groups without reward variance are skipped.
    ``scores``: rollout scores for the group baselines (see :func:`group_advantages`)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    samples, report = group_advantages(
        transitions, group_of, scale_by_std=algorithm == "grpo", eps=eps, scores=scores
    )
    if algorithm == "reinforce_pp" and samples:
        values = [s.advantage for s in samples]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        samples = [Advantaged(s.transition, (s.advantage - mean) / (std + eps)) for s in samples]
    return samples, report
