"""The transformers backend's key/value memory: a preallocated cache that batched decoding writes in place,
and a bounded cache of prompt prefixes that calls under the same policy version share.

:class:`SlotCache`
    One tensor holds every layer's keys and values for up to ``slots`` sequences of up to ``capacity``
    tokens (shape ``[slots, layers, 2, kv_heads, capacity + 1, head_dim]``). A sequence owns a slot; its
    tokens sit in columns ``0 .. length - 1`` (a token's column is its position), so rows of different
    lengths need no padding, and a row joining or leaving the batch moves no other row's memory. A forward
    pass writes each new token's key and value in place (:class:`PassCache`), where transformers'
    ``DynamicCache`` concatenates a new tensor per layer per token, and attention reads a window of the
    first ``width`` columns. The last column is scratch: a prefill pass's padding tokens write there, and no
    window includes it. The tensor grows (one copy) only when a joining row needs more slots or columns.

:class:`PrefixCache`
    Keys and values of prompt prefixes in blocks of ``block_tokens`` tokens, found by the chain of token ids
    from the start of the prompt, as vLLM's automatic prefix caching does: a block is reused only when every
    token before it and in it is the same. Entries belong to one policy version of one adapter: the cache
    empties when the version changes or anyone takes the backend's lock to change the weights. Its bytes
    stay within ``max_bytes``: the least recently used blocks go first (a prompt's later blocks before its
    earlier ones, which other prompts are more likely to share).

Both hold plain tensors; nothing here knows about requests or sampling (``hf_backend.py`` does).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

__all__ = [
    "CacheShape",
    "PassCache",
    "PrefixCache",
    "PrefixStats",
    "SlotCache",
    "cache_shape",
    "common_prefix",
]

#: Columns a slot cache keeps beyond the longest sequence asked for when it (re)allocates.
HEADROOM = 64


@dataclasses.dataclass(frozen=True)
class CacheShape:
    """What one token's keys and values take in a model: layers x 2 x kv_heads x head_dim of ``dtype``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    #: The model's attention implementation: ``sdpa`` takes a boolean mask, ``eager`` an additive one.
    attention: str = "sdpa"
    #: Whether prefill passes may pack prompts into one row (:mod:`agl_trainer.packed`): a decoder whose
    #: forward pass takes ``logits_to_keep`` and whose attention layers read the attention implementation
    #: from the config (transformers' own Llama-family models).
    packed: bool = True

    @property
    def token_bytes(self) -> int:
        return (
            self.layers * 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        )


