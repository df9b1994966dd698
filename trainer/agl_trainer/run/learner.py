"""The learners a training step calls (:class:`~agl_trainer.run.step.Learner`): each updates the policy
:mod:`agl_trainer.learning.policy` loaded, by the torch update in this process or by verl's actor, and
republishes it to the job's serving backend and runners (:class:`~agl_trainer.run.services.Services`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from agl_core.policies import trained_policy

from ..config import TrainerConfig
from ..learning.algo import Advantaged
from ..learning.policy import TrainablePolicy
from .services import Services
from .step import Meter

if TYPE_CHECKING:
    import torch

    from ..learning.update import UpdateStats
    from ..learning.verl_backend import VerlUpdater
    from .step import UpdateStats as StepStats

__all__ = ["PolicyStats", "TorchLearner", "VerlLearner", "make_learner"]


class TorchLearner:
    """PPO-clip updates in this process (:func:`~agl_trainer.learning.update.update_step`), served in
    place."""

    def __init__(self, config: TrainerConfig, policy: TrainablePolicy, services: Services) -> None:
        if not policy.trains_in_process:
            raise ValueError("the torch update needs the policy's model and optimizer")
        self.config = config
        self.model = policy.model
        self.optimizer = policy.optimizer
        self.optimizers = policy.optimizers
        self.router = policy.router
        #: Updates so far of each policy (with ``policies``; the policy's own counts, which resume restores).
        self.updates = policy.updates
        self.reference = policy.reference
        self.pad_id = policy.pad_id
        self.services = services
        self.meter = Meter(generation=getattr(services.serving, "generation_counters", None))

    @property
    def policy_version(self) -> int:
        return self.services.serving.policy_version

    def update(self, samples: Sequence[Advantaged], group_of: Mapping[str, str]) -> StepStats:
        serving = self.services.serving
        version = serving.policy_version + 1
        # under the serving lock no batch runs on half-updated weights or under the old version
        with serving.lock:
            stats: StepStats
            if self.router is None:
                assert self.optimizer is not None
                stats = self._step(self.optimizer, samples)
                t0 = time.monotonic()
                serving.publish(self.model, version)
            else:
                stats = self._policy_steps(samples)
                t0 = time.monotonic()
                # only the adapters that changed are published (vLLM loads each under its policy's name)
                serving.publish(self.model, version, policies=list(stats.per_policy))
        self.services.publish()
        self.meter.publish_s += time.monotonic() - t0
        return stats

    def _step(self, optimizer: torch.optim.Optimizer, samples: Sequence[Advantaged]) -> UpdateStats:
        from ..learning.update import UpdateSettings, update_step

        device = next(self.model.parameters()).device
        settings = UpdateSettings.of(self.config.algorithm, self.config.update, device)
        return update_step(
            self.model, optimizer, samples, pad_id=self.pad_id, reference=self.reference, **settings.ppo()
        )

    def _policy_steps(self, samples: Sequence[Advantaged]) -> PolicyStats:
        """One update of each policy on its own agents' samples (advantages came from the whole task
        groups); a policy without samples is left as it is. Calls served by the base model train nothing."""
        assert self.router is not None
        by_policy: dict[str, list[Advantaged]] = {}
        for sample in samples:
            t = sample.transition
            name = trained_policy(self.router, t.agent_name, t.policy_name)
            if name is not None:
                by_policy.setdefault(name, []).append(sample)
        per_policy: dict[str, UpdateStats] = {}
        for name, own in by_policy.items():
            self.model.set_adapter(name)  # the forward pass uses this adapter; only its weights get gradients
            per_policy[name] = self._step(self.optimizers[name], own)
            self.updates[name] += 1
        return PolicyStats(per_policy, dict(self.updates))


class VerlLearner:
    """Updates by verl's actor, each new LoRA adapter loaded into the serving backend."""

    def __init__(self, updater: VerlUpdater, services: Services) -> None:
        self.updater = updater
        self.services = services
        self.meter = Meter(generation=getattr(services.serving, "generation_counters", None))

    @property
    def policy_version(self) -> int:
        return self.services.serving.policy_version

    def update(self, samples: Sequence[Advantaged], group_of: Mapping[str, str]) -> UpdateStats:
        version = self.policy_version + 1
        stats: UpdateStats = self.updater.update(samples, group_of=group_of)
        t0 = time.monotonic()
        self.services.serving.publish_adapter(self.updater.export_adapter(version), version)
        self.services.publish()
        self.meter.publish_s += time.monotonic() - t0
        return stats


@dataclasses.dataclass(frozen=True)
class PolicyStats:
    """A step's update of several policies: each one's stats, and each one's update count so far."""

    per_policy: dict[str, UpdateStats]
    updates: dict[str, int]

    @property
    def loss(self) -> float:
        total = self.tokens
        if not total:
            return 0.0
        return sum(s.loss * s.tokens for s in self.per_policy.values()) / total

    @property
    def grad_norm(self) -> float:
        return max((s.grad_norm for s in self.per_policy.values()), default=0.0)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.per_policy.values())


def make_learner(
    config: TrainerConfig, policy: TrainablePolicy, services: Services
) -> TorchLearner | VerlLearner:
    """The learner ``update.backend`` asks for."""
    if policy.updater is not None:
        return VerlLearner(policy.updater, services)
    return TorchLearner(config, policy, services)
