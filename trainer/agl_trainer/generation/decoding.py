"""The rows a transformers backend decodes together, and how their keys and values are kept.

A batch is made by :meth:`admit` (the first requests, then any that join while it decodes: continuous
batching), goes on by :meth:`advance` (one token for every row) and sheds finished rows by :meth:`keep`.
After each call, ``logits[i]`` holds the raw next-token logits of ``rows[i]``. Two kinds:

:class:`SlotBatch` (``kv_cache: slots``, the default)
    Each row owns a slot of a preallocated :class:`~agl_trainer.generation.kv_cache.SlotCache`, written in
    place. A prompt starts from the longest prefix the
    :class:`~agl_trainer.generation.kv_cache.PrefixCache` holds for the same policy version, and only the
    rest of it is prefilled; its whole blocks (and, when the row ends,
    those of its response) go back into the prefix cache. Its decoding steps run the model's modules
    directly (:class:`~agl_trainer.generation.direct_decode.DirectDecode`) where the model is one that
    recognizes, otherwise the model's forward pass with agl's attention.

:class:`DynamicBatch` (``kv_cache: dynamic``)
    transformers' ``DynamicCache``, left-padded to one width: every prompt is prefilled whole, and each
    decoding step concatenates every layer's cache. The way the backend worked before the slots; kept to
    compare against (``bench/generation.py``) and for architectures the slots do not cover.

Both give every row the tokens and log-probabilities it would get alone, up to float rounding.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import torch

from ..model import cache_key, padded_groups
from .attention import Packed, Segment, SharedPrefix, attention_for
from .direct_decode import DirectDecode, logits_match
from .kv_cache import PassCache, PrefixCache, SlotCache, common_prefix

__all__ = ["Batch", "DynamicBatch", "SlotBatch", "StaticDecode"]

logger = logging.getLogger(__name__)

#: Fewest shared prefix columns for which decoding reads them once for all rows (:mod:`.attention`).
SHARED_PREFIX_MIN = 64


class Host(Protocol):
    """What a batch needs of its backend."""

    pad_id: int
    prefill_tokens: int
    max_batch: int
    model: Any

    @property
    def device(self) -> torch.device: ...

    def forward(self, **kwargs: Any) -> Any:
        """The model's forward pass, keeping only the last position's logits."""

    def adapters(self, jobs: Sequence[Any]) -> dict[str, Any]:
        """The ``adapter_names`` argument for rows of ``jobs`` (empty without routing)."""

    def new_row(self, job: Any, index: int) -> Any:
        """Choice ``index`` of ``job``, a row to decode."""


class Batch(Protocol):
    rows: list[Any]
    logits: torch.Tensor
    #: Prompt tokens the batch prefilled, and those it took from the prefix cache instead.
    prefilled_tokens: int
    reused_tokens: int

    def admit(self, jobs: Sequence[Any]) -> None: ...

    def advance(self) -> None: ...

    def keep(self, indices: list[int]) -> None: ...

    def close(self) -> None: ...


def _runs_within(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` cut, in order, into runs whose sum stays within ``budget`` (an item over it
    alone)."""
    runs: list[list[int]] = []
    total = 0
    for i, n in enumerate(lengths):
        if runs and total + n <= budget:
            runs[-1].append(i)
            total += n
        else:
            runs.append([i])
            total = n
    return runs


def _last_logits(out: Any) -> torch.Tensor:
    logits: torch.Tensor = out.logits[:, -1].float()
    return logits


