"""The verl update backend: agl's advantaged transitions as verl's batch, verl's config from agl's, and
:class:`VerlUpdater`, which runs verl's FSDP actor on Ray and hands each new LoRA adapter to vLLM.

Layout followed: verl 0.9.1 (``pip install verl==0.9.1``), whose rollouts and actor update agree on it:

* ``verl/experimental/agent_loop/agent_loop.py`` (``_agent_loop_postprocess``, ``_postprocess``) builds
  ``prompts`` (left-padded to one width), ``responses`` (right-padded), ``input_ids`` = prompts | responses,
  ``attention_mask`` (1 on real tokens), ``position_ids`` = ``compute_position_id_with_mask(attention_mask)``
  = ``clip(cumsum(mask) - 1, min=0)`` (``verl/utils/model.py``), and ``response_mask`` (1 on generated
  tokens);
* ``verl/trainer/ppo/ray_trainer.py`` (``RayPPOTrainer._update_actor``) turns that ``DataProto`` into a
  ``TensorDict`` (``DataProto.to_tensordict``, ``verl/workers/utils/padding.py:left_right_2_no_padding``),
  sets ``mini_batch_size``, ``global_batch_size``, ``epochs``, ``seed``, ``dataloader_kwargs``,
  ``calculate_entropy`` and ``compute_loss``, and calls the worker group's ``update_actor``
  (``verl/workers/engine_workers.py``, ``ActorRolloutRefWorker``), whose loss
  (``verl/workers/utils/losses.py:ppo_loss``) reads ``old_log_probs``, ``advantages``, ``response_mask``
  and, with ``use_kl_loss``, ``ref_log_prob``; the forward pass needs ``meta_info["temperature"]``;
* ``verl/trainer/ppo/core_algos.py``: advantages are per token, a sequence's scalar advantage broadcast over
  its response tokens and zero elsewhere (``compute_grpo_outcome_advantage``: ``scores.unsqueeze(-1) *
  response_mask``); ``token_level_rewards`` holds the sequence's reward at its last response token.

(verl 0.4 to 0.7 read the same keys from a ``DataProto`` in ``verl/workers/actor/dp_actor.py``,
``DataParallelPPOActor.update_policy``; their worker API differs, so the ``verl`` extra pins 0.9.)

agl computes advantages itself (LightningRL: per rollout, within the task's group), so the batch carries
them ready-made. Each LLM call is its own sequence. agl normalises the loss per rollout (a rollout with many
calls weighs as much as one with few); verl averages over sequences (``loss_agg_mode: seq-mean-token-mean``,
agl's default for verl), so each sequence's advantage is scaled by ``N / (rollouts * calls of its rollout)``,
which makes verl's PPO-clip loss (linear in positive rescalings of the advantage) equal to agl's.

Nothing here imports verl, ray or torch at module level: conversion needs torch (and numpy),
:class:`VerlUpdater` and :meth:`VerlBatch.to_dataproto` need verl (``pip install 'agl[verl]'``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ..config import TrainerConfig

__all__ = [
    "VERL_LAYOUT_VERSION",
    "VerlBatch",
    "VerlUpdater",
    "merge_verl_config",
    "pad_batch",
    "require_verl",
    "to_verl_batch",
    "verl_config",
    "verl_defaults",
    "verl_overrides",
]

#: The verl release whose batch layout, config and worker API this module follows.
VERL_LAYOUT_VERSION = "0.9.1"
_INSTALL = "pip install 'agl[verl]'  (on the GPU machine; it brings verl and ray)"


# -- the batch -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VerlBatch:
    """One update's batch in verl's layout: plain tensors (dim 0 = sequence), per-sequence numpy object
    arrays, and ``meta_info``. :meth:`to_dataproto` wraps it into verl's ``DataProto``."""

    tensors: dict[str, Any]
    non_tensors: dict[str, Any]
    meta_info: dict[str, Any]

    def __len__(self) -> int:
        return int(self.tensors["input_ids"].shape[0])

    def with_tensors(self, **tensors: Any) -> VerlBatch:
        return dataclasses.replace(self, tensors={**self.tensors, **tensors})

    def to_dataproto(self) -> Any:
        """The same batch as ``verl.DataProto`` (needs verl)."""
        require_verl()
        from verl import DataProto

        return DataProto.from_dict(
            tensors=dict(self.tensors), non_tensors=dict(self.non_tensors), meta_info=dict(self.meta_info)
        )


