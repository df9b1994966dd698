"""One policy update from advantaged transitions: PPO-clip, loss normalised per rollout.

Each transition (one LLM call) is its own sample: prompt + response, loss on the response tokens only.
A transition's loss is the mean over its response tokens; a rollout's is the mean over its transitions;
the batch loss is the mean over rollouts, so a rollout with many calls weighs as much as one with few.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from .algo import Advantaged

__all__ = ["UpdateStats", "ppo_clip_token_loss", "response_logprobs", "update_step", "batch_loss"]


@dataclasses.dataclass(frozen=True)
class UpdateStats:
    loss: float
    transitions: int
    rollouts: int
    tokens: int
    clip_fraction: float
    approx_kl: float
    grad_norm: float


def ppo_clip_token_loss(
    new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantage: torch.Tensor, clip_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss ``-min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)`` and whether it clipped."""
    ratio = torch.exp(new_logprobs - old_logprobs)
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantage
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)


def response_logprobs(model: Any, samples: Sequence[Advantaged], pad_id: int) -> list[torch.Tensor]:
    """Log-probabilities of each sample's response tokens under ``model`` (one tensor per sample)."""
    seqs = [list(s.transition.prompt_ids) + list(s.transition.response_ids) for s in samples]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits
    out = []
    for i, s in enumerate(samples):
        start = len(s.transition.prompt_ids)
        end = start + len(s.transition.response_ids)
        # the token at position p is predicted by the logits at p - 1
        step_logits = logits[i, start - 1 : end - 1].float()
        targets = torch.tensor(s.transition.response_ids, dtype=torch.long)
        out.append(torch.log_softmax(step_logits, dim=-1).gather(1, targets[:, None]).squeeze(1))
    return out


def _micro_batches(samples: Sequence[Advantaged], max_tokens: int) -> list[list[Advantaged]]:
    """Group samples (longest first) so that each padded micro-batch stays within ``max_tokens``."""
    ordered = sorted(samples, key=lambda s: -(len(s.transition.prompt_ids) + len(s.transition.response_ids)))
    batches: list[list[Advantaged]] = []
    current: list[Advantaged] = []
    width = 0
    for s in ordered:
        length = len(s.transition.prompt_ids) + len(s.transition.response_ids)
        if current and max(width, length) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, width = [], 0
        current.append(s)
        width = max(width, length)
    if current:
        batches.append(current)
    return batches


def batch_loss(
    model: Any,
    samples: Sequence[Advantaged],
    *,
    clip_eps: float,
    pad_id: int,
    micro_batch_tokens: int = 4096,
    backward: bool = False,
) -> tuple[float, dict[str, float]]:
    """The per-rollout-normalised PPO-clip loss of ``samples``; with ``backward``, accumulate gradients.

    Returns (loss, {"tokens", "clip_fraction", "approx_kl"}). Samples without behaviour logprobs use the
    current policy's (ratio 1: plain policy gradient).
    """
    calls_per_rollout = Counter(s.transition.rollout_id for s in samples)
    n_rollouts = len(calls_per_rollout)
    total = 0.0
    tokens = clipped = 0
    kl_sum = 0.0
    for micro in _micro_batches(samples, micro_batch_tokens):
        new = response_logprobs(model, micro, pad_id)
        losses = []
        for s, lp in zip(micro, new):
            behaviour = s.transition.response_logprobs
            old = torch.tensor(behaviour, dtype=lp.dtype) if behaviour is not None else lp.detach()
            token_loss, was_clipped = ppo_clip_token_loss(lp, old, torch.tensor(s.advantage, dtype=lp.dtype), clip_eps)
            weight = 1.0 / (n_rollouts * calls_per_rollout[s.transition.rollout_id])
            losses.append(token_loss.mean() * weight)
            tokens += lp.numel()
            clipped += int(was_clipped.sum())
            kl_sum += float((old - lp.detach()).sum())
        loss = torch.stack(losses).sum()
        if backward:
            loss.backward()
        total += float(loss.detach())
    return total, {
        "tokens": float(tokens),
        "clip_fraction": clipped / max(tokens, 1),
        "approx_kl": kl_sum / max(tokens, 1),
    }


def update_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Advantaged],
    *,
    clip_eps: float,
    pad_id: int,
    max_grad_norm: float = 1.0,
    micro_batch_tokens: int = 4096,
) -> UpdateStats:
    """One optimizer step on ``samples`` (gradient accumulation over token-budgeted micro-batches)."""
    if not samples:
        raise ValueError("update_step needs at least one sample")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss, info = batch_loss(
        model, samples, clip_eps=clip_eps, pad_id=pad_id, micro_batch_tokens=micro_batch_tokens, backward=True
    )
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)) if params else 0.0
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return UpdateStats(
        loss=loss,
        transitions=len(samples),
        rollouts=len({s.transition.rollout_id for s in samples}),
        tokens=int(info["tokens"]),
        clip_fraction=info["clip_fraction"],
        approx_kl=info["approx_kl"],
        grad_norm=grad_norm,
    )
