"""Generation's matrix products on the CPU, with weights laid out once for oneDNN.

A decoding step multiplies a handful of rows (one per sequence) by every weight of the model. PyTorch's
float32 ``linear`` on the CPU goes to MKL's GEMM, which re-packs the weight matrix on every call: for 16
rows that costs as much as the product itself, and the step reads each weight at a quarter of the
machine's memory bandwidth (measured by ``bench/generation.py``). oneDNN can pack a weight once, in the
blocked layout its kernels stream (``torch.ops.mkldnn._reorder_linear_weight``, as PyTorch's own compiler
does for CPU inference), after which a 16-row product reads it about three times faster.

:class:`PackedLinears` keeps such a copy of each large float32 linear weight of the served model and, for
the duration of a generation batch (``with packed:``), routes those layers' forward passes through it. The
copies are made on first use and dropped by :meth:`release`, which the backend calls whenever someone
takes its lock to change the weights, so they never outlive the weights they copy, and they do not sit in
memory beside a weight update's activations. A layer whose weight changed in place since it was packed
(its version counter moved) is packed again. Training never goes through them.
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
        got = ops._linear_pointwise(x, packed, bias, "none", [], "")
    except (AttributeError, RuntimeError, TypeError):
        return False
    return bool(torch.allclose(got, torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-4))


class PackedLinears:
    """oneDNN-packed copies of ``model()``'s large float32 CPU linear weights, used while entered (module
    docstring). ``model`` is a callable, so the backend's current model object is packed (it may be
    wrapped in a PEFT model after a first adapter is loaded)."""

    def __init__(self, model: Callable[[], Any], *, rows: int = 16) -> None:
        self._model = model
        self._rows = rows
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
        for layer in self._model().modules():
            if not isinstance(layer, torch.nn.Linear):
                continue
            weight = layer.weight
            if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.numel() < MIN_WEIGHT:
                continue
            packed = self._pack(layer)
            layer.forward = types.MethodType(_forward(self._ops, packed), layer)  # type: ignore[method-assign]
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
        with torch.no_grad():
            packed: torch.Tensor = self._ops._reorder_linear_weight(weight.detach(), self._rows)
        self._packed[id(layer)] = (layer, identity, packed)
        return packed


def _forward(ops: Any, packed: torch.Tensor) -> Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]:
    def forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != torch.float32:  # not generation: PyTorch's own
            plain: torch.Tensor = torch.nn.functional.linear(x, layer.weight, layer.bias)
            return plain
        out: torch.Tensor = ops._linear_pointwise(x, packed, layer.bias, "none", [], "")
        return out

    return forward