def to_verl_batch(
    samples: Sequence[Any],
    *,
    pad_id: int,
    group_of: Mapping[str, str] | None = None,
    prompt_length: int | None = None,
    response_length: int | None = None,
    rollout_weights: bool = True,
    temperature: float = 1.0,
) -> VerlBatch:
    """agl's advantaged transitions (:class:`~agl_trainer.learning.algo.Advantaged`) as a verl batch.

    Shapes (``B`` sequences, ``P`` = ``prompt_length`` or the longest prompt, ``R`` = ``response_length``
    or the longest response):

    * ``prompts`` ``(B, P)`` left-padded with ``pad_id``; ``responses`` ``(B, R)`` right-padded;
      ``input_ids`` ``(B, P + R)`` both side by side; ``attention_mask`` ``(B, P + R)`` 1 on real tokens;
      ``position_ids`` ``(B, P + R)``: 0, 1, 2, ... from the first real token (0 on left padding, the
      last position repeated on right padding); ``response_mask`` ``(B, R)`` 1 on response tokens
      (all int64, as verl's rollout makes them);
    * ``advantages`` ``(B, R)`` float32: the sample's advantage on each response token (times its
      per-rollout weight, see the module docstring), 0 on padding;
    * ``token_level_rewards`` ``(B, R)`` float32: the transition's reward on its last response token;
    * ``old_log_probs`` ``(B, R)`` float32: the behaviour logprobs the gateway recorded, 0 on padding;
      left out when a sample has none (the updater then has verl recompute them);
    * non-tensors ``uid`` (the group id from ``group_of``, else the rollout id; verl groups by it) and
      ``rollout_id``; ``meta_info``: ``temperature`` (the gateway's logprobs are at temperature 1).

    Raises ``ValueError`` for an empty batch, an empty prompt or response, or a sequence longer than a
    fixed ``prompt_length`` / ``response_length`` (it is never truncated).
    """
    import numpy as np
    import torch

    if not samples:
        raise ValueError("to_verl_batch needs at least one sample")
    for s in samples:
        t = s.transition
        if not t.prompt_ids or not t.response_ids:
            raise ValueError(f"transition {t.rollout_id}#{t.call_index} has no prompt or no response tokens")
    longest_prompt = max(len(s.transition.prompt_ids) for s in samples)
    longest_response = max(len(s.transition.response_ids) for s in samples)
    if prompt_length is not None and longest_prompt > prompt_length:
        raise ValueError(f"a prompt has {longest_prompt} tokens, more than prompt_length={prompt_length}")
    if response_length is not None and longest_response > response_length:
        raise ValueError(
            f"a response has {longest_response} tokens, more than response_length={response_length}"
        )
    width_p = prompt_length or longest_prompt
    width_r = response_length or longest_response
    size = len(samples)

    calls = Counter(s.transition.rollout_id for s in samples)
    prompts = torch.full((size, width_p), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((size, width_p), dtype=torch.long)
    responses = torch.full((size, width_r), pad_id, dtype=torch.long)
    response_mask = torch.zeros((size, width_r), dtype=torch.long)
    advantages = torch.zeros((size, width_r), dtype=torch.float32)
    rewards = torch.zeros((size, width_r), dtype=torch.float32)
    old = torch.zeros((size, width_r), dtype=torch.float32)
    have_logprobs = all(s.transition.response_logprobs is not None for s in samples)
    for i, s in enumerate(samples):
        t = s.transition
        n_p, n_r = len(t.prompt_ids), len(t.response_ids)
        prompts[i, width_p - n_p :] = torch.tensor(t.prompt_ids, dtype=torch.long)
        prompt_mask[i, width_p - n_p :] = 1
        responses[i, :n_r] = torch.tensor(t.response_ids, dtype=torch.long)
        response_mask[i, :n_r] = 1
        weight = size / (len(calls) * calls[t.rollout_id]) if rollout_weights else 1.0
        advantages[i, :n_r] = float(s.advantage) * weight
        rewards[i, n_r - 1] = float(t.reward)
        if have_logprobs:
            old[i, :n_r] = torch.tensor(t.response_logprobs, dtype=torch.float32)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0),
        "response_mask": response_mask,
        "advantages": advantages,
        "token_level_rewards": rewards,
    }
    if have_logprobs:
        tensors["old_log_probs"] = old
    groups = group_of or {}
    rollout_ids = [s.transition.rollout_id for s in samples]
    non_tensors = {
        "uid": np.array([groups.get(r, r) for r in rollout_ids], dtype=object),
        "rollout_id": np.array(rollout_ids, dtype=object),
    }
    return VerlBatch(tensors, non_tensors, {"temperature": float(temperature)})


