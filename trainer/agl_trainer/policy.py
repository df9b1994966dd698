"""The policy a training job trains: the model (with its LoRA adapter), tokenizer, optimizer and KL
reference, or verl's actor, and the :class:`~agl_trainer.step.Learner` that updates and republishes it.

torch, peft and verl are imported inside the functions that need them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from .algo import Advantaged
from .config import TrainerConfig
from .services import Services

if TYPE_CHECKING:
    import torch

    from .update import ReferenceFn, UpdateStats
    from .verl_backend import VerlUpdater

__all__ = ["TorchLearner", "TrainablePolicy", "VerlLearner", "load_trainable_policy", "make_learner"]


@dataclasses.dataclass(frozen=True)
class TrainablePolicy:
    """What the update trains. With ``update.backend: verl`` the weights live in verl's workers:
    ``model``, ``optimizer`` and ``reference`` are ``None`` and ``updater`` is set; with ``torch`` the
    reverse."""

    tokenizer: Any
    #: Token id used to pad batches (the tokenizer's pad token, else its end-of-sequence token).
    pad_id: int
    model: Any
    optimizer: torch.optim.Optimizer | None
    #: The base model's logprobs for the KL penalty (``algorithm.kl_coef > 0``).
    reference: ReferenceFn | None
    updater: VerlUpdater | None


def load_trainable_policy(
    config: TrainerConfig, stack: ExitStack, *, echo: Callable[[str], None]
) -> TrainablePolicy:
    """Load ``model.source`` on ``update.device`` with the ``model.lora`` adapter, its optimizer and KL
    reference, or (``update.backend: verl``) the tokenizer and verl's actor (shut down by ``stack``)."""
    from .model import load_policy, load_tokenizer, torch_device

    t0 = time.monotonic()
    model: Any = None
    optimizer: torch.optim.Optimizer | None = None
    reference: ReferenceFn | None = None
    if config.update.backend == "verl":
        # verl's workers hold the policy; this process only needs the tokenizer
        tokenizer = load_tokenizer(config.model.source)
    else:
        import torch

        model, tokenizer = load_policy(config.model.source, seed=config.model.seed)
        model = model.to(torch_device(config.update.device))
        if config.model.lora is not None:
            from peft import LoraConfig, get_peft_model

            lora = config.model.lora
            model = get_peft_model(
                model,
                LoraConfig(
                    r=lora.r,
                    lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int; a float works
                    lora_dropout=lora.dropout,
                    target_modules=list(lora.target_modules),
                    task_type="CAUSAL_LM",
                ),
            )
        trainable = [p for p in model.parameters() if p.requires_grad]
        device = next(model.parameters()).device
        echo(
            f"model: {config.model.source} loaded in {time.monotonic() - t0:.1f}s on {device},"
            f" {sum(p.numel() for p in trainable):,} trainable parameters"
        )
        optimizer = torch.optim.AdamW(trainable, lr=config.algorithm.learning_rate)
        if config.algorithm.kl_coef > 0:
            if config.model.lora is None:
                raise ValueError("algorithm.kl_coef > 0 needs model.lora (the base model is the reference)")
            from .update import reference_logprobs_fn

            reference = reference_logprobs_fn(model, tokenizer.pad_token_id or 0, bf16=config.update.bf16)
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    updater: VerlUpdater | None = None
    if config.update.backend == "verl":
        from .verl_backend import VerlUpdater

        updater = VerlUpdater(config, pad_id=pad_id)
        stack.callback(updater.close)
        echo(f"update: verl actor on Ray ({config.model.source})")
    return TrainablePolicy(tokenizer, pad_id, model, optimizer, reference, updater)


class TorchLearner:
    """PPO-clip updates in this process (:func:`~agl_trainer.update.update_step`), served in place."""

    def __init__(self, config: TrainerConfig, policy: TrainablePolicy, services: Services) -> None:
        if policy.optimizer is None:
            raise ValueError("the torch update needs the policy's model and optimizer")
        self.config = config
        self.model = policy.model
        self.optimizer: torch.optim.Optimizer = policy.optimizer
        self.reference = policy.reference
        self.pad_id = policy.pad_id
        self.services = services

    @property
    def policy_version(self) -> int:
        return self.services.serving.policy_version

    def update(self, samples: Sequence[Advantaged], group_of: Mapping[str, str]) -> UpdateStats:
        from .update import update_step

        algorithm, serving = self.config.algorithm, self.services.serving
        version = serving.policy_version + 1
        # under the serving lock no batch runs on half-updated weights or under the old version
        with serving.lock:
            stats = update_step(
                self.model,
                self.optimizer,
                samples,
                clip_eps=algorithm.clip_eps,
                pad_id=self.pad_id,
                max_grad_norm=algorithm.max_grad_norm,
                micro_batch_tokens=algorithm.micro_batch_tokens,
                kl_coef=algorithm.kl_coef,
                reference=self.reference,
                bf16=self.config.update.bf16,
            )
            serving.publish(self.model, version)
        self.services.publish()
        return stats


class VerlLearner:
    """Updates by verl's actor, each new LoRA adapter loaded into the serving backend."""

    def __init__(self, updater: VerlUpdater, services: Services) -> None:
        self.updater = updater
        self.services = services

    @property
    def policy_version(self) -> int:
        return self.services.serving.policy_version

    def update(self, samples: Sequence[Advantaged], group_of: Mapping[str, str]) -> UpdateStats:
        version = self.policy_version + 1
        stats: UpdateStats = self.updater.update(samples, group_of=group_of)
        self.services.serving.publish_adapter(self.updater.export_adapter(version), version)
        self.services.publish()
        return stats


def make_learner(
    config: TrainerConfig, policy: TrainablePolicy, services: Services
) -> TorchLearner | VerlLearner:
    """The learner ``update.backend`` asks for."""
    if policy.updater is not None:
        return VerlLearner(policy.updater, services)
    return TorchLearner(config, policy, services)
