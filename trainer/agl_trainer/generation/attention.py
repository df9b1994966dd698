"""Attention over the transformers backend's slot cache, where transformers' own implementation would
either waste work or read the same memory many times.

Packed prefill (:class:`Packed`)
    When prompts start from cached prefixes, what is left to compute of each is short and of its own
    length (an agent's question after its shared system prompt: 20 to 50 tokens), so padding them to one
    width wastes a quarter or more of a prefill pass's matrix work. A packed pass feeds the tails one after
    another as a single row, so every weight multiplies exactly the real tokens; attention gives each
    tail's queries its own slot's keys and values (its cached prefix and itself, causally), grouped-query
    heads without repeating keys.

Shared-prefix decoding (:class:`SharedPrefix`)
    Rows decoded together after one agent's prompt hold the same prefix keys and values in every slot
    (copies of the same prefix-cache blocks); plain attention reads them once per row, 16 times for 16
    rows, which on a CPU costs a decoding step more than a third of its time. Here each layer attends all
    rows' queries to one slot's copy of the shared columns at once, each row to its own columns after
    them, and merges the two softmaxes by their log-sum-exps (cascade attention, as FlashInfer does).

While such a pass runs (:func:`attention_for`), the model's attention implementation is
:func:`slot_attention`; any call it does not expect goes to transformers' ``sdpa`` unchanged. The
implementation is a setting of the model's config (every attention layer reads it per call); it is
switched for the pass and restored after, under the backend's lock, which every forward pass of the
served model takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "NAME",
    "Packed",
    "Segment",
    "SharedPrefix",
    "attention_for",
    "decode_attention",
    "register",
    "slot_attention",
]

#: The name the attention function is registered under in transformers.
NAME = "agl_slots"

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
class Packed:
    """A packed prefill pass over ``segments`` (module docstring)."""

    segments: Sequence[Segment]
    #: Per segment, the causal mask of its queries (heads of a group stacked) over its columns.
    masks: list[torch.Tensor] = dataclasses.field(default_factory=list)
    calls: int = 0


@dataclasses.dataclass
class SharedPrefix:
    """A decoding step whose rows all hold the same first ``length`` columns (module docstring); slot
    ``source``'s copy is read for all of them."""

    length: int
    source: int = 0
    calls: int = 0


@functools.cache
def register() -> str:
    """Make :func:`slot_attention` known to transformers (once per process); its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, slot_attention)
    return NAME


@contextlib.contextmanager
def attention_for(model: Any, state: Packed | SharedPrefix) -> Iterator[Callable[[], int]]:
    """During this block, ``model``'s forward passes are ``state``'s kind of pass. Yields a function
    saying how many attention layers have gone through :func:`slot_attention` (a model whose layers do not
    read the configured implementation would attend to the wrong keys)."""
    config = model.config
    if isinstance(state, Packed):
        heads = int(config.num_attention_heads)
        groups = heads // int(getattr(config, "num_key_value_heads", None) or heads)
        device = next(iter(model.parameters())).device
        state.masks = [_causal(segment, groups, device) for segment in state.segments]
    previous = config._attn_implementation
    _current.state = state
    config._attn_implementation = register()
    try:
        yield lambda: state.calls
    finally:
        config._attn_implementation = previous
        _current.state = None


def _causal(segment: Segment, groups: int, device: torch.device) -> torch.Tensor:
    positions = torch.arange(segment.start, segment.start + segment.length)
    mask = torch.arange(segment.start + segment.length)[None, :] <= positions[:, None]
    return mask.repeat(groups, 1)[None, None].to(device)  # query row g * length + i: token i


def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: ``query`` ``[batch, heads, tokens, dim]`` in, the output
    ``[batch, tokens, heads, dim]`` back."""
    state = getattr(_current, "state", None)
    if isinstance(state, Packed):
        state.calls += 1
        return _packed(state, query, key, value, dropout, scaling), None
    if isinstance(state, SharedPrefix) and query.shape[2] == 1 and attention_mask is not None:
        state.calls += 1
        return _shared(state, query, key, value, attention_mask, scaling), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    shared: int,
    scaling: float,
) -> torch.Tensor:
    """One decoding step's attention outside transformers (:mod:`.direct_decode`): ``query`` ``[rows, heads,
    1, dim]``, ``key`` and ``value`` the rows' windows ``[rows, kv_heads, width, dim]``, ``mask``
    ``[rows, 1, 1, width]`` (True: attend); with ``shared`` > 0, the first ``shared`` columns are the same
    in every row and are read once (module docstring). The output ``[rows, 1, heads, dim]``."""
    if shared > 0:
        return _shared(SharedPrefix(shared), query, key, value, mask, scaling)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2)


def _packed(
    state: Packed,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """``query`` ``[1, heads, tokens, dim]`` holds the packed tails; ``key`` and ``value`` are the whole
    cache layers ``[slots, kv_heads, columns, dim]``."""
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
    return torch.cat(outputs, dim=1).transpose(0, 1)[None].contiguous()


def _shared(
    state: SharedPrefix,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """One decoding step: ``query`` ``[rows, heads, 1, dim]``, ``key`` and ``value`` the rows' windows
    ``[rows, kv_heads, width, dim]``, ``mask`` ``[rows, 1, 1, width]``."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    shared = state.length
    scale = scaling if scaling is not None else dim**-0.5
    q = query.reshape(rows, kv_heads, groups, dim)
    # every row's queries against the one copy of the shared columns: [1, kv_heads, rows * groups, dim]
    q_all = q.transpose(0, 1).reshape(1, kv_heads, rows * groups, dim)
    source = slice(state.source, state.source + 1)
    out_shared, lse_shared = _attend(q_all, key[source, :, :shared], value[source, :, :shared], None, scale)
    out_shared = out_shared.reshape(kv_heads, rows, groups, dim).transpose(0, 1)
    lse_shared = lse_shared.reshape(kv_heads, rows, groups).transpose(0, 1)
    # each row against its own columns after them (its newest token among them: never empty)
    own_mask = mask[:, :, :, shared:]
    out_own, lse_own = _attend(q, key[:, :, shared:], value[:, :, shared:], own_mask, scale)
    lse = torch.logaddexp(lse_shared, lse_own)
    out = out_shared * torch.exp(lse_shared - lse)[..., None] + out_own * torch.exp(lse_own - lse)[..., None]
    return out.reshape(rows, 1, heads, dim).to(query.dtype)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and the log-sum-exp of each query's scores: ``q`` ``[b, h, n, d]`` against ``k``
    and ``v`` ``[b, h, m, d]``, ``mask`` (True: attend) broadcast to ``[b, h, n, m]``. PyTorch's CPU flash
    kernel, which returns the log-sum-exp, in float32 on the CPU; plain products elsewhere."""
    if q.device.type == "cpu" and q.dtype == torch.float32:
        additive = None
        if mask is not None:
            additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~mask, float("-inf")
            )
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=additive, scale=scale
        )
        return out, lse
    return attend_plain(q, k, v, mask, scale)


def attend_plain(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_attend` with matrix products, in float32 whatever the inputs' dtype."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float())
    return out, lse
