"""One policy update from advantaged transitions: PPO-clip (optionally with a higher upper bound) with an
optional KL penalty to a reference policy.

Each transition (one LLM call) is its own sample: prompt + response, loss on the response tokens only.
How the token losses are averaged (``algorithm.loss_norm``, :func:`loss_weights`): ``rollout`` (default) takes
a transition's mean over its response tokens, a rollout's mean over its transitions and the batch's mean
over rollouts, so a rollout with many calls weighs as much as one with few; ``token`` weighs every response
token of the batch alike (DAPO); ``constant`` sums a rollout's token losses and divides by a fixed
``norm_tokens`` (Dr. GRPO).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from .algo import Advantaged

if TYPE_CHECKING:
    from ..config import AlgorithmConfig, UpdateConfig

__all__ = [
    "UpdateSettings",
    "UpdateStats",
    "batch_loss",
    "kl_k3",
    "loss_weights",
    "ppo_clip_token_loss",
    "reference_logprobs_fn",
    "response_logprobs",
    "update_step",
]

ReferenceFn = Callable[[Sequence[Advantaged]], list[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
    """What an update step takes from the config (``algorithm`` and ``update``), for the device the model
    is on: the one place that maps those sections to :func:`update_step`'s and
    :func:`~agl_trainer.learning.finetune.sft_update_step`'s arguments."""

    clip_eps: float
    max_grad_norm: float
    micro_batch_tokens: int
    kl_coef: float
    bf16: bool
    recompute: bool
    clip_eps_high: float | None = None
    loss_norm: str = "rollout"
    norm_tokens: int | None = None

    @classmethod
    def of(cls, algorithm: AlgorithmConfig, update: UpdateConfig, device: torch.device) -> UpdateSettings:
        return cls(
            clip_eps=algorithm.clip_eps,
            max_grad_norm=algorithm.max_grad_norm,
            micro_batch_tokens=algorithm.micro_batch_tokens_on(device),
            kl_coef=algorithm.kl_coef,
            bf16=update.bf16,
            recompute=update.recompute_on(device),
            clip_eps_high=algorithm.clip_eps_high,
            loss_norm=algorithm.loss_norm,
            norm_tokens=algorithm.norm_tokens,
        )

    def ppo(self) -> dict[str, Any]:
        """Keyword arguments of :func:`update_step`."""
        return dataclasses.asdict(self)

    def sft(self) -> dict[str, Any]:
        """Keyword arguments of :func:`~agl_trainer.learning.finetune.sft_update_step` (no clipping, KL or
        recomputation: its loss is the next-token loss alone)."""
        return {
            "max_grad_norm": self.max_grad_norm,
            "micro_batch_tokens": self.micro_batch_tokens,
            "bf16": self.bf16,
        }


@runtime_checkable
class _Wrapper(Protocol):
    """A model wrapping another (a peft ``PeftModel`` around the Hugging Face model)."""

    def get_base_model(self) -> torch.nn.Module: ...


@runtime_checkable
class _AdapterSwitch(Protocol):
    """A model whose adapter can be switched off for a while (peft's ``PeftModel.disable_adapter``)."""

    def disable_adapter(self) -> contextlib.AbstractContextManager[object]: ...


@dataclasses.dataclass(frozen=True)
class UpdateStats:
    loss: float
    transitions: int
    rollouts: int
    tokens: int
    clip_fraction: float
    approx_kl: float
    grad_norm: float
    kl_to_reference: float = 0.0


def ppo_clip_token_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantage: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss ``-min(ratio * A, clip(ratio, 1-eps, 1+eps_high) * A)`` and whether it
    clipped; ``clip_eps_high`` defaults to ``clip_eps`` (symmetric clipping)."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(new_logprobs - old_logprobs)
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * advantage
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)


