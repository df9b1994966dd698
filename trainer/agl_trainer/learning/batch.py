"""A step's episodes as training data: their spans turned into transitions, credit assigned across each
episode, the trainable transitions (those a serving policy trains) and their group-relative advantages."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from agl_core.pipeline.credit import CreditResult, assign_rewards
from agl_core.pipeline.transitions import TransitionResult, explain_untrained, spans_to_transitions
from agl_core.policies import policy_mismatch, trained_policy
from agl_core.records import Rollout, Span, Transition

from ..config import TrainerConfig
from .algo import Advantaged, GroupReport, compute_advantages

__all__ = ["Batch", "build_batch", "trainable_transitions"]

logger = logging.getLogger(__name__)
#: (run, agent, serving policy) already warned about: an agent's calls served by another policy than its own.
_MISMATCHES_SAID: set[tuple[str, str | None, str | None]] = set()


@dataclasses.dataclass(frozen=True)
class Batch:
    """A step's episodes as training data."""

    result: TransitionResult
    credit: CreditResult
    #: Rollouts that gave no trained transition -> why.
    untrained: dict[str, str]
    samples: list[Advantaged]
    report: GroupReport
    #: Rollout id -> group id.
    group_of: dict[str, str]

    @property
    def signal_groups(self) -> int:
        """Groups whose rollouts scored differently: the ones that train."""
        return self.report.groups - self.report.skipped_no_variance - self.report.skipped_singleton


def trainable_transitions(credit: CreditResult) -> list[Transition]:
    """The credited transitions an update can train on: those with prompt and response token ids."""
    return [t for t in credit.transitions if t.prompt_ids and t.response_ids]


def build_batch(config: TrainerConfig, used: Sequence[Rollout], spans: Sequence[Span]) -> Batch:
    """The episodes ``used`` (with their ``spans``) as training data: transitions, credit, advantages."""
    algorithm = config.algorithm
    result = spans_to_transitions(spans, timeout_reward=algorithm.rewards.timeout_episode_reward)
    credit = assign_rewards(
        result,
        spans,
        strategy=algorithm.credit,
        gamma=algorithm.gamma,
        weights=algorithm.reward_weights(),
        agents=config.trained_agents(),
    )
    transitions = trainable_transitions(credit)
    router = config.router()
    if router is not None:  # a call trains the policy that served it: none when the base model did
        for t in transitions:
            mismatch = policy_mismatch(router, t.agent_name, t.policy_name)
            said = (str(config.output_dir), t.agent_name, t.policy_name)
            if mismatch is not None and said not in _MISMATCHES_SAID:
                _MISMATCHES_SAID.add(said)
                logger.warning("agl: %s", mismatch)
        transitions = [
            t for t in transitions if trained_policy(router, t.agent_name, t.policy_name) is not None
        ]
    group_of = {r.rollout_id: r.group_id or r.rollout_id for r in used}
    samples, report = compute_advantages(transitions, group_of, algorithm.name, scores=credit.scores)
    return Batch(
        result,
        credit,
        explain_untrained([r.rollout_id for r in used], result, transitions),
        samples,
        report,
        group_of,
    )
