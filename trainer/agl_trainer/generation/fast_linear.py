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
input returns (a PEFT LoRA layer around it adds its own term as usual). Any other call of a member
computes as before.
"""

from __future__ import annotations

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


def available() -> bool:
    """Whether this PyTorch has oneDNN's packed linear on the CPU, and it computes what ``linear`` does."""
    ops = _ops()
    if not torch.backends.mkldnn.is_available() or ops is None:  # type: ignore[no-untyped-call]
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(64, 32, generator=generator)
        bias = torch.randn(64, generator=generator)
        x = torch.randn(3, 5, 32, generator=generator)
        packed = ops._reorder_linear_weight(weight, 4)
        results = [ops._linear_pointwise(x, w, bias, "none", [], "") for w in (packed, weight)]
    except (AttributeError, RuntimeError, TypeError):
        return False
    expected = torch.nn.functional.linear(x, weight, bias)
    return all(torch.allclose(got, expected, atol=1e-4, rtol=1e-4) for got in results)


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
    ) -> None:
        self._model = model
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
        sizes = {id(layer): layer.weight.numel() * layer.weight.element_size() for layer in layers}
        grouped: set[int] = set()
        if self._groups is not None and sum(sizes.values()) <= room:  # every weight fits: stack the groups
            self.groups = self._groups(self._model())
            for group in self.groups:
                if len(group) > 1 and all(id(layer) in sizes for layer in group):
                    self._active[tuple(id(layer) for layer in group)] = self._copy(group)
                    grouped.update(id(layer) for layer in group)
                    room -= sum(sizes[id(layer)] for layer in group)
        for layer in sorted(layers, key=lambda layer: -layer.weight.numel()):
            size = sizes[id(layer)]
            fits = id(layer) not in grouped and size <= room
            weight = self._copy([layer])[0] if fits else layer.weight
            room -= size if fits else 0
            forward = _forward(self._ops, weight, self._ready)
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
        out: torch.Tensor = self._ops._linear_pointwise(x, weight, bias, "none", [], "")
        start = 0
        for layer in layers:
            end = start + layer.out_features
            self._ready[id(layer)] = (x, out[..., start:end])
            start = end
        return True

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
            weight = weights[0] if len(weights) == 1 else torch.cat(weights)
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
    ops: Any, weight: torch.Tensor, ready: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]:
    """A layer's forward pass through oneDNN with ``weight`` (packed, or the layer's own), or its slice of
    a group's product for this very input (``ready``, :meth:`PackedLinears.multiply_group`)."""

    def forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if ready:
            done = ready.pop(id(layer), None)
            if done is not None and done[0] is x:
                return done[1]
        if torch.is_grad_enabled() or x.dtype != torch.float32:  # not generation: PyTorch's own
            plain: torch.Tensor = torch.nn.functional.linear(x, layer.weight, layer.bias)
            return plain
        out: torch.Tensor = ops._linear_pointwise(x, weight, layer.bias, "none", [], "")
        return out

    return forward