def kl_k3(new_logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(new || ref): ``exp(ref - new) - (ref - new) - 1`` (non-negative, unbiased)."""
    delta = ref_logprobs - new_logprobs
    return torch.exp(delta) - delta - 1.0


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager[Any]:
    if bf16 and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if isinstance(model, _Wrapper) else model


def _selects_logits(model: torch.nn.Module) -> bool:
    """Whether ``model(..., logits_to_keep=mask)`` takes a boolean (batch, seq) mask: Hugging Face models
    whose module slices through transformers' ``slice_logits_to_keep`` do (transformers 5)."""
    base = _base_model(model)
    module = sys.modules.get(type(base).__module__)
    return getattr(module, "slice_logits_to_keep", None) is not None


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward accepts ``logits_to_keep`` (an int: keep the last positions)."""
    base = _base_model(model)
    try:
        return "logits_to_keep" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False


def _logits_at(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """The logits at the positions where ``keep`` (batch, seq) is true, as one (positions, vocab) tensor.

    The vocabulary projection is the costliest layer per position; only the positions that predict a response
    token go through it where the model allows (never the prompt's), and the logits are gathered in one
    indexing op (one gradient buffer for the whole micro-batch, not one per sample).
    """
    # A Hugging Face model's forward returns an output object (typed Any through nn.Module.__call__)
    logits: torch.Tensor
    if _selects_logits(model):
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
    elif _takes_logits_to_keep(model):
        first = int(keep.any(dim=0).nonzero()[0])
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=ids.shape[1] - first).logits
        logits = logits[keep[:, first:]]
    else:
        logits = model(input_ids=ids, attention_mask=mask).logits[keep]
    if logits.dim() != 2 or logits.shape[0] != int(keep.sum()):
        raise RuntimeError(
            f"{type(model).__name__} returned logits of shape {tuple(logits.shape)} for {int(keep.sum())}"
            " kept positions; its forward does not slice logits_to_keep as transformers' models do"
        )
    return logits


def response_logprobs(
    model: torch.nn.Module, samples: Sequence[Advantaged], pad_id: int, *, bf16: bool = False
) -> list[torch.Tensor]:
    """Log-probabilities (float32, on the model's device) of each sample's response tokens under ``model``."""
    device = _device(model)
    seqs = [list(s.transition.prompt_ids) + list(s.transition.response_ids) for s in samples]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    # the token at position p is predicted by the logits at p - 1
    keep = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, (s, seq) in enumerate(zip(samples, seqs, strict=True)):
        start = len(s.transition.prompt_ids)
        if start == 0:
            raise ValueError(
                f"transition {s.transition.rollout_id}#{s.transition.call_index} has no prompt tokens; "
                "its first response token has nothing to be predicted from"
            )
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        keep[i, start - 1 : len(seq) - 1] = True
    with _autocast(device, bf16):
        logits = _logits_at(model, ids.to(device), mask.to(device), keep.to(device))
    return _response_token_logprobs(logits, samples)


def _response_token_logprobs(logits: torch.Tensor, samples: Sequence[Advantaged]) -> list[torch.Tensor]:
    """Each sample's response-token logprobs from ``logits``: one row per response token, the samples'
    responses one after another (the row predicting each token)."""
    targets = torch.tensor(
        [t for s in samples for t in s.transition.response_ids], dtype=torch.long, device=logits.device
    )
    logits = logits.float()
    # log_softmax(logits)[target] without a second (positions, vocab) tensor kept for the backward pass
    logprobs = logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
    return list(torch.split(logprobs, [len(s.transition.response_ids) for s in samples]))


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (transformers' ``GradientCheckpointingLayer``s, outermost only)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers: list[torch.nn.Module] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, GradientCheckpointingLayer) and not any(
            name.startswith(prefix + ".") for prefix in inside
        ):
            layers.append(module)
            inside.append(name)
    return layers


@contextlib.contextmanager
def _recomputed(layers: Sequence[torch.nn.Module]) -> Any:
    """Run ``layers`` under activation checkpointing while the block lasts: each keeps only its inputs for
    the backward pass, which runs it again to get the rest. transformers' own gradient checkpointing turns
    the key/value cache off, which the shared-prompt pass needs; this keeps it (see :func:`_prompt_cache`)."""
    from torch.utils.checkpoint import checkpoint

    def checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

        return run

    for layer in layers:
        layer.forward = checkpointed(layer.forward)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _prompt_cache() -> Any:
    """A key/value cache for a prompt run once under :func:`_recomputed` layers: when the backward pass runs
    a layer again, the layer's keys and values replace those it wrote the first time instead of being
    appended to them (which would double the prompt)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class PromptCache(DynamicCache):
        def update(
            self,
            key_states: torch.Tensor,
            value_states: torch.Tensor,
            layer_idx: int,
            *args: Any,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
            if isinstance(layer, DynamicLayer) and layer.is_initialized:
                # a DynamicLayer's reset drops its tensors (never zeroes them in place: the first pass's
                # keys and values are in the autograd graph)
                layer.reset()
            result: tuple[torch.Tensor, torch.Tensor] = super().update(
                key_states, value_states, layer_idx, *args, **kwargs
            )
            return result

    return PromptCache()


def _shared_prompt_logprobs(
    model: torch.nn.Module,
    samples: Sequence[Advantaged],
    pad_id: int,
    *,
    bf16: bool = False,
    recompute: bool = False,
) -> list[torch.Tensor] | None:
    """:func:`response_logprobs` for samples that share one prompt (a task group's rollouts), with the
    prompt run through the model once: its keys and values, computed with gradients, are repeated for each
    response, and the responses run as one batch on top of them. The same numbers as running each sequence
    whole (attention over the prompt is the same), the prompt's gradients summed over the responses, for
    a fraction of the work when the prompt is long and the responses short. None when the model does not
    take a cache this way (the caller then runs the sequences whole).

    With ``recompute``, the prompt's layers keep only their inputs for the backward pass, which runs them
    again: a prompt's activations cost about 1.3 MB per token for a 135M model, so a long prompt is the
    update's memory peak; recomputing it costs one more forward pass of the prompt."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from ..model import cache_key

    device = _device(model)
    prompt = list(samples[0].transition.prompt_ids)
    responses = [list(s.transition.response_ids) for s in samples]
    width = max(len(r) for r in responses)
    k, start = len(samples), len(prompt)
    layers = _decoder_layers(model) if recompute and torch.is_grad_enabled() else []
    with _autocast(device, bf16):
        key = cache_key()
        try:
            with _recomputed(layers) if layers else contextlib.nullcontext():
                head = model(
                    input_ids=torch.tensor([prompt], device=device),
                    use_cache=True,
                    logits_to_keep=1,
                    **{key: _prompt_cache() if layers else DynamicCache()},
                )
        except TypeError:
            return None
        written = getattr(head, key, None)
        if not isinstance(written, DynamicCache) or written.get_seq_length() != start:
            return None
        if layers:
            # the responses get a cache of their own, the prompt's keys and values once per response; the
            # prompt's cache stays as it is, for its layers run again in the backward pass
            cache = DynamicCache()
            for index, layer in enumerate(written.layers):
                if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
                    return None
                cache.update(
                    layer.keys.repeat_interleave(k, dim=0), layer.values.repeat_interleave(k, dim=0), index
                )
        else:
            cache = written
            cache.batch_repeat_interleave(k)
        ids = torch.full((k, width), pad_id, dtype=torch.long)
        mask = torch.zeros((k, start + width), dtype=torch.long)
        mask[:, :start] = 1
        for i, r in enumerate(responses):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, start : start + len(r)] = 1
        positions = torch.arange(start, start + width)[None, :].expand(k, width)
        tail = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            use_cache=True,
            **{key: cache},
        ).logits
    first = head.logits[:, -1]  # predicts every response's first token
    # response token j > 0 is predicted by the logits at response position j - 1
    rows = [torch.cat([first, tail[i, : len(r) - 1]]) for i, r in enumerate(responses)]
    return _response_token_logprobs(torch.cat(rows), samples)


def _prompt_groups(
    samples: Sequence[Advantaged], max_tokens: int
) -> tuple[list[list[Advantaged]], list[Advantaged]]:
    """The samples that share their prompt with others, in micro-batches of one prompt each, and the
    samples whose prompt is their own. The prompt runs once, like one whole sequence of the other
    micro-batches; its padded responses together stay within ``max_tokens`` (a prompt with more is split)."""
    by_prompt: dict[tuple[int, ...], list[Advantaged]] = {}
    for s in samples:
        by_prompt.setdefault(tuple(s.transition.prompt_ids), []).append(s)
    shared: list[list[Advantaged]] = []
    alone: list[Advantaged] = []
    for prompt, group in by_prompt.items():
        if len(group) < 2 or not prompt:
            alone.extend(group)
            continue
        group = sorted(group, key=lambda s: -len(s.transition.response_ids))
        current: list[Advantaged] = []
        for s in group:
            width = len(current[0].transition.response_ids) if current else len(s.transition.response_ids)
            if current and width * (len(current) + 1) > max_tokens:
                shared.append(current)
                current = []
            current.append(s)
        shared.append(current)
    return [m for m in shared if len(m) > 1], alone + [m[0] for m in shared if len(m) == 1]


def reference_logprobs_fn(
    model: torch.nn.Module,
    pad_id: int,
    reference: torch.nn.Module | None = None,
    *,
    bf16: bool = False,
    adapter: Path | None = None,
) -> ReferenceFn:
    """How to get the reference policy's logprobs: a separate frozen ``reference`` model; for a LoRA (peft)
    model, the same model with its adapter switched off (the base model); or, with ``adapter`` (a PEFT
    ``adapter_model.safetensors`` of the trained adapter's shape, such as the warm start), the same model
    with those weights in its adapter for the while (no second copy of the model in memory)."""
    swap = _AdapterSwap(model, adapter) if adapter is not None else None

    def compute(samples: Sequence[Advantaged]) -> list[torch.Tensor]:
        with torch.no_grad():
            if reference is not None:
                return response_logprobs(reference, samples, pad_id, bf16=bf16)
            if swap is not None:
                with swap.reference():
                    return response_logprobs(model, samples, pad_id, bf16=bf16)
            if not isinstance(model, _AdapterSwitch):
                raise ValueError("a KL penalty with full fine-tuning needs a reference model")
            with model.disable_adapter():
                return response_logprobs(model, samples, pad_id, bf16=bf16)

    return compute


class _AdapterSwap:
    """A LoRA model's trainable adapter weights exchanged with a reference adapter's while a block runs
    (under ``no_grad``), and restored after it: the KL reference of ``algorithm.kl_reference``. The
    optimizer keeps the same parameter tensors; only their values change for the while."""

    def __init__(self, model: torch.nn.Module, weights: Path) -> None:
        from ..model import load_adapter_weights
        from ..saved import adapter_shapes

        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        tensors = len(adapter_shapes(weights))
        if tensors != len(self.params):
            raise ValueError(
                f"algorithm.kl_reference: {weights} has {tensors} tensors, the trained adapter"
                f" {len(self.params)}: it does not fit model.lora"
            )
        current = [p.detach().clone() for _, p in self.params]
        try:
            unexpected = load_adapter_weights(model, weights)
        except RuntimeError as exc:  # a shape that does not fit
            raise ValueError(f"algorithm.kl_reference: {weights} does not fit model.lora: {exc}") from None
        finally:
            self.values = [p.detach().clone() for _, p in self.params]
            self._load(current)
        if unexpected:
            raise ValueError(
                f"algorithm.kl_reference: {weights} does not fit model.lora (keys {unexpected[:3]})"
            )

    def _load(self, values: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for (_, p), value in zip(self.params, values, strict=True):
                p.copy_(value)

    @contextlib.contextmanager
    def reference(self) -> Any:
        current = [p.detach().clone() for _, p in self.params]
        self._load(self.values)
        try:
            yield
        finally:
            self._load(current)


def _micro_batches(samples: Sequence[Advantaged], max_tokens: int) -> list[list[Advantaged]]:
    """Group samples (longest first) so that each padded micro-batch stays within ``max_tokens``."""
    from ..model import padded_groups

    def length(s: Advantaged) -> int:
        return len(s.transition.prompt_ids) + len(s.transition.response_ids)

    return padded_groups(sorted(samples, key=lambda s: -length(s)), length, max_tokens)


LOSS_NORMS = ("rollout", "token", "constant")


def loss_weights(
    samples: Sequence[Advantaged], loss_norm: str = "rollout", norm_tokens: int | None = None
) -> list[float]:
    """Per sample, the weight of its mean token loss in the batch loss (``algorithm.loss_norm``); with
    ``n`` its response tokens, ``c`` its rollout's calls, ``R`` the batch's rollouts and ``N`` the batch's
    response tokens:

    * ``rollout``: ``1 / (c * R)``: the mean over a call's tokens, over a rollout's calls, over rollouts;
    * ``token``: ``n / N``: every token of the batch alike (DAPO);
    * ``constant``: ``n / (norm_tokens * R)``: a rollout's summed token losses over a fixed budget, the
      mean over rollouts (Dr. GRPO).
    """
    if loss_norm not in LOSS_NORMS:
        raise ValueError(f"unknown loss_norm {loss_norm!r}; choose one of {', '.join(LOSS_NORMS)}")
    calls_per_rollout = Counter(s.transition.rollout_id for s in samples)
    n_rollouts = len(calls_per_rollout)
    if loss_norm == "token":
        total = sum(len(s.transition.response_ids) for s in samples)
        return [len(s.transition.response_ids) / max(total, 1) for s in samples]
    if loss_norm == "constant":
        if norm_tokens is None or norm_tokens < 1:
            raise ValueError("loss_norm 'constant' needs norm_tokens >= 1")
        return [len(s.transition.response_ids) / (norm_tokens * n_rollouts) for s in samples]
    return [1.0 / (n_rollouts * calls_per_rollout[s.transition.rollout_id]) for s in samples]


def batch_loss(
    model: torch.nn.Module,
    samples: Sequence[Advantaged],
    *,
    clip_eps: float,
    pad_id: int,
    micro_batch_tokens: int = 4096,
    backward: bool = False,
    kl_coef: float = 0.0,
    reference: ReferenceFn | None = None,
    bf16: bool = False,
    recompute: bool = False,
    clip_eps_high: float | None = None,
    loss_norm: str = "rollout",
    norm_tokens: int | None = None,
) -> tuple[float, dict[str, float]]:
    """The PPO-clip loss of ``samples`` (+ ``kl_coef`` x KL to the reference), averaged as ``loss_norm``
    says (:func:`loss_weights`); with ``backward``, accumulate gradients micro-batch by micro-batch.

    Returns (loss, {"tokens", "clip_fraction", "approx_kl", "kl_to_reference"}). Samples without behaviour
    logprobs use the current policy's (ratio 1: plain policy gradient). ``recompute``: a prompt shared by a
    group keeps only its layers' inputs for the backward pass (see :func:`_shared_prompt_logprobs`).
    """
    if kl_coef > 0 and reference is None:
        raise ValueError("kl_coef > 0 needs a reference (see reference_logprobs_fn)")
    weights = loss_weights(samples, loss_norm, norm_tokens)
    weight_of = {id(s): w for s, w in zip(samples, weights, strict=True)}
    total = 0.0
    tokens = clipped = 0
    kl_sum = ref_kl_sum = 0.0
    shared, alone = _prompt_groups(samples, micro_batch_tokens)
    micro_batches = [(m, True) for m in shared] + [
        (m, False) for m in _micro_batches(alone, micro_batch_tokens)
    ]
    for micro, one_prompt in micro_batches:
        ref = reference(micro) if kl_coef > 0 and reference is not None else None
        new = (
            _shared_prompt_logprobs(model, micro, pad_id, bf16=bf16, recompute=recompute and backward)
            if one_prompt
            else None
        )
        if new is None:
            new = response_logprobs(model, micro, pad_id, bf16=bf16)
        losses = []
        for i, (s, lp) in enumerate(zip(micro, new, strict=True)):
            behaviour = s.transition.response_logprobs
            old = (
                torch.tensor(behaviour, dtype=lp.dtype, device=lp.device)
                if behaviour is not None
                else lp.detach()
            )
            advantage = torch.tensor(s.advantage, dtype=lp.dtype, device=lp.device)
            token_loss, was_clipped = ppo_clip_token_loss(lp, old, advantage, clip_eps, clip_eps_high)
            if ref is not None:
                kl = kl_k3(lp, ref[i])
                token_loss = token_loss + kl_coef * kl
                ref_kl_sum += float(kl.detach().sum())
            losses.append(token_loss.mean() * weight_of[id(s)])
            tokens += lp.numel()
            clipped += int(was_clipped.sum())
            kl_sum += float((old - lp.detach()).sum())
        loss = torch.stack(losses).sum()
        if backward:
            torch.autograd.backward(loss)
        total += float(loss.detach())
    return total, {
        "tokens": float(tokens),
        "clip_fraction": clipped / max(tokens, 1),
        "approx_kl": kl_sum / max(tokens, 1),
        "kl_to_reference": ref_kl_sum / max(tokens, 1),
    }


def apply_gradients(optimizer: torch.optim.Optimizer, max_grad_norm: float) -> float:
    """Clip the accumulated gradients to ``max_grad_norm``, step the optimizer unless the norm is not
    finite (the step is skipped, never applied with NaN), clear the gradients; returns the norm."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)) if params else 0.0
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def update_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Advantaged],
    *,
    clip_eps: float,
    pad_id: int,
    max_grad_norm: float = 1.0,
    micro_batch_tokens: int = 4096,
    kl_coef: float = 0.0,
    reference: ReferenceFn | None = None,
    bf16: bool = False,
    recompute: bool = False,
    clip_eps_high: float | None = None,
    loss_norm: str = "rollout",
    norm_tokens: int | None = None,
) -> UpdateStats:
    """One optimizer step on ``samples`` (gradient accumulation over token-budgeted micro-batches).
    A non-finite gradient norm skips the step (the weights stay as they were)."""
    if not samples:
        raise ValueError("update_step needs at least one sample")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss, info = batch_loss(
        model,
        samples,
        clip_eps=clip_eps,
        pad_id=pad_id,
        micro_batch_tokens=micro_batch_tokens,
        backward=True,
        kl_coef=kl_coef,
        reference=reference,
        bf16=bf16,
        recompute=recompute,
        clip_eps_high=clip_eps_high,
        loss_norm=loss_norm,
        norm_tokens=norm_tokens,
    )
    grad_norm = apply_gradients(optimizer, max_grad_norm)
    return UpdateStats(
        loss=loss,
        transitions=len(samples),
        rollouts=len({s.transition.rollout_id for s in samples}),
        tokens=int(info["tokens"]),
        clip_fraction=info["clip_fraction"],
        approx_kl=info["approx_kl"],
        grad_norm=grad_norm,
        kl_to_reference=info["kl_to_reference"],
    )
