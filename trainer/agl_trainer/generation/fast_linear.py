"""Generation's matrix products on the CPU through oneDNN, the largest weights laid out once for it.

A decoding step multiplies a handful of rows (one per sequence) by every weight of the model. PyTorch's
float32 ``linear`` on the CPU goes to MKL's GEMM, which for 16 rows reads a weight at a sixth of the
machine's memory bandwidth (SmolLM2's 49k x 576 output layer: 19.7 ms, measured on the 2-core machine the
main job runs on). oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``, what PyTorch's own compiler
calls for CPU inference) takes half that on the same weight, and a third once the weight is packed in the
blocked layout its kernels stream (``_reorder_linear_weight``): 5.7 ms.

:class:`PackedLinears` routes the served model's large float32 linear layers through oneDNN for the
duration of a generation batch (``with packed:``), and keeps packed copies of the largest of them within a
memory budget (largest first: for SmolLM2, 128 MiB packs the output layer, the best gain per byte). The
copies are made on first use and dropped by :meth:`release`, which the backend calls whenever someone
takes its lock to change the weights, so they never outlive the weights they copy, and they do not sit in
memory beside a weight update's activations. A layer whose weight changed in place since it was packed
(its version counter moved) is packed again. Training never goes through any of this.

Grouped products. Layers that always multiply the same input (a Llama layer's query, key and value
projections; its gate and up projections) can share one product with their weights stacked: 4 products a
layer instead of 7, which at 16 rows reads the stacked weight faster than the three or two apart. When the
budget holds every weight (``groups`` given; for SmolLM2's 513 MiB, ``packed_weights_mb`` of 520 or more),
each group gets one packed stacked copy instead of its members' own; :meth:`PackedLinears.multiply_group`
computes it for an input and hands each member its slice, which the member's next call with that same
input returns (a PEFT LoRA layer around it adds its own term as usual). A member called with an input
that has no slice ready computes the group's product of it and takes its slice (the forward pass calls a
group's members one after the other on one input, so the rest find theirs ready): every product of a
stacked layer comes from the one stacked copy.

bfloat16 products (``dtype=torch.bfloat16``, ``serving.hf.matmul_dtype: bfloat16``). The copies are rounded
to bfloat16 and each product's input with them; oneDNN sums in float32 and returns the result rounded to
bfloat16 (its output takes the input's dtype), widened back to float32 here (a layer's bias is added
after, in float32). On a CPU with bfloat16 matrix units (AMX, as on Sapphire Rapids Xeons) these products
take a quarter to a third of the float32 packed ones at 16 rows.
Everything else generation computes (norms, attention, the key/value cache, logits' softmax) stays
float32, and only the packed layers round: a layer left out of the budget multiplies in float32. The model
that samples is then not the trained float32 model but its rounding; the logprobs the gateway records are
the sampler's own, so the update's importance ratio (new over recorded) corrects for the difference as for
any sampler that rounds differently from the trainer (vLLM in bfloat16 beside float32 training).
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["PackedLinears", "available"]

logger = logging.getLogger(__name__)

#: Weights smaller than this are left to PyTorch (LoRA's own matrices, say): packing gains them nothing.
MIN_WEIGHT = 2**16


def _ops() -> Any:
    return getattr(torch.ops, "mkldnn", None)


#: The dtypes a copy may take (``serving.hf.matmul_dtype``).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this PyTorch has oneDNN's packed linear on the CPU for copies in ``dtype``, and it computes
    what ``linear`` does (to ``dtype``'s rounding)."""
    ops = _ops()
    if not torch.backends.mkldnn.is_available() or ops is None:  # type: ignore[no-untyped-call]
        return False
    if dtype == torch.bfloat16 and not _bf16_supported(ops):
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(64, 32, generator=generator)
        bias = torch.randn(64, generator=generator)
        x = torch.randn(3, 5, 32, generator=generator)
        packed = ops._reorder_linear_weight(weight.to(dtype), 4)
        results = [_product(ops, x, w, bias) for w in (packed, weight.to(dtype))]
    except (AttributeError, RuntimeError, TypeError):
        return False
    expected = torch.nn.functional.linear(x, weight, bias)
    tolerance = 1e-4 if dtype == torch.float32 else 0.05  # bfloat16 keeps 8 bits: 2-3 decimal digits
    return all(
        got.dtype == torch.float32 and torch.allclose(got, expected, atol=tolerance, rtol=tolerance)
        for got in results
    )