def cache_shape(model: Any) -> CacheShape | None:
    """The :class:`CacheShape` of a decoder with full attention in every layer (Llama, Mistral without
    a sliding window, Qwen2, SmolLM2...), read from its config; ``None`` for anything else (sliding
    windows, linear attention, encoder-decoders), which the backend serves with transformers' own cache."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    try:
        layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    except (AttributeError, TypeError, ValueError):
        return None
    if getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None):
        return None
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention not in ("sdpa", "eager"):  # flash and flex kernels take no 4-D mask of ours
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(kind != "full_attention" for kind in layer_types):
        return None
    parameter = next(iter(model.parameters()))
    return CacheShape(layers, kv_heads, head_dim, parameter.dtype, parameter.device, attention)


class SlotCache:
    """Keys and values of the rows being decoded, one slot per row, written in place (module docstring)."""

    def __init__(self, shape: CacheShape) -> None:
        self.shape = shape
        self.slots = 0
        self.capacity = 0
        self._data: torch.Tensor | None = None
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def nbytes(self) -> int:
        return 0 if self._data is None else self._data.numel() * self._data.element_size()

    def ensure(self, slots: int, capacity: int, *, keep: int = 0, keep_width: int = 0) -> None:
        """Room for ``slots`` rows of ``capacity`` tokens each; the first ``keep`` slots' first
        ``keep_width`` columns survive a regrowth. Columns come in multiples of 64 with at least 64 to
        spare, so prompts of about the same length fit without growing; growing allocates the new
        tensor before the old one goes (both are resident for the copy), which the caller avoids by
        asking for every slot it may need at once."""
        if self._data is not None and slots <= self.slots and capacity <= self.capacity:
            return
        new_slots = max(slots, self.slots)
        new_capacity = self.capacity
        if capacity > self.capacity:
            new_capacity = -(-(capacity + HEADROOM) // 64) * 64
        s = self.shape
        # zeros, not empty: a window reads columns no row has written (masked out, but 0 x NaN is NaN)
        data = torch.zeros(
            (new_slots, s.layers, 2, s.kv_heads, new_capacity + 1, s.head_dim), dtype=s.dtype, device=s.device
        )
        if self._data is not None and keep and keep_width:
            data[:keep, :, :, :, :keep_width] = self._data[:keep, :, :, :, :keep_width]
        self._data, self.slots, self.capacity = data, new_slots, new_capacity
        self._layers = [(data[:, layer, 0], data[:, layer, 1]) for layer in range(s.layers)]

    @property
    def data_ptr(self) -> int:
        """Where the tensor lives (changes when it is allocated anew)."""
        return 0 if self._data is None else self._data.data_ptr()

    def release(self) -> None:
        """Give the memory back (the next :meth:`ensure` allocates afresh)."""
        self._data, self._layers, self.slots, self.capacity = None, [], 0, 0

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s keys and values, each ``[slots, kv_heads, capacity + 1, head_dim]`` (views)."""
        return self._layers[index]

    def copy_slot(self, source: int, target: int, length: int) -> None:
        """Slot ``target`` gets slot ``source``'s first ``length`` columns (a choice of the same prompt, or a
        row moved down to fill the slot of one that left)."""
        assert self._data is not None
        self._data[target, :, :, :, :length] = self._data[source, :, :, :, :length]

    def write_block(self, slot: int, start: int, block: torch.Tensor) -> None:
        """Columns ``start ..`` of ``slot`` get a :class:`PrefixCache` block (``[layers, 2, kv_heads, n,
        head_dim]``)."""
        assert self._data is not None
        self._data[slot, :, :, :, start : start + block.shape[3]] = block

    def read_block(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A copy of columns ``start .. end - 1`` of ``slot``, as a :class:`PrefixCache` block."""
        assert self._data is not None
        return self._data[slot, :, :, :, start:end].clone()

    def pass_cache(
        self, first: int, count: int, columns: torch.Tensor, width: int, rows: torch.Tensor | None = None
    ) -> PassCache:
        """The ``cache`` argument of a forward pass (:class:`PassCache`)."""
        return PassCache(self, first, count, columns, width, rows)

    @property
    def scratch(self) -> int:
        """The column a padding token writes to (no window includes it)."""
        return self.capacity


class PassCache:
    """What one forward pass of a transformers model sees as its ``cache``: each attention layer calls
    :meth:`update` with the pass's new keys and values and attends to what it returns. Counts its calls,
    so the backend can tell an architecture that does not go through the cache.

    A batched pass (``rows is None``) covers slots ``first .. first + count - 1``: its row ``r``'s token
    ``i`` goes to column ``columns[r, i]`` of slot ``first + r``, and attention sees those slots' first
    ``width`` columns. A packed pass is one row of tokens from several sequences: token ``i`` goes to
    column ``columns[0, i]`` of slot ``rows[0, i]``, and attention gets the whole layers (it knows which
    slot each token attends to, :mod:`agl_trainer.packed`)."""

    def __init__(
        self,
        slots: SlotCache,
        first: int,
        count: int,
        columns: torch.Tensor,
        width: int,
        rows: torch.Tensor | None = None,
    ) -> None:
        self._slots = slots
        self._range = slice(first, first + count) if rows is None else slice(None)
        self._rows = torch.arange(count, device=columns.device)[:, None] if rows is None else rows
        self._columns = columns
        self._width = width if rows is None else None
        self.updates = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[rows, kv_heads, tokens, head_dim]`` keys and values in place; what attention reads."""
        keys, values = self._slots.layer(layer_idx)
        keys, values = keys[self._range], values[self._range]
        # advanced indices on rows and columns, around the heads' slice: the target is [rows, tokens, heads,
        # dim]
        keys[self._rows, :, self._columns] = key_states.transpose(1, 2).to(keys.dtype)
        values[self._rows, :, self._columns] = value_states.transpose(1, 2).to(values.dtype)
        self.updates += 1
        return keys[:, :, : self._width], values[:, :, : self._width]

    # what transformers may ask of a cache it did not make
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._width or 0

    is_compileable = False


@dataclasses.dataclass
class PrefixStats:
    """What the prefix cache did since the backend started (tokens are prompt tokens)."""

    looked_up_tokens: int = 0
    reused_tokens: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    cleared: int = 0

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0


@dataclasses.dataclass(eq=False)
class _Block:
    id: int
    kv: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


_Key = tuple[Hashable, tuple[int, ...]]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    if type(a) is not type(b):  # a list never equals a tuple
        a, b = list(a), list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]: halve the difference
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low