def pad_batch(batch: VerlBatch, multiple: int) -> VerlBatch:
    """``batch`` grown to a multiple of ``multiple`` sequences (verl splits a batch evenly over its
    data-parallel ranks) by repeating its first sequences with their ``response_mask``, ``advantages`` and
    ``token_level_rewards`` zeroed: the added rows change neither the loss nor the gradient."""
    import numpy as np
    import torch

    if multiple < 1:
        raise ValueError(f"multiple must be at least 1, got {multiple}")
    missing = -len(batch) % multiple
    if not missing:
        return batch
    rows = torch.tensor([i % len(batch) for i in range(missing)])
    silenced = {"response_mask", "advantages", "token_level_rewards"}
    tensors = {}
    for key, value in batch.tensors.items():
        extra = value[rows].clone()
        if key in silenced:
            extra.zero_()
        tensors[key] = torch.cat([value, extra], dim=0)
    non_tensors = {
        key: np.concatenate([value, value[rows.numpy()]]) for key, value in batch.non_tensors.items()
    }
    return VerlBatch(tensors, non_tensors, dict(batch.meta_info))


# -- the config ---------------------------------------------------------------------------------------


def verl_overrides(config: TrainerConfig) -> dict[str, Any]:
    """What agl lays over verl's defaults: agl's choices (which ``verl:`` may change), then the ``verl:``
    section, then the keys agl fills from its own settings (``VERL_RESERVED_KEYS``). Keys starting with
    ``+`` are ones verl's defaults lack (see :func:`merge_verl_config`)."""
    lora = config.model.lora
    algo = config.algorithm
    if lora is not None and not float(lora.alpha).is_integer():
        raise ValueError(f"verl takes an integer LoRA alpha; model.lora.alpha is {lora.alpha}")
    agl_choices: dict[str, Any] = {
        "actor_rollout_ref": {
            "actor": {
                # one optimizer step per agl step over the whole batch, as the torch backend does
                "ppo_epochs": 1,
                "shuffle": False,
                "use_dynamic_bsz": True,
                "loss_agg_mode": "seq-mean-token-mean",
                "kl_loss_type": "low_var_kl",
                "checkpoint": {"save_contents": ["model"]},
            },
            # the actor worker reads these even without a rollout of its own
            "rollout": {"name": "vllm"},
        },
        "trainer": {"nnodes": 1, "n_gpus_per_node": 1, "device": "cuda"},
    }
    filled: dict[str, Any] = {
        "actor_rollout_ref": {
            "model": {
                "path": config.model.source,
                "lora_rank": lora.r if lora is not None else 0,
                "lora_alpha": int(lora.alpha) if lora is not None else 16,
                "target_modules": list(lora.target_modules) if lora is not None else "all-linear",
            },
            "actor": {
                "optim": {"lr": algo.learning_rate, "clip_grad": algo.max_grad_norm},
                "grad_clip": algo.max_grad_norm,
                "clip_ratio": algo.clip_eps,
                "clip_ratio_low": algo.clip_eps,
                "clip_ratio_high": algo.clip_high,
                "use_kl_loss": algo.kl_coef > 0,
                "kl_loss_coef": algo.kl_coef,
                "ppo_max_token_len_per_gpu": algo.micro_batch_tokens_on("cuda"),
            },
        }
    }
    return _layer(_layer(agl_choices, config.verl), filled)


def _layer(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base`` (mappings merge, anything else replaces); ``+name`` and ``name`` are one key."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        name = str(key).lstrip("+")
        existing = next((k for k in out if k.lstrip("+") == name), None)
        old = out.pop(existing) if existing is not None else None
        marked = str(key).startswith("+") or (existing or "").startswith("+")
        merged = (
            _layer(old, value)
            if isinstance(old, dict) and isinstance(value, Mapping)
            else copy.deepcopy(value)
        )
        out[("+" if marked else "") + name] = dict(merged) if isinstance(merged, Mapping) else merged
    return out


def merge_verl_config(
    defaults: Mapping[str, Any], overrides: Mapping[str, Any], *, source: str = "verl"
) -> dict[str, Any]:
    """``overrides`` merged onto verl's ``defaults`` (plain mappings; lists replace).

    A key that a non-empty mapping of ``defaults`` lacks is a ``ValueError`` naming it and the closest
    known key, unless written ``+key`` (Hydra's convention for adding a key). Under a mapping that is
    empty or ``null`` in the defaults (verl's free-form sections), any key is taken.
    """
    return _merge_known(dict(defaults), overrides, "verl", source)


def _merge_known(
    defaults: dict[str, Any], overrides: Mapping[str, Any], path: str, source: str
) -> dict[str, Any]:
    out = copy.deepcopy(defaults)
    for key, value in overrides.items():
        name = str(key).lstrip("+")
        where = f"{path}.{name}"
        if name not in out and not str(key).startswith("+") and defaults:
            close = difflib.get_close_matches(name, list(defaults), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ValueError(
                f"{where} is not a key of {source}'s config ({hint}to add a key its defaults lack, write"
                f" '+{name}', as with Hydra)"
            )
        current = out.get(name)
        if isinstance(current, dict) and current and isinstance(value, Mapping):
            out[name] = _merge_known(current, value, where, source)
        else:
            out[name] = _strip_plus(copy.deepcopy(value))
    return out


def _strip_plus(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k).lstrip("+"): _strip_plus(v) for k, v in value.items()}
    return value


def require_verl() -> str:
    """verl's installed version; ``ValueError`` with the install command when verl (or ray) is missing."""
    for module in ("verl", "ray"):
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"update.backend verl needs {module}, which is not installed: {_INSTALL}")
    return importlib.metadata.version("verl")