def _bf16_supported(ops: Any) -> bool:
    check = getattr(ops, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


def _product(ops: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` (float32) times ``weight`` (packed or plain, float32 or bfloat16) plus ``bias`` (float32), in
    float32: a bfloat16 weight's product takes ``x`` rounded to bfloat16, comes back rounded to bfloat16,
    and gets the bias after."""
    if weight.dtype == torch.float32:
        out: torch.Tensor = ops._linear_pointwise(x, weight, bias, "none", [], "")
        return out
    out = ops._linear_pointwise(x.to(weight.dtype), weight, None, "none", [], "").to(torch.float32)
    return out if bias is None else out.add_(bias)


class PackedLinears:
    """oneDNN for ``model()``'s large float32 CPU linear layers while entered, with packed copies of the
    largest within ``budget_bytes`` (module docstring). ``model`` is a callable, so the backend's current
    model object is used (it may be wrapped in a PEFT model after a first adapter is loaded)."""

    def __init__(
        self,
        model: Callable[[], Any],
        *,
        rows: int = 16,
        budget_bytes: int = 128 * 2**20,
        groups: Callable[[Any], list[list[torch.nn.Linear]]] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if dtype not in DTYPES.values():
            raise ValueError(f"the packed copies' dtype must be float32 or bfloat16, not {dtype}")
        self._model = model
        #: The copies' dtype (module docstring: bfloat16 products).
        self.dtype = dtype
        self._rows = rows
        self.budget_bytes = budget_bytes
        #: The model's groups of layers that multiply the same input (module docstring), or ``None``.
        self._groups = groups
        self._ops = _ops()
        #: ids of the layers of a copy (one layer, or a stacked group) -> (the layers, their weights'
        #: identities when packed, the packed weight, the group's stacked bias (``None``: a single layer,
        #: whose forward passes its own, or a group without biases))
        self._packed: dict[
            tuple[int, ...],
            tuple[list[torch.nn.Linear], list[tuple[int, int]], torch.Tensor, torch.Tensor | None],
        ] = {}
        #: While entered: each stacked group's packed weight and bias, by the ids of its layers.
        self._active: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}
        #: While entered with the groups stacked: the groups, in the order ``groups`` gave them.
        self.groups: list[list[torch.nn.Linear]] = []
        #: id(layer) -> (input, output) that layer's next call with that input returns.
        self._ready: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._patched: list[torch.nn.Linear] = []

    @property
    def nbytes(self) -> int:
        return sum(packed.numel() * packed.element_size() for _, _, packed, _ in self._packed.values())

    def release(self) -> None:
        """Drop every packed copy (the weights may change)."""
        self._packed.clear()

    def __enter__(self) -> PackedLinears:
        layers = [
            layer
            for layer in self._model().modules()
            if isinstance(layer, torch.nn.Linear)
            and layer.weight.device.type == "cpu"
            and layer.weight.dtype == torch.float32
            and layer.weight.numel() >= MIN_WEIGHT
        ]
        room = self.budget_bytes
        copy_bytes = torch.empty((), dtype=self.dtype).element_size()
        sizes = {id(layer): layer.weight.numel() * copy_bytes for layer in layers}
        #: id(layer) -> the stacked group it belongs to
        grouped: dict[int, list[torch.nn.Linear]] = {}
        if self._groups is not None and sum(sizes.values()) <= room:  # every weight fits: stack the groups
            self.groups = self._groups(self._model())
            for group in self.groups:
                if len(group) > 1 and all(id(layer) in sizes for layer in group):
                    self._active[tuple(id(layer) for layer in group)] = self._copy(group)
                    grouped.update((id(layer), group) for layer in group)
                    room -= sum(sizes[id(layer)] for layer in group)
        for layer in sorted(layers, key=lambda layer: -layer.weight.numel()):
            size = sizes[id(layer)]
            members = grouped.get(id(layer))
            fits = members is None and size <= room
            weight = self._copy([layer])[0] if fits else layer.weight
            room -= size if fits else 0
            # a stacked group's member takes its slice of the group's product for any input (the forward
            # pass's calls of a group's members share their input): one copy, one rounding, for every path
            multiply = None if members is None else functools.partial(self._multiply_members, members)
            forward = _forward(self._ops, weight, self._ready, multiply)
            layer.forward = types.MethodType(forward, layer)  # type: ignore[method-assign]
            self._patched.append(layer)
        return self

    def __exit__(self, *exc: object) -> None:
        for layer in self._patched:
            layer.__dict__.pop("forward", None)  # the class's forward again
        self._patched.clear()
        self._active.clear()
        self.groups = []
        self._ready.clear()

    def multiply_group(self, layers: Sequence[torch.nn.Linear], x: torch.Tensor) -> bool:
        """Multiply ``x`` by a group's stacked weight now, and have each of ``layers`` return its slice of
        the product when next called with ``x`` itself; ``False`` (nothing done) where the group is not
        stacked (the budget does not hold every weight, or no ``groups`` were given)."""
        stacked = self._active.get(tuple(id(layer) for layer in layers))
        if stacked is None or torch.is_grad_enabled() or x.dtype != torch.float32:
            return False
        self._ready.clear()
        weight, bias = stacked
        out = _product(self._ops, x, weight, bias)
        start = 0
        for layer in layers:
            end = start + layer.out_features
            self._ready[id(layer)] = (x, out[..., start:end])
            start = end
        return True

    def _multiply_members(self, members: Sequence[torch.nn.Linear], x: torch.Tensor) -> bool:
        return self.multiply_group(members, x)  # looked up per call, so a wrapper set on it sees it

    def _copy(self, group: Sequence[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed copy of ``group``'s weights, stacked when there are several, and their stacked bias
        (see ``_packed``); made again when any of the weights changed since (its version counter moved)."""
        key = tuple(id(layer) for layer in group)
        identity = [(layer.weight.data_ptr(), layer.weight._version) for layer in group]
        known = self._packed.get(key)
        if (
            known is not None
            and all(a is b for a, b in zip(known[0], group, strict=True))
            and known[1] == identity
        ):
            return known[2], known[3]
        self._packed.pop(key, None)  # the stale copy goes before the new one is made
        with torch.no_grad():
            weights = [layer.weight.detach() for layer in group]
            weight = (weights[0] if len(weights) == 1 else torch.cat(weights)).to(self.dtype)
            packed: torch.Tensor = self._ops._reorder_linear_weight(weight, self._rows)
            del weight, weights
            biases = [layer.bias for layer in group]
            bias = (
                torch.cat(
                    [
                        b.detach() if b is not None else layer.weight.new_zeros(layer.out_features)
                        for b, layer in zip(biases, group, strict=True)
                    ]
                )
                if len(group) > 1 and any(b is not None for b in biases)
                else None
            )
        self._packed[key] = (list(group), identity, packed, bias)
        return packed, bias


def _forward(
    ops: Any,
    weight: torch.Tensor,
    ready: dict[int, tuple[torch.Tensor, torch.Tensor]],
    multiply: Callable[[torch.Tensor], bool] | None = None,
) -> Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]:
    """A layer's forward pass through oneDNN with ``weight`` (packed, or the layer's own), or its slice of
    a group's product for this very input (``ready``, :meth:`PackedLinears.multiply_group`); a member of a
    stacked group (``multiply``: the group's product of an input) takes its slice of the product of its
    input when none is ready."""

    def forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if ready:
            done = ready.pop(id(layer), None)
            if done is not None and done[0] is x:
                return done[1]
        if multiply is not None and multiply(x):
            return ready.pop(id(layer))[1]
        if torch.is_grad_enabled() or x.dtype != torch.float32:  # not generation: PyTorch's own
            plain: torch.Tensor = torch.nn.functional.linear(x, layer.weight, layer.bias)
            return plain
        return _product(ops, x, weight, layer.bias)

    return forward