class SlotBatch:
    """Rows in the slots of a preallocated cache, prompts starting from cached prefixes (module docstring).

    ``version`` is the policy version the batch generates under (the prefix cache keeps one version's
    blocks); ``prefix`` may be ``None`` (no reuse)."""

    def __init__(
        self,
        host: Host,
        slots: SlotCache,
        prefix: PrefixCache | None,
        version: int,
        static: StaticDecode | None = None,
        direct: DirectDecode | None = None,
    ) -> None:
        self.host = host
        #: Decoding steps with fixed shapes (a CUDA graph on a GPU), or ``None``.
        self.static = static
        #: Decoding steps through the model's modules (when ``static`` is ``None``), or ``None``.
        self.direct = direct
        self.slots = slots
        self.prefix = prefix
        self.version = version
        self.rows: list[Any] = []
        #: Tokens in each row's slot (its next token's position and column).
        self.lengths: list[int] = []
        self.logits = torch.empty(0)
        #: Prompt tokens this batch prefilled, and those it took from the prefix cache.
        self.prefilled_tokens = 0
        self.reused_tokens = 0
        #: Columns all rows share (:meth:`_shared_prefix`), once worked out for the rows as they are.
        self._shared: int | None = None

    def _scope(self, job: Any) -> Hashable:
        """Whose prefixes a job's prompt may reuse: those of the same adapter."""
        scope: Hashable = job.policy
        return scope

    def admit(self, jobs: Sequence[Any]) -> None:
        """Prefill ``jobs``' prompts into new slots after the rows already here. Prompts that share more
        with an earlier prompt of this call than with the prefix cache wait for it: the earlier ones are
        prefilled first, their blocks cached, then the rest start from them (16 rollouts of one agent
        arriving together compute its system prompt once, not 16 times)."""
        host, slots = self.host, self.slots
        first = len(self.rows)
        needed = max(len(job.prompt_ids) + job.max_new for job in jobs)
        needed = max([needed, *(len(row.job.prompt_ids) + row.job.max_new for row in self.rows)])
        extra = sum(job.request.n - 1 for job in jobs)
        # every slot the batch may fill at once: a growing slot count would copy the cache each time
        wanted = max(first + len(jobs) + extra, host.max_batch)
        slots.ensure(wanted, needed, keep=first, keep_width=max(self.lengths, default=0))
        jobs = list(jobs)
        logits: list[torch.Tensor] = []
        admitted: list[Any] = []
        for wave in self._waves(jobs):
            logits += self._prefill_wave(wave, first + len(admitted))
            admitted += wave
        new_rows = [host.new_row(job, 0) for job in admitted]
        new_lengths = [len(job.prompt_ids) for job in admitted]
        new_logits = torch.cat(logits)
        copies: list[int] = []
        for j, job in enumerate(admitted):  # a request's further choices start from copies of its prompt
            for c in range(1, job.request.n):
                slots.copy_slot(first + j, first + len(new_rows), len(job.prompt_ids))
                new_rows.append(host.new_row(job, c))
                new_lengths.append(len(job.prompt_ids))
                copies.append(j)
        if copies:
            new_logits = torch.cat([new_logits, new_logits[torch.tensor(copies, device=new_logits.device)]])
        self.rows += new_rows
        self.lengths += new_lengths
        self.logits = new_logits if first == 0 else torch.cat([self.logits, new_logits])
        self._shared = None

    def _waves(self, jobs: list[Any]) -> list[list[Any]]:
        """``jobs`` in the order to prefill them: first those that share no more than a block with an
        earlier job beyond what the cache holds for them, then the others."""
        if self.prefix is None or len(jobs) == 1:
            return [jobs]
        leaders: list[Any] = []
        followers: list[Any] = []
        for job in jobs:
            ids, scope = job.prompt_ids, self._scope(job)
            shared = max(
                (common_prefix(ids, other.prompt_ids) for other in leaders if self._scope(other) == scope),
                default=0,
            )
            cached = 0
            if shared >= self.prefix.block_tokens:
                blocks = self.prefix.lookup(self.version, scope, ids, len(ids) - 1, peek=True)
                cached = sum(block.shape[3] for block in blocks)
            if min(shared, len(ids) - 1) - cached >= self.prefix.block_tokens:
                followers.append(job)
            else:
                leaders.append(job)
        return [leaders, followers] if followers else [leaders]

    def _prefill_wave(self, jobs: list[Any], first: int) -> list[torch.Tensor]:
        """Prefill ``jobs`` into slots ``first ..`` starting from their cached prefixes, then cache their
        prompts' blocks; the logits of each one's next token, pass by pass."""
        host, slots, prefix = self.host, self.slots, self.prefix
        starts: list[int] = []
        for j, job in enumerate(jobs):
            column = 0
            if prefix is not None:  # at least the prompt's last token is computed: its logits are needed
                scope, ids = self._scope(job), job.prompt_ids
                for block in prefix.lookup(self.version, scope, ids, len(ids) - 1):
                    slots.write_block(first + j, column, block)
                    column += block.shape[3]
            starts.append(column)
            self.reused_tokens += column
            self.prefilled_tokens += len(job.prompt_ids) - column
        # passes over consecutive slots: packed (no padding) when the jobs share one adapter, else padded,
        # each within prefill_tokens tokens
        logits: list[torch.Tensor] = []
        order = list(range(len(jobs)))
        packed = self._packable(jobs)
        tails = [len(job.prompt_ids) - start for job, start in zip(jobs, starts, strict=True)]
        if packed:  # a packed pass holds prefill_tokens tokens; a padded one, rows x the longest
            chunks = _runs_within(tails, host.prefill_tokens)
        else:
            chunks = padded_groups(order, lambda j: tails[j], host.prefill_tokens)
        for chunk in chunks:
            run = self._prefill_packed if packed else self._prefill
            logits.append(run([jobs[j] for j in chunk], [starts[j] for j in chunk], first + chunk[0]))
        if prefix is not None:
            for j, job in enumerate(jobs):
                prefix.insert(
                    self.version,
                    self._scope(job),
                    job.prompt_ids,
                    functools.partial(slots.read_block, first + j),
                )
        return logits

    def _packable(self, jobs: list[Any]) -> bool:
        """Whether ``jobs`` can share a packed pass (one row: one adapter for all of them)."""
        names = self.host.adapters(jobs).get("adapter_names")
        return self.slots.shape.packed and (names is None or len(set(names)) == 1)

    def _prefill_packed(self, jobs: list[Any], starts: list[int], first: int) -> torch.Tensor:
        """The prompts of ``jobs`` from ``starts`` on through the model as one row (:mod:`.attention`), each
        into its slot (``first ..``); the logits of each one's next token."""
        device = self.host.device
        ids: list[int] = []
        segments: list[Segment] = []
        for r, (job, start) in enumerate(zip(jobs, starts, strict=True)):
            tail = job.prompt_ids[start:]
            segments.append(Segment(first + r, len(ids), start, len(tail)))
            ids += tail
        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments])
        rows = torch.cat([torch.full((s.length,), s.slot, dtype=torch.long) for s in segments])
        last = torch.tensor([s.offset + s.length - 1 for s in segments])
        tokens, positions, rows, last = (
            t.to(device) for t in (torch.tensor([ids]), positions[None], rows[None], last)
        )
        cache = self.slots.pass_cache(first, len(jobs), positions, 0, rows=rows)
        inputs = {"input_ids": tokens, "position_ids": positions, "logits_to_keep": last}
        out = self._pass(cache, jobs[:1], Packed(segments), **inputs)
        logits: torch.Tensor = out.logits[0]
        if logits.shape[0] != len(segments):  # an architecture that computed every position's logits
            logits = logits[last]
        return logits.float()

    def _pass(
        self, cache: PassCache, jobs: Sequence[Any], state: Packed | SharedPrefix | None, **inputs: Any
    ) -> Any:
        """One forward pass that writes its keys and values through ``cache`` (``jobs``: whose adapters),
        attending with :mod:`.attention`'s ``state`` when given; checks that every layer went through
        the cache (and the slot attention)."""
        layers = self.slots.shape.layers
        context = attention_for(self.host.model, state) if state is not None else contextlib.nullcontext()
        with context as calls:
            out = self.host.forward(
                use_cache=True, **{cache_key(): cache}, **inputs, **self.host.adapters(jobs)
            )
        if cache.updates != layers:
            raise RuntimeError(
                f"the model wrote {cache.updates} of its {layers} layers' keys through the cache; serve this"
                " architecture with kv_cache: dynamic"
            )
        if calls is not None and calls() != layers:
            raise RuntimeError(
                f"{calls()} of the model's {layers} attention layers went through agl's slot attention; serve"
                " this architecture with kv_cache: dynamic"
            )
        return out

    def _prefill(self, jobs: list[Any], starts: list[int], first: int) -> torch.Tensor:
        """The prompts of ``jobs`` from ``starts`` on through the model, in slots ``first ..``, left-padded to
        one width so each row's last token is the pass's last; the logits of each row's next token."""
        host, device = self.host, self.host.device
        lengths = [len(job.prompt_ids) - start for job, start in zip(jobs, starts, strict=True)]
        width = max(lengths)
        ids = torch.full((len(jobs), width), host.pad_id, dtype=torch.long)
        positions = torch.zeros((len(jobs), width), dtype=torch.long)
        columns = torch.full((len(jobs), width), self.slots.scratch, dtype=torch.long)
        real = torch.zeros((len(jobs), width), dtype=torch.bool)
        for r, (job, start, length) in enumerate(zip(jobs, starts, lengths, strict=True)):
            ids[r, width - length :] = torch.tensor(job.prompt_ids[start:])
            positions[r, width - length :] = torch.arange(start, start + length)
            columns[r, width - length :] = positions[r, width - length :]
            real[r, width - length :] = True
        window = max(start + length for start, length in zip(starts, lengths, strict=True))
        key_columns = torch.arange(window)
        # a token sees the columns up to its own position; a padding token sees column 0 only (any one
        # finite column will do: its output is never used, and a row with nothing to see makes NaNs)
        mask = key_columns[None, None, :] <= positions[:, :, None]
        mask[~real] = key_columns == 0
        ids, positions, columns, mask = (t.to(device) for t in (ids, positions, columns, mask))
        return self._run(ids, positions, columns, mask[:, None], first, jobs)

    def _run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        columns: torch.Tensor,
        mask: torch.Tensor,
        first: int,
        jobs: Sequence[Any],
        state: SharedPrefix | None = None,
    ) -> torch.Tensor:
        """A batched pass over slots ``first ..`` (:class:`~agl_trainer.generation.kv_cache.PassCache`);
        the logits of each row's last position."""
        cache = self.slots.pass_cache(first, ids.shape[0], columns, mask.shape[-1])
        if self.slots.shape.attention == "eager":  # eager attention adds the mask to the scores
            mask = torch.zeros(mask.shape, dtype=self.slots.shape.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(self.slots.shape.dtype).min
            )
        out = self._pass(cache, jobs, state, input_ids=ids, attention_mask=mask, position_ids=positions)
        return _last_logits(out)

    def advance(self) -> None:
        if self.static is not None:
            self.logits = self.static.step(self)
        else:  # narrow steps (a policy per agent, or static_decode off): the same attention kernels
            with attention_kernels(self.host.device, self.slots.shape.dtype):
                self._advance_narrow()
        self.lengths = [n + 1 for n in self.lengths]

    def _advance_narrow(self) -> None:
        """A decoding step of the rows as they are (no fixed shape): through the model's modules where
        :class:`DirectDecode` serves the model (the first step after a weight change checked against the
        forward pass), else through the forward pass."""
        shared = self._shared_prefix()
        if shared < SHARED_PREFIX_MIN or len(self.rows) < 2:
            shared = 0
        direct = self.direct
        if direct is not None and direct.enabled:
            logits = self._direct_step(direct, shared)
            if direct.checking:  # the first step since the weights changed, against the forward pass
                reference = self._forward_step(shared)
                if not direct.checked(logits, reference):
                    logits = reference
            self.logits = logits
        else:
            self.logits = self._forward_step(shared)

    def _forward_step(self, shared: int) -> torch.Tensor:
        """A decoding step through the model's forward pass (``shared``: see :meth:`_direct_step`)."""
        device = self.host.device
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        width = int(lengths.max()) + 1
        ids = torch.tensor([[row.response[-1]] for row in self.rows], dtype=torch.long)
        mask = torch.arange(width)[None, :] <= lengths[:, None]
        ids, lengths, mask = ids.to(device), lengths.to(device), mask.to(device)
        use = shared > 0 and self.slots.shape.packed
        jobs = [row.job for row in self.rows]
        state = SharedPrefix(shared) if use else None
        return self._run(ids, lengths[:, None], lengths[:, None], mask[:, None, None], 0, jobs, state=state)

    def _direct_step(self, direct: DirectDecode, shared: int) -> torch.Tensor:
        """A decoding step through the model's modules; ``shared``: columns all rows hold alike, read once
        for all (0: each row reads its own)."""
        device = self.host.device
        ids = torch.tensor([row.response[-1] for row in self.rows], dtype=torch.long, device=device)
        positions = torch.tensor(self.lengths, dtype=torch.long, device=device)
        layers = [self.slots.layer(index) for index in range(self.slots.shape.layers)]
        adapters = self.host.adapters([row.job for row in self.rows])
        return direct.step(layers, ids, positions, shared, adapters)

    def _shared_prefix(self) -> int:
        """Columns every row's slot holds the same keys and values in: the prompt tokens they all start
        with, under one adapter (the rows' copies of the same cached prefix, or of prefixes computed from
        the same tokens by the same weights, equal up to rounding)."""
        if self._shared is None:
            first = self.rows[0].job
            scope = self._scope(first)
            shared = len(first.prompt_ids)
            for row in self.rows[1:]:
                if self._scope(row.job) != scope:
                    shared = 0
                    break
                shared = min(shared, common_prefix(first.prompt_ids, row.job.prompt_ids))
            self._shared = shared
        return self._shared

    def keep(self, indices: list[int]) -> None:
        """Only the rows at ``indices`` go on. A row that ended gives its response's whole blocks to the
        prefix cache; the last rows move into the slots of rows that left, so slots stay consecutive."""
        if len(indices) == len(self.rows):
            return
        kept = set(indices)
        if self.prefix is not None:
            for r, row in enumerate(self.rows):
                if r not in kept and not row.job.cancelled:
                    tokens = [*row.job.prompt_ids, *row.response][: self.lengths[r]]
                    self.prefix.insert(
                        self.version,
                        self._scope(row.job),
                        tokens,
                        functools.partial(self.slots.read_block, r),
                    )
        count = len(indices)
        holes = [r for r in range(count) if r not in kept]
        movers = [r for r in indices if r >= count]
        order = list(range(count))
        for hole, mover in zip(holes, movers, strict=True):
            self.slots.copy_slot(mover, hole, self.lengths[mover])
            order[hole] = mover
        self.rows = [self.rows[r] for r in order]
        self.lengths = [self.lengths[r] for r in order]
        self._shared = None
        if count:
            self.logits = self.logits[torch.tensor(order, device=self.logits.device)]

    def close(self) -> None:
        self.rows = []


