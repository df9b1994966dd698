"""``algorithm`` (advantages, credit, the loss) and ``update`` (where and how the update runs, verl's
section)."""

from __future__ import annotations

from typing import Any, Literal, get_args

import pydantic

from agl_core.pipeline.credit import RewardWeights

from .base import _FiniteFloat, _Strict

#: ``algorithm.name``'s values: the update rules with group-relative advantages
#: (:mod:`agl_trainer.learning.algo`), and supervised fine-tuning.
AlgorithmName = Literal["grpo", "ppo", "reinforce_pp", "sft"]
#: The names that train with advantages (every one but ``sft``).
RL_ALGORITHMS: tuple[str, ...] = tuple(n for n in get_args(AlgorithmName) if n != "sft")

#: Default ``algorithm.micro_batch_tokens`` on CPU and on a GPU.
CPU_MICRO_BATCH_TOKENS = 512
GPU_MICRO_BATCH_TOKENS = 16384


class RewardsConfig(_Strict):
    """Intermediate rewards added to single LLM calls after the episode reward is shared (``credit``)."""

    #: Add explicit per-call rewards: ``emit_reward(value, name=...)`` with a name other than ``episode``
    #: adds ``value`` to the LLM call it follows (see ``agl_core.emit_reward``).
    explicit: bool = True
    #: Added to the call that requested a tool, per tool call that failed (tool span with ERROR status).
    #: Usually negative (a penalty); 0 = off.
    tool_error: _FiniteFloat = 0.0
    #: Added to the call that requested a tool, per tool call that ran without error. A small positive
    #: weight keeps the tool penalties from teaching the policy to stop calling tools; 0 = off.
    tool_success: _FiniteFloat = 0.0
    #: Added to a call per tool call it wrote that cannot be run (the gateway flags it: unparseable, an
    #: unknown tool, arguments not a JSON object). Usually negative; 0 = off.
    malformed_tool_call: _FiniteFloat = 0.0
    #: Added to the last call of a rollout that timed out (an ``agl.error`` span of type ``RolloutTimeout``
    #: or ``*Timeout`` / ``*TimeoutError``). Usually negative; 0 = off.
    timeout: _FiniteFloat = 0.0
    #: Episode reward of a rollout that timed out without one, so it is still trained on (typically 0.0,
    #: with a ``timeout`` penalty on its last call); ``null``: timed-out rollouts are not trained on.
    timeout_episode_reward: _FiniteFloat | None = None


def _is_cpu(device: Any) -> bool:
    """Whether ``device`` (a ``torch.device`` or its type name) is the CPU: the defaults that differ by
    device (micro-batch size, recompute) ask this."""
    return str(getattr(device, "type", device)) == "cpu"