class PrefixCache:
    """Blocks of prompt keys and values, reused by later prompts that start with the same tokens (module
    docstring). Thread-safe; :meth:`clear` may come from the thread that changes the weights.

    A prompt reuses its whole blocks found along the chain, then, from the block after them that shares
    the most leading tokens with it (a prompt that forked there), those tokens' columns: so reuse ends
    where the prompts differ, not at a block boundary (SGLang's radix cache reuses to the token too)."""

    def __init__(self, *, block_tokens: int = 16, max_bytes: int = 128 * 2**20) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, not {block_tokens}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be 0 or more, not {max_bytes}")
        self.block_tokens = block_tokens
        self.max_bytes = max_bytes
        self.stats = PrefixStats()
        self._lock = threading.Lock()
        self._blocks: collections.OrderedDict[_Key, _Block] = collections.OrderedDict()
        #: Each block's (and each scope's root's) children, for reuse that ends inside a block.
        self._children: dict[Hashable, set[_Key]] = {}
        self._bytes = 0
        self._ids = 0
        self._version: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the blocks hold now (never above ``max_bytes``)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        """Forget every block (the weights are about to change)."""
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        if self._blocks:
            self.stats.cleared += 1
        self._blocks.clear()
        self._children.clear()
        self._bytes = 0

    def _at(self, version: int) -> None:
        if version != self._version:
            self._clear()
            self._version = version

    def lookup(
        self, version: int, scope: Hashable, ids: Sequence[int], limit: int, *, peek: bool = False
    ) -> list[torch.Tensor]:
        """The cached keys and values of the longest prefix of ``ids`` (at most ``limit`` tokens) that
        policy version ``version`` of ``scope`` (the adapter) has seen, as blocks in order (the last may
        be a block's first columns only). Marks them used, the first block last, so a prompt's tail is
        evicted before the head that others share; ``peek`` only looks (no mark, no statistics)."""
        n = self.block_tokens
        found: list[tuple[_Key, _Block]] = []
        with self._lock:
            self._at(version)
            parent: Hashable = ("root", scope)
            start = 0
            while start + n <= limit:
                key = (parent, tuple(ids[start : start + n]))
                block = self._blocks.get(key)
                if block is None:
                    break
                found.append((key, block))
                parent = block.id
                start += n
            tensors = [block.kv for _, block in found]
            rest = list(ids[start : min(limit, start + n)])
            best: tuple[int, _Key | None] = (0, None)
            for key in self._children.get(parent, ()) if rest else ():
                shared = common_prefix(rest, key[1])
                if shared > best[0]:
                    best = (shared, key)
            shared, partial = best
            if partial is not None:
                found.append((partial, self._blocks[partial]))
                tensors.append(self._blocks[partial].kv[:, :, :, :shared])
            if not peek:
                for key, _ in reversed(found):
                    self._blocks.move_to_end(key)
                self.stats.looked_up_tokens += len(ids)
                self.stats.reused_tokens += start + shared
        return tensors

    def insert(
        self,
        version: int,
        scope: Hashable,
        ids: Sequence[int],
        read: Callable[[int, int], torch.Tensor],
    ) -> None:
        """Cache the whole blocks of ``ids`` not cached yet; ``read(start, end)`` returns the keys and values
        of tokens ``start .. end - 1`` (as :meth:`SlotCache.read_block`). Evicts the least recently used
        blocks of other prompts to stay within ``max_bytes``, and stops when only this prompt's are left."""
        n = self.block_tokens
        with self._lock:
            self._at(version)
            parent: Hashable = ("root", scope)
            chain: set[_Key] = set()
            for start in range(0, len(ids) - n + 1, n):
                key = (parent, tuple(ids[start : start + n]))
                block = self._blocks.get(key)
                if block is None:
                    kv = read(start, start + n)
                    size = kv.numel() * kv.element_size()
                    if not self._make_room(size, chain):
                        return
                    self._ids += 1
                    block = _Block(self._ids, kv)
                    self._blocks[key] = block
                    self._children.setdefault(parent, set()).add(key)
                    self._bytes += size
                    self.stats.inserted_blocks += 1
                chain.add(key)
                parent = block.id

    def _make_room(self, size: int, keep: set[_Key]) -> bool:
        """Evict least recently used blocks outside ``keep`` until ``size`` more bytes fit."""
        if size > self.max_bytes:
            return False
        while self._bytes + size > self.max_bytes:
            victim = next((key for key in self._blocks if key not in keep), None)
            if victim is None:
                return False
            self._bytes -= self._blocks.pop(victim).nbytes
            siblings = self._children.get(victim[0])
            if siblings is not None:
                siblings.discard(victim)
                if not siblings:
                    del self._children[victim[0]]
            self.stats.evicted_blocks += 1
        return True
