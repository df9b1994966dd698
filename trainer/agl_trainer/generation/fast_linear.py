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
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
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

    def __init__(self, model: Callable[[], Any], *, rows: int = 16, budget_bytes: int = 128 * 2**20) -> None:
        self._model = model
        self._rows = rows
        self.budget_bytes = budget_bytes
        self._ops = _ops()
        #: id(layer) -> (layer, weight identity when packed, packed weight)
        self._packed: dict[int, tuple[torch.nn.Linear, tuple[int, int], torch.Tensor]] = {}
        self._patched: list[torch.nn.Linear] = []

    @property
    def nbytes(self) -> int:
        return sum(packed.numel() * packed.element_size() for _, _, packed in self._packed.values())

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
        for layer in sorted(layers, key=lambda layer: -layer.weight.numel()):
            size = layer.weight.numel() * layer.weight.element_size()
            weight = self._pack(layer) if size <= room else layer.weight
            room -= size if size <= room else 0
            layer.forward = types.MethodType(_forward(self._ops, weight), layer)  # type: ignore[method-assign]
            self._patched.append(layer)
        return self

    def __exit__(self, *exc: object) -> None:
        for layer in self._patched:
            layer.__dict__.pop("forward", None)  # the class's forward again
        self._patched.clear()

    def _pack(self, layer: torch.nn.Linear) -> torch.Tensor:
        weight = layer.weight
        identity = (weight.data_ptr(), weight._version)
        known = self._packed.get(id(layer))
        if known is not None and known[0] is layer and known[1] == identity:
            return known[2]
        self._packed.pop(id(layer), None)  # the stale copy goes before the new one is made
        with torch.no_grad():
            packed: torch.Tensor = self._ops._reorder_linear_weight(weight.detach(), self._rows)
        self._packed[id(layer)] = (layer, identity, packed)
        return packed


def _forward(ops: Any, weight: torch.Tensor) -> Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]:
    """A layer's forward pass through oneDNN with ``weight`` (packed, or the layer's own)."""

    def forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != torch.float32:  # not generation: PyTorch's own
            plain: torch.Tensor = torch.nn.functional.linear(x, layer.weight, layer.bias)
            return plain
        out: torch.Tensor = ops._linear_pointwise(x, weight, layer.bias, "none", [], "")
        return out

    return forward