class AlgorithmConfig(_Strict):
    #: Advantage estimator; every rule uses the PPO-clip loss with the gateway's behaviour logprobs.
    #: ``grpo``: group-normalised; ``ppo``: group-mean baseline; ``reinforce_pp``: REINFORCE++ (baseline,
    #: then normalised over the batch). ``sft`` (only with ``traces``): fine-tune on the response tokens of
    #: the selected rollouts' LLM calls with the next-token loss (rejection sampling, distillation).
    name: AlgorithmName = "grpo"
    #: Weight of the per-token KL penalty to the reference policy (``kl_reference``); 0 = off.
    kl_coef: float = pydantic.Field(0.0, ge=0.0)
    #: How a rollout's episode reward is shared among its LLM calls: ``episode`` (every call gets it),
    #: ``last`` (the last trained call), ``discounted`` (call t of T gets ``gamma ** (T-1-t)`` of it), or
    #: ``per_call`` (none: calls get only the intermediate rewards of ``rewards``).
    credit: Literal["episode", "last", "discounted", "per_call"] = "episode"
    #: Discount of ``credit: discounted``.
    gamma: float = pydantic.Field(1.0, ge=0.0, le=1.0)
    #: Intermediate rewards added per call after ``credit`` (explicit per-call rewards, penalties).
    rewards: RewardsConfig = RewardsConfig()
    #: The importance ratio is clipped to ``[1 - clip_eps, 1 + clip_eps_high]`` in the PPO-clip loss.
    clip_eps: float = pydantic.Field(0.2, gt=0.0, lt=1.0)
    #: Upper clip bound ``1 + clip_eps_high``, at least ``clip_eps`` (DAPO's "clip higher", e.g. 0.28 with
    #: ``clip_eps: 0.2``, leaves unlikely tokens room to gain probability). Unset: ``clip_eps``.
    clip_eps_high: float | None = pydantic.Field(None, gt=0.0, le=10.0)
    #: How the per-token losses of a batch are averaged. ``rollout``: a call's mean over its response
    #: tokens, a rollout's mean over its calls, the batch's mean over rollouts (a rollout weighs the same
    #: however long it is; GRPO's per-sequence mean). ``token``: every response token of the batch weighs
    #: the same (DAPO's token-level loss: long responses count in proportion to their length).
    #: ``constant``: a rollout's token losses summed and divided by ``norm_tokens``, then the mean over
    #: rollouts (Dr. GRPO, with ``name: ppo`` for its advantages without the division by the group's std).
    loss_norm: Literal["rollout", "token", "constant"] = "rollout"
    #: ``loss_norm: constant``'s divisor: the response tokens a rollout may write (the agent's
    #: ``max_tokens`` times its calls). Required with ``constant``, unused otherwise.
    norm_tokens: int | None = pydantic.Field(None, ge=1, le=1_000_000)
    #: What the KL penalty (``kl_coef``) pulls the policy toward: ``base`` (the base model: the LoRA
    #: adapter switched off), ``init_adapter`` (``model.init_adapter``, the warm start the run begins
    #: from), or the path of a LoRA adapter of ``model.lora``'s shape (a checkpoint, an adapter directory
    #: or a run's output_dir, relative to the config file).
    kl_reference: str = pydantic.Field("base", min_length=1)
    learning_rate: float = pydantic.Field(1e-4, gt=0.0, lt=1.0)
    max_grad_norm: float = pydantic.Field(1.0, gt=0.0)
    #: Padded tokens per forward/backward pass; larger batches are split and gradients accumulated (the
    #: result is the same). Unset: 512 on CPU, where a larger pass is no faster and its activations cost
    #: about 1.3 MB of memory per token for a 135M model (4096 tokens peaked at 11 GB, 512 at 2 GB, each
    #: step in the same time); 16384 on a GPU (and verl's ``ppo_max_token_len_per_gpu``).
    micro_batch_tokens: int | None = pydantic.Field(None, ge=64)
    #: Train only the calls of agents whose names match one of these globs (all when empty).
    agents: list[str] = []

    def micro_batch_tokens_on(self, device: Any) -> int:
        """``micro_batch_tokens``, or its default for ``device`` (a ``torch.device`` or its type name)."""
        if self.micro_batch_tokens is not None:
            return self.micro_batch_tokens
        return CPU_MICRO_BATCH_TOKENS if _is_cpu(device) else GPU_MICRO_BATCH_TOKENS

    @property
    def clip_high(self) -> float:
        """The upper clip bound's epsilon: ``clip_eps_high``, or ``clip_eps`` when unset."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @pydantic.model_validator(mode="after")
    def _loss_settings(self) -> AlgorithmConfig:
        if self.clip_eps_high is not None and self.clip_eps_high < self.clip_eps:
            raise ValueError(
                f"clip bounds out of order: clip_eps_high ({self.clip_eps_high}) is below clip_eps"
                f" ({self.clip_eps}); the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high], and"
                " clip_eps_high raises the upper bound (DAPO): set it to at least clip_eps, or leave it unset"
            )
        if self.loss_norm == "constant" and self.norm_tokens is None:
            raise ValueError(
                "loss_norm 'constant' divides each rollout's summed token losses by norm_tokens; set"
                " algorithm.norm_tokens to the response tokens a rollout may write (its max_tokens)"
            )
        if self.norm_tokens is not None and self.loss_norm != "constant":
            raise ValueError(
                f"algorithm.norm_tokens applies only to loss_norm: constant (loss_norm is {self.loss_norm!r})"
            )
        if self.kl_reference != "base" and self.kl_coef == 0:
            raise ValueError(
                f"algorithm.kl_reference is {self.kl_reference!r} but kl_coef is 0, so there is no KL"
                " penalty; set kl_coef > 0 (e.g. 0.05) or leave kl_reference unset"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _per_call_needs_rewards(self) -> AlgorithmConfig:
        if self.credit == "per_call" and not self.reward_weights().active:
            raise ValueError(
                "credit 'per_call' trains on intermediate rewards only, but every one is off; set"
                " rewards.explicit: true (and emit named rewards) or a non-zero rewards weight"
            )
        return self

    def reward_weights(self) -> RewardWeights:
        """The ``rewards`` section as :class:`agl_core.pipeline.credit.RewardWeights`."""
        r = self.rewards
        return RewardWeights(r.explicit, r.tool_error, r.malformed_tool_call, r.timeout, r.tool_success)


class UpdateConfig(_Strict):
    #: What computes the policy update: ``torch`` (in the trainer's process, CPU or one GPU) or ``verl``
    #: (verl's FSDP actor on Ray, one or many GPUs; its settings go in the top-level ``verl:`` section).
    backend: Literal["torch", "verl"] = "torch"
    #: ``torch``: where the trained model lives: ``auto`` (the first GPU if there is one), ``cpu``,
    #: ``cuda`` or ``cuda:N``.
    device: str = pydantic.Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    #: ``torch``: compute the forward passes in bfloat16 (autocast) on a GPU; ignored on CPU.
    bf16: bool = False
    #: ``torch``: a prompt shared by a task group's rollouts keeps only its layers' inputs for the backward
    #: pass, which runs its layers again (activation checkpointing). Unset: on for CPU, where a long
    #: prompt's activations (about 1.3 MB a token for a 135M model) are the update's memory peak (the main
    #: job's 2-step profile: 2.88 GiB resident without, 2.38 with, the update 29% slower); off on a GPU.
    recompute: bool | None = None

    def recompute_on(self, device: Any) -> bool:
        """``recompute``, or its default for ``device`` (a ``torch.device`` or its type name)."""
        if self.recompute is not None:
            return self.recompute
        return _is_cpu(device)


#: Keys of verl's config that agl fills from its own settings (dotted path -> the agl key to set instead).
VERL_RESERVED_KEYS: dict[str, str] = {
    "actor_rollout_ref.model.path": "model.source",
    "actor_rollout_ref.model.lora_rank": "model.lora.r",
    "actor_rollout_ref.model.lora_alpha": "model.lora.alpha",
    "actor_rollout_ref.model.target_modules": "model.lora.target_modules",
    "actor_rollout_ref.actor.optim.lr": "algorithm.learning_rate",
    "actor_rollout_ref.actor.optim.clip_grad": "algorithm.max_grad_norm",
    "actor_rollout_ref.actor.grad_clip": "algorithm.max_grad_norm",
    "actor_rollout_ref.actor.clip_ratio": "algorithm.clip_eps",
    "actor_rollout_ref.actor.clip_ratio_low": "algorithm.clip_eps",
    "actor_rollout_ref.actor.clip_ratio_high": "algorithm.clip_eps_high",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.kl_coef",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl_coef",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "algorithm.micro_batch_tokens",
}

#: Top-level sections of verl's config that agl passes on, and what agl uses instead of the others.
VERL_SECTIONS = ("actor_rollout_ref", "trainer", "ray_kwargs", "global_profiler")
_VERL_REPLACED = {
    "data": "tasks come from 'tasks' and 'train'",
    "algorithm": "advantages are computed by agl: see 'algorithm'",
    "critic": "agl trains without a critic",
    "reward_model": "rewards come from the agent's rollouts",
    "reward": "rewards come from the agent's rollouts",
    "custom_reward_function": "rewards come from the agent's rollouts",
}


def _dotted_keys(mapping: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in mapping.items():
        path = f"{prefix}{str(key).lstrip('+')}"
        keys.append(path)
        if isinstance(value, dict):
            keys.extend(_dotted_keys(value, path + "."))
    return keys


def check_verl_section(section: dict[str, Any]) -> None:
    """Raise ``ValueError`` when the ``verl:`` mapping sets a key agl fills or a section agl does not use."""
    for key in section:
        name = str(key).lstrip("+")
        if name in _VERL_REPLACED:
            raise ValueError(f"verl.{name} is not used by agl ({_VERL_REPLACED[name]})")
        if name not in VERL_SECTIONS:
            raise ValueError(
                f"verl.{name}: agl passes on only these sections of verl's config: {', '.join(VERL_SECTIONS)}"
            )
    for path in _dotted_keys(section):
        if path in VERL_RESERVED_KEYS:
            raise ValueError(f"verl.{path} is set by agl from '{VERL_RESERVED_KEYS[path]}'; set that instead")