def verl_defaults() -> tuple[dict[str, Any], str]:
    """verl's full default PPO config (``trainer/config/_generated_ppo_trainer.yaml`` of the installed verl,
    read without importing verl) and a label naming the version."""
    version = require_verl()
    spec = importlib.util.find_spec("verl")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "trainer" / "config" / "_generated_ppo_trainer.yaml"
        if path.is_file():
            return yaml.safe_load(path.read_text()), f"verl {version}"
    raise ValueError(
        f"verl {version} has no trainer/config/_generated_ppo_trainer.yaml; agl follows verl"
        f" {VERL_LAYOUT_VERSION}'s config layout: pip install 'verl>=0.9,<0.10'"
    )


def verl_config(config: TrainerConfig) -> Any:
    """verl's config for this run: its defaults, agl's settings and the ``verl:`` section merged, resolved
    (an ``omegaconf.DictConfig``, the form verl's workers take). Needs verl."""
    from omegaconf import OmegaConf

    defaults, source = verl_defaults()
    merged = OmegaConf.create(merge_verl_config(defaults, verl_overrides(config), source=source))
    OmegaConf.resolve(merged)
    return merged


# -- the updater --------------------------------------------------------------------------------------


class VerlUpdater:
    """Policy updates with verl's FSDP actor on a Ray worker group, for agl's training loop.

    Construction starts Ray (unless it runs already) and one actor worker per GPU
    (``verl.trainer.nnodes`` x ``verl.trainer.n_gpus_per_node``), each loading ``model.source`` with
    the LoRA adapter of ``model.lora``. Per step: :meth:`update` (one optimizer step on the step's
    samples), then :meth:`export_adapter` (verl's checkpoint of the actor, converted by verl's model
    merger into a PEFT adapter directory) for ``serving.publish_adapter``. ``output_dir`` must be on a
    file system every node writes to when there are several.
    """

    def __init__(self, config: TrainerConfig, *, pad_id: int, workers: Any = None) -> None:
        """``workers``: an actor worker group built elsewhere (already initialised) instead of
        starting one."""
        require_verl()
        self.config = config
        self.pad_id = pad_id
        self.verl = verl_config(config)
        self.work_dir = (config.output_dir / "verl").resolve()
        self._started_ray = False
        self.last_metrics: dict[str, Any] = {}
        self.workers = workers if workers is not None else self._start_workers()

    def _start_workers(self) -> Any:
        import ray
        from omegaconf import OmegaConf
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.trainer.constants_ppo import get_ppo_ray_runtime_env
        from verl.workers.engine_workers import ActorRolloutRefWorker

        trainer = self.verl.trainer
        if not ray.is_initialized():
            # as verl's own entry point does (verl/trainer/main_ppo.py, run_ppo)
            ray_init = OmegaConf.to_container(self.verl.ray_kwargs.ray_init)
            runtime_env = OmegaConf.merge(
                get_ppo_ray_runtime_env(self.verl), ray_init.pop("runtime_env", None) or {}
            )
            ray.init(**ray_init, runtime_env=OmegaConf.to_container(runtime_env))
            self._started_ray = True
        pool = RayResourcePool(
            process_on_nodes=[trainer.n_gpus_per_node] * trainer.nnodes, use_gpu=True, max_colocate_count=1
        )
        worker = RayClassWithInitArgs(
            cls=ray.remote(ActorRolloutRefWorker), config=self.verl.actor_rollout_ref, role="actor"
        )
        workers = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker, device_name=trainer.device)
        workers.init_model()
        return workers

    def _tensordict(self, batch: VerlBatch, **meta: Any) -> Any:
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        td = left_right_2_no_padding(batch.to_dataproto().to_tensordict())
        tu.assign_non_tensor(td, **meta)
        return td

    def _log_probs(self, batch: VerlBatch, *, reference: bool) -> Any:
        """Per-token logprobs ``(B, R)`` of the responses under the actor (``reference``: with its LoRA
        adapter switched off, i.e. the base model)."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        meta: dict[str, Any] = {"calculate_entropy": False, "compute_loss": False}
        if reference:
            meta["no_lora_adapter"] = True
        td = self._tensordict(batch, **meta)
        out = self.workers.compute_log_prob(td)
        return no_padding_2_padding(tu.get(out, "log_probs"), td).float()

    def update(self, samples: Sequence[Any], *, group_of: Mapping[str, str] | None = None) -> Any:
        """One optimizer step of verl's actor on ``samples``; returns
        :class:`~agl_trainer.learning.update.UpdateStats` (``loss`` is verl's policy loss, ``approx_kl``
        its ``ppo_kl``)."""
        from verl.utils import tensordict_utils as tu
        from verl.utils.metric import reduce_metrics

        from .update import UpdateStats

        actor = self.verl.actor_rollout_ref.actor
        batch = pad_batch(
            to_verl_batch(samples, pad_id=self.pad_id, group_of=group_of), self.workers.world_size
        )
        if (
            "old_log_probs" not in batch.tensors
        ):  # calls without behaviour logprobs: ratio 1, as in the torch backend
            batch = batch.with_tensors(old_log_probs=self._log_probs(batch, reference=False))
        if actor.use_kl_loss:
            batch = batch.with_tensors(ref_log_prob=self._log_probs(batch, reference=True))
        td = self._tensordict(
            batch,
            calculate_entropy=bool(actor.calculate_entropy or actor.entropy_coeff != 0),
            # losses are averaged over the real sequences; the padding rows are masked out
            global_batch_size=len(samples),
            mini_batch_size=len(batch),
            epochs=int(actor.ppo_epochs),
            seed=int(actor.data_loader_seed),
            dataloader_kwargs={"shuffle": bool(actor.shuffle)},
            compute_loss=True,
        )
        metrics = reduce_metrics(dict(tu.get(self.workers.update_actor(td), "metrics")))
        self.last_metrics = metrics

        def pick(*keys: str) -> float:
            return next((float(metrics[k]) for k in keys if k in metrics), 0.0)

        return UpdateStats(
            loss=pick("actor/pg_loss", "loss"),
            transitions=len(samples),
            rollouts=len({s.transition.rollout_id for s in samples}),
            tokens=sum(len(s.transition.response_ids) for s in samples),
            clip_fraction=pick("actor/pg_clipfrac"),
            approx_kl=pick("actor/ppo_kl"),
            grad_norm=pick("grad_norm", "actor/grad_norm"),
            kl_to_reference=pick("kl_loss", "actor/kl_loss"),
        )

    def export_adapter(self, version: int) -> Path:
        """The actor's current LoRA adapter as a PEFT directory (``adapter_config.json`` +
        ``adapter_model.safetensors``) for ``serving.publish_adapter(path, version)``.

        Uses verl's documented route: the worker group's ``save_checkpoint``, then
        ``python -m verl.model_merger merge --backend fsdp``, which writes the adapter to
        ``<target>/lora_adapter`` (and the merged model beside it, deleted here: the slow part for big
        models).
        """
        checkpoint = self.work_dir / "checkpoint"
        merged = self.work_dir / f"merged-v{version}"
        target = self.work_dir / "adapters" / f"v{version}"
        self.workers.save_checkpoint(local_path=str(checkpoint), global_step=version, max_ckpt_to_keep=1)
        command = [
            sys.executable,
            "-m",
            "verl.model_merger",
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            str(checkpoint),
            "--target_dir",
            str(merged),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not (merged / "lora_adapter" / "adapter_config.json").is_file():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise RuntimeError(
                f"verl's model merger made no LoRA adapter from {checkpoint}"
                f" (status {done.returncode}): {tail}"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        (merged / "lora_adapter").rename(target)
        shutil.rmtree(merged, ignore_errors=True)
        return target

    def close(self) -> None:
        """Shut Ray down (and with it the workers) if this updater started it."""
        import ray

        if self._started_ray and ray.is_initialized():
            ray.shutdown()