class StaticDecode:
    """Decoding steps whose tensors keep their shapes from step to step: every slot of the cache (slots
    past the batch's rows masked) and its whole width. That is what a CUDA graph replays: on a GPU, with
    ``graphs``, the step is captured once per cache size and replayed after, which takes the launch of each
    of a step's few hundred small kernels off the CPU (the bound of batched decoding of a small model on a
    large GPU). On the CPU the same shapes run eagerly (for testing; the narrower step is quicker there).

    Only for a model served without adapters per agent (the adapter of each row would be part of the
    graph). A capture that fails, or whose first replay gives other logits than the same step run
    eagerly, is logged and the steps run eagerly from then on."""

    def __init__(self, host: Host, slots: SlotCache, *, graphs: bool) -> None:
        self.host = host
        self.slots = slots
        self.graphs = graphs and slots.shape.device.type == "cuda"
        self._graph: Any = None
        self._key: tuple[int, int, int] | None = None
        self._inputs: dict[str, torch.Tensor] = {}
        self._logits: torch.Tensor | None = None
        #: Whether the current graph's first replay matched the step run eagerly.
        self._checked = False

    def _fill(self, batch: SlotBatch) -> dict[str, torch.Tensor]:
        slots, count = self.slots, len(batch.rows)
        capacity = slots.capacity
        ids = torch.full((slots.slots, 1), self.host.pad_id, dtype=torch.long)
        positions = torch.zeros((slots.slots, 1), dtype=torch.long)
        columns = torch.full((slots.slots, 1), slots.scratch, dtype=torch.long)
        ids[:count, 0] = torch.tensor([row.response[-1] for row in batch.rows])
        positions[:count, 0] = torch.tensor(batch.lengths)
        columns[:count, 0] = positions[:count, 0]
        mask = torch.arange(capacity)[None, :] <= positions
        mask[count:] = (
            torch.arange(capacity) == 0
        )  # an empty slot sees its column 0 (finite), writes to scratch
        device = slots.shape.device
        return {
            "ids": ids.to(device),
            "positions": positions.to(device),
            "columns": columns.to(device),
            "mask": mask[:, None, None].to(device),
        }

    def step(self, batch: SlotBatch) -> torch.Tensor:
        """The next-token logits of ``batch``'s rows after feeding each its last token."""
        inputs = self._fill(batch)
        count = len(batch.rows)
        if not self.graphs:
            return self._eager(batch, inputs)[:count]
        key = (self.slots.slots, self.slots.capacity, self.slots.data_ptr)
        if key != self._key:
            return self._capture(batch, inputs, key)[:count]
        for name, tensor in inputs.items():
            self._inputs[name].copy_(tensor)
        self._graph.replay()
        assert self._logits is not None
        logits = self._logits[:count].clone()
        if not self._checked:  # the first replay of a capture, against the same step run eagerly
            eager = self._eager(batch, self._inputs)[:count]  # writes the same keys and values again
            if not logits_match(logits, eager):
                logger.warning(
                    "agl: the CUDA graph of the decoding step gave other logits than the step itself (largest"
                    " difference %.3g); running it eagerly from now on",
                    float((logits - eager).abs().max()),
                )
                self.graphs = False
                self.reset()
                return eager
            self._checked = True
        return logits

    def _eager(self, batch: SlotBatch, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        jobs = [row.job for row in batch.rows]
        with attention_kernels(inputs["ids"].device, self.slots.shape.dtype):
            return batch._run(inputs["ids"], inputs["positions"], inputs["columns"], inputs["mask"], 0, jobs)

    def reset(self) -> None:
        """Forget the captured graph (the weights or the cache may have moved)."""
        self._graph, self._key, self._inputs, self._logits = None, None, {}, None

    def _capture(
        self, batch: SlotBatch, inputs: dict[str, torch.Tensor], key: tuple[int, int, int]
    ) -> torch.Tensor:
        """Run this step on a side stream (warming kernels up and computing its logits), then capture it
        into a graph that later steps replay with their own inputs copied in."""
        self._graph, self._key, self._inputs, self._logits = None, None, inputs, None
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up; each run writes this step's keys and values, as the capture will
                logits = self._eager(batch, inputs)
        torch.cuda.current_stream().wait_stream(stream)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._logits = self._eager(batch, inputs)
        except Exception:  # a model whose forward pass cannot be captured: eager from now on
            logger.warning(
                "agl: the decoding step could not be captured in a CUDA graph; running it eagerly",
                exc_info=True,
            )
            self.graphs = False
            return logits
        self._graph, self._key, self._checked = graph, key, False
        return logits


def attention_kernels(device: torch.device, dtype: torch.dtype) -> Any:
    """On a GPU in 16-bit floats: attention through the memory-efficient kernel (flash where it applies),
    the same in the graph and in the eager step; cuDNN's attention, which PyTorch may choose otherwise,
    spends a quarter of a millisecond of CPU per call in planning. Elsewhere nothing changes."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])


class DynamicBatch:
    """Rows in transformers' ``DynamicCache``, left-padded to one width (module docstring)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.rows: list[Any] = []
        self.past: Any = None
        self.logits = torch.empty(0)
        self.mask = torch.empty(0)
        self.positions = torch.empty(0)
        self.prefilled_tokens = 0
        self.reused_tokens = 0

    def admit(self, jobs: Sequence[Any]) -> None:
        """Prompts go through in passes of at most ``prefill_tokens`` padded tokens (any one prompt alone
        when longer), merged after: a pass's activations are the backend's memory peak when many long
        prompts arrive together."""
        passes = padded_groups(list(jobs), lambda job: len(job.prompt_ids), self.host.prefill_tokens)
        parts = [self._prefill(chunk) for chunk in passes]
        self.prefilled_tokens += sum(len(job.prompt_ids) for job in jobs)
        if self.rows:
            parts.insert(0, self)
        merged = parts[0]._merged(*parts[1:]) if len(parts) > 1 else parts[0]
        self.rows, self.past, self.logits = merged.rows, merged.past, merged.logits
        self.mask, self.positions = merged.mask, merged.positions

    def _prefill(self, jobs: list[Any]) -> DynamicBatch:
        host, device = self.host, self.host.device
        width = max(len(j.prompt_ids) for j in jobs)
        ids = torch.full((len(jobs), width), host.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(jobs), width), dtype=torch.long, device=device)
        for i, job in enumerate(jobs):
            ids[i, width - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids, device=device)
            mask[i, width - len(job.prompt_ids) :] = 1
        out = host.forward(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            **host.adapters(jobs),
        )
        part = DynamicBatch(host)
        part.past = out[cache_key()]
        logits = _last_logits(out)
        part.rows = [host.new_row(job, c) for job in jobs for c in range(job.request.n)]
        owner = [i for i, job in enumerate(jobs) for _ in range(job.request.n)]
        if owner != list(range(len(jobs))):
            select = torch.tensor(owner, device=device)
            part.past.batch_select_indices(select)
            logits, mask = logits[select], mask[select]
        part.logits, part.mask, part.positions = logits, mask, mask.sum(-1)
        return part

    def advance(self) -> None:
        device = self.host.device
        self.mask = torch.cat(
            [self.mask, torch.ones((len(self.rows), 1), dtype=self.mask.dtype, device=device)], dim=1
        )
        step_ids = torch.tensor([[row.response[-1]] for row in self.rows], device=device)
        out = self.host.forward(
            input_ids=step_ids,
            attention_mask=self.mask,
            position_ids=self.positions[:, None],
            use_cache=True,
            **{cache_key(): self.past},
            **self.host.adapters([row.job for row in self.rows]),
        )
        self.past = out[cache_key()]
        self.logits = _last_logits(out)
        self.positions = self.positions + 1

    def keep(self, indices: list[int]) -> None:
        """Only the rows at ``indices`` go on."""
        if len(indices) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in indices]
        if not indices:
            return
        select = torch.tensor(indices, device=self.mask.device)
        self.past.batch_select_indices(select)
        self.logits, self.mask, self.positions = (
            self.logits[select],
            self.mask[select],
            self.positions[select],
        )
        self._trim()

    def _trim(self) -> None:
        """Drop the columns on the left that no row attends to any more (they were the padding of rows
        that have left). Without this, a batch that requests keep joining (continuous batching through a
        whole held-out run) widens by one column per decoding step for as long as it lives: every row's
        cache and every step's attention grow with the batch's age, not the row's own length."""
        first = int(torch.argmax(self.mask.any(dim=0).to(torch.int8)))
        if first == 0:
            return
        for layer in self.past.layers:  # views: the next step's concatenation makes the new tensors
            layer.keys = layer.keys[..., first:, :]
            layer.values = layer.values[..., first:, :]
        self.mask = self.mask[:, first:]

    def _merged(self, *others: DynamicBatch) -> DynamicBatch:
        """These rows and ``others``' as one batch (one copy of each cache layer): the narrower sides'
        caches and masks are padded on the left (masked out), so every row keeps its own positions."""
        parts = (self, *others)
        width = max(part.mask.shape[1] for part in parts)

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for layers in zip(*(part.past.layers for part in parts), strict=True):
            mine = layers[0]
            mine.keys = torch.cat([pad(layer.keys, -2) for layer in layers], dim=0)
            mine.values = torch.cat([pad(layer.values, -2) for layer in layers], dim=0)
            for layer in layers[1:]:  # each side's own copy goes as soon as it is merged
                layer.keys = layer.values = None
        merged = DynamicBatch(self.host)
        merged.rows = [row for part in parts for row in part.rows]
        merged.past = self.past
        merged.logits = torch.cat([part.logits for part in parts])
        merged.mask = torch.cat([pad(part.mask, 1) for part in parts])
        merged.positions = torch.cat([part.positions for part in parts])
        return merged

    def close(self) -> None:
        self.rows, self.past = [], None
