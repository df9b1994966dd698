"""Prefill without padding: the not-yet-cached tails of several prompts go through the model as one sequence.

When prompts start from cached prefixes, what is left to compute of each is short and of its own length
(an agent's question after its shared system prompt: 20 to 50 tokens), so padding them to one width wastes
a quarter or more of a prefill pass's matrix work. A packed pass instead feeds the tails one after another
as a single row: every weight multiplies exactly the real tokens. Attention is the one step that must know
where each tail belongs. While a packed pass runs (:func:`packed_attention_for`), the model's attention
implementation is :func:`packed_attention`, which gives each tail's queries its own slot's keys and values
(the cached prefix and the tail itself, causally), grouped-query heads without repeating keys, and hands
any other call to transformers' ``sdpa`` unchanged.

The attention implementation is a setting of the model's config (every attention layer reads it per
call); it is switched for the pass and restored after, under the backend's lock, which every forward pass
of the served model takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["NAME", "Segment", "packed_attention", "packed_attention_for", "register"]

#: The name the attention function is registered under in transformers.
NAME = "agl_packed"

_current = threading.local()


@dataclasses.dataclass(frozen=True)
class Segment:
    """One prompt's tail in a packed pass: its tokens ``offset .. offset + length - 1`` of the pass are
    positions ``start .. start + length - 1`` of the sequence in cache slot ``slot``."""

    slot: int
    offset: int
    start: int
    length: int


@dataclasses.dataclass
class _Pass:
    segments: Sequence[Segment]
    #: Per segment, the causal mask of its queries (heads of a group stacked) over its columns.
    masks: list[torch.Tensor]
    #: Attention layers that went through :func:`packed_attention` in this pass.
    calls: int = 0


@functools.cache
def register() -> str:
    """Make :func:`packed_attention` known to transformers (once per process); its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, packed_attention)
    return NAME


def _masks(segments: Sequence[Segment], groups: int, device: torch.device) -> list[torch.Tensor]:
    masks = []
    for segment in segments:
        positions = torch.arange(segment.start, segment.start + segment.length)
        mask = torch.arange(segment.start + segment.length)[None, :] <= positions[:, None]
        masks.append(mask.repeat(groups, 1)[None, None].to(device))  # query row g * length + i: token i
    return masks


@contextlib.contextmanager
def packed_attention_for(model: Any, segments: Sequence[Segment]) -> Iterator[Callable[[], int]]:
    """During this block, ``model``'s forward passes are packed passes over ``segments``. Yields a
    function saying how many attention layers have gone through :func:`packed_attention` (a model whose
    layers do not read the configured implementation would attend to the wrong keys)."""
    config = model.config
    heads = int(config.num_attention_heads)
    groups = heads // int(getattr(config, "num_key_value_heads", None) or heads)
    device = next(iter(model.parameters())).device
    previous = config._attn_implementation
    state = _current.state = _Pass(segments, _masks(segments, groups, device))
    config._attn_implementation = register()
    try:
        yield lambda: state.calls
    finally:
        config._attn_implementation = previous
        _current.state = None


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface. ``query`` is ``[1, heads, tokens, dim]`` (the packed
    tails); ``key`` and ``value`` are the whole cache layers ``[slots, kv_heads, columns, dim]`` that the
    pass's cache returned. The output is ``[1, tokens, heads, dim]``."""
    state: _Pass | None = getattr(_current, "state", None)
    if state is None:  # not inside a packed pass (another thread): the usual implementation
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    state.calls += 1
    heads, dim = query.shape[1], query.shape[-1]
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    outputs = []
    for segment, mask in zip(state.segments, state.masks, strict=True):
        end = segment.start + segment.length
        # the kv-head's query heads stacked along the tokens: [kv_heads, groups * length, dim]
        q = query[0, :, segment.offset : segment.offset + segment.length]
        q = q.reshape(kv_heads, groups * segment.length, dim)
        out = torch.nn.functional.scaled_dot_product_attention(
            q[None],
            key[segment.slot : segment.slot + 1, :, :end],
            value[segment.slot : segment.slot + 1, :, :end],
            attn_mask=mask,
            dropout_p=dropout,
            scale=scaling,
        )
        outputs.append(out[0].reshape(heads, segment.length, dim))
    return torch.cat(outputs, dim=1).transpose(0, 1)[None].contiguous(), None
