"""The policy a training job trains: the model (with its LoRA adapter), tokenizer, optimizer and KL
reference, or verl's actor (the learner that updates and republishes it is
:mod:`agl_trainer.run.learner`).

torch, peft and verl are imported inside the functions that need them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import LoraConfig, TrainerConfig

if TYPE_CHECKING:
    import torch

    from agl_core.policies import PolicyRouter

    from .update import ReferenceFn
    from .verl_backend import VerlUpdater

__all__ = [
    "TrainablePolicy",
    "load_trainable_policy",
    "peft_lora_config",
]


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
    #: With ``policies``: each policy's optimizer over its own adapter (``optimizer`` is then ``None``).
    optimizers: Mapping[str, torch.optim.Optimizer] = dataclasses.field(default_factory=dict)
    #: With ``policies``: which policy serves which agent.
    router: PolicyRouter | None = None
    #: With ``policies``: how many updates each policy has had (saved in checkpoints, restored on resume).
    updates: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def checkpointed_optimizers(self) -> torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer]:
        """What a checkpoint saves and restores of the optimizers: the one optimizer, or with
        ``policies`` each policy's (the form
        :func:`~agl_trainer.learning.checkpoint.save_checkpoint` takes)."""
        return self.optimizer if self.optimizer is not None else self.optimizers

    @property
    def trains_in_process(self) -> bool:
        """The weights and optimizer state live here (the torch update), not in verl's workers."""
        return self.model is not None and (self.optimizer is not None or bool(self.optimizers))


def load_trainable_policy(
    config: TrainerConfig, stack: ExitStack, *, echo: Callable[[str], None]
) -> TrainablePolicy:
    """Load ``model.source`` on ``update.device`` with the ``model.lora`` adapter, its optimizer and KL
    reference, or (``update.backend: verl``) the tokenizer and verl's actor (shut down by ``stack``)."""
    from ..model import load_policy, load_tokenizer, torch_device

    t0 = time.monotonic()
    model: Any = None
    optimizer: torch.optim.Optimizer | None = None
    optimizers: dict[str, torch.optim.Optimizer] = {}
    reference: ReferenceFn | None = None
    if config.update.backend == "verl":
        # verl's workers hold the policy; this process only needs the tokenizer
        tokenizer = load_tokenizer(config.model.source, chat_template=config.model.chat_template_text())
    else:
        import torch

        model, tokenizer = load_policy(
            config.model.source, seed=config.model.seed, chat_template=config.model.chat_template_text()
        )
        model = model.to(torch_device(config.update.device))
        if config.policies:
            model, optimizers = _add_policy_adapters(model, config)
            device = next(model.parameters()).device
            sizes = ", ".join(
                f"{name} {sum(p.numel() for g in opt.param_groups for p in g['params']):,}"
                for name, opt in optimizers.items()
            )
            echo(
                f"model: {config.model.source} loaded in {time.monotonic() - t0:.1f}s on {device};"
                f" {len(optimizers)} policies, trainable parameters: {sizes}"
            )
        else:
            if config.model.lora is not None:
                from peft import get_peft_model

                model = get_peft_model(model, peft_lora_config(config.model.lora))
                if config.model.init_adapter is not None:
                    loaded = _load_init_adapter(model, config.model.init_adapter)
                    echo(f"model: LoRA adapter starts from {loaded}")
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

            reference = reference_logprobs_fn(
                model,
                tokenizer.pad_token_id or 0,
                bf16=config.update.bf16,
                adapter=_reference_adapter(config),
            )
            if config.algorithm.kl_reference != "base":
                echo(f"KL reference: the adapter in {config.algorithm.kl_reference}")
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    updater: VerlUpdater | None = None
    if config.update.backend == "verl":
        from .verl_backend import VerlUpdater

        updater = VerlUpdater(config, pad_id=pad_id)
        stack.callback(updater.close)
        echo(f"update: verl actor on Ray ({config.model.source})")
    return TrainablePolicy(
        tokenizer,
        pad_id,
        model,
        optimizer,
        reference,
        updater,
        optimizers,
        config.router(),
        dict.fromkeys(optimizers, 0),
    )


def _load_init_adapter(model: Any, path: str) -> str:
    """Load ``model.init_adapter`` (:func:`~agl_trainer.saved.adapter_weights` resolves it) into the
    PEFT ``model``'s adapter; what was loaded. ``ValueError`` when it is no LoRA adapter of this shape."""
    from ..model import load_adapter_weights
    from ..saved import CheckpointError, adapter_weights

    try:
        checkpoint, weights = adapter_weights(path, key="model.init_adapter")
    except CheckpointError as exc:
        raise ValueError(str(exc)) from None
    try:
        unexpected = load_adapter_weights(model, weights)
    except RuntimeError as exc:  # a shape that does not fit (another rank)
        raise ValueError(f"model.init_adapter: {weights} does not fit model.lora: {exc}") from None
    if unexpected:
        raise ValueError(
            f"model.init_adapter: {weights} does not fit model.lora (unexpected keys {unexpected[:3]})"
        )
    return checkpoint.describe()


def _reference_adapter(config: TrainerConfig) -> Path | None:
    """The weights ``algorithm.kl_reference`` names (``None`` for the base model), checked to fit."""
    from ..saved import CheckpointError, check_adapter_fits

    name = config.algorithm.kl_reference
    lora = config.model.lora
    if name == "base" or lora is None:
        return None
    path = config.model.init_adapter if name == "init_adapter" else name
    assert path is not None  # the config requires model.init_adapter for 'init_adapter'
    try:
        return check_adapter_fits(
            path,
            key="algorithm.kl_reference",
            lora=lora,
        )
    except CheckpointError as exc:
        raise ValueError(str(exc)) from None


def peft_lora_config(lora: LoraConfig) -> Any:
    """PEFT's LoRA configuration for ``model.lora`` (every adapter agl trains has this shape)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int; a float works
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )


def _add_policy_adapters(model: Any, config: TrainerConfig) -> tuple[Any, dict[str, torch.optim.Optimizer]]:
    """``model`` as a PEFT model with one LoRA adapter per policy (named after it), and each policy's
    optimizer over its own adapter's parameters."""
    import torch
    from peft import get_peft_model

    optimizers: dict[str, torch.optim.Optimizer] = {}
    for n, policy in enumerate(config.policies):
        lora = policy.lora or config.model.lora
        assert lora is not None  # the config requires one
        if n == 0:
            model = get_peft_model(model, peft_lora_config(lora), adapter_name=policy.name)
        else:
            model.add_adapter(policy.name, peft_lora_config(lora))
    for policy in config.policies:
        marker = f".{policy.name}."
        params = [p for name, p in model.named_parameters() if marker in name and "lora_" in name]
        if not params:
            raise ValueError(
                f"policy {policy.name!r}: its adapter has no parameters (model.lora target_modules?)"
            )
        for p in params:
            p.requires_grad_(True)
        optimizers[policy.name] = torch.optim.AdamW(
            params, lr=policy.learning_rate or config.algorithm.learning_rate
        )
    return model, optimizers
