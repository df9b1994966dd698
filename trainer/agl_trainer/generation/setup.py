"""The transformers backend's decoding set-up (:func:`set_up_decoding`, run once by
:class:`~agl_trainer.generation.hf_backend.HFBackend`): the key/value memory and the decoding paths its model
and device allow (slot cache, prefix cache, fixed-shape steps, direct steps, packed products)."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from ..cpu import release_openmp_threads
from . import fast_linear
from .decoding import StaticDecode
from .direct_decode import DirectDecode, layer_groups, recognize
from .kv_cache import PrefixCache, SlotCache, cache_shape

if TYPE_CHECKING:
    from .hf_backend import HFBackend

__all__ = ["DecodingPaths", "set_up_decoding"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DecodingPaths:
    """What :func:`set_up_decoding` chose; ``None`` for each path this model and device do not take."""

    #: ``slots`` or ``dynamic`` (transformers' own cache).
    kv_cache: str
    slots: SlotCache | None
    prefix_cache: PrefixCache | None
    static: StaticDecode | None
    linears: fast_linear.PackedLinears | None
    direct: DirectDecode | None


def set_up_decoding(
    backend: HFBackend,
    *,
    kv_cache: str,
    prefix_cache_mb: float,
    prefix_block_tokens: int,
    static_decode: bool | None,
    cuda_graphs: bool,
    packed_linears: bool | None,
    packed_weights_mb: float,
    direct_decode: bool,
    matmul_dtype: torch.dtype,
) -> DecodingPaths:
    """The key/value memory and the decoding paths for ``backend``'s model and device (``HFBackend``'s
    arguments of the same names)."""
    model, route = backend.model, backend.route
    #: ``slots``: a preallocated cache written in place, and prompt prefixes reused (``prefix_cache``);
    #: ``dynamic``: transformers' own cache, every prompt prefilled whole (also for an architecture
    #: the slots do not cover).
    shape = cache_shape(model) if kv_cache == "slots" else None
    if kv_cache == "slots" and shape is None:
        logger.info("agl: %s is served with transformers' dynamic cache", type(model).__name__)
    slots = SlotCache(shape) if shape is not None else None
    #: Keys and values of prompt prefixes under the current policy version (``None``: off).
    prefix_cache = (
        PrefixCache(block_tokens=prefix_block_tokens, max_bytes=int(prefix_cache_mb * 2**20))
        if shape is not None and prefix_cache_mb > 0
        else None
    )
    #: Decoding steps with fixed shapes (every slot, the cache's whole width): the default on a GPU,
    #: where ``cuda_graphs`` captures the step once and replays it. Not with adapters per agent.
    if static_decode is None:
        static_decode = shape is not None and shape.device.type == "cuda"
    static = (
        StaticDecode(backend, slots, graphs=cuda_graphs)
        if static_decode and slots is not None and route is None
        else None
    )
    #: Decoding steps that run the model's modules directly, without its forward pass's per-call
    #: machinery (:mod:`.direct_decode`), for the architectures that recognizes; off with
    #: ``direct_decode=False`` (every step through the forward pass).
    unrecognized = recognize(model) if shape is not None and direct_decode else "off"
    if unrecognized not in (None, "off"):
        logger.info("agl: decoding steps go through the model's forward pass: %s", unrecognized)
    #: On the CPU, generation multiplies the large float32 weights through oneDNN, with packed copies of
    #: the largest within ``packed_weights_mb`` (:mod:`.fast_linear`; with room for all of them, the
    #: direct steps' grouped products); ``None``: wherever this PyTorch has it.
    #: ``matmul_dtype`` bfloat16: those copies in bfloat16 (the sampler is the rounded model; see
    #: :mod:`.fast_linear`), where the packed products run at all.
    on_cpu = shape is not None and shape.device.type == "cpu" and shape.dtype == torch.float32
    if matmul_dtype != torch.float32:
        if not on_cpu or packed_linears is False:
            raise ValueError(
                "matmul_dtype bfloat16 rounds the packed copies of a float32 model generating on the"
                " CPU; this model is served in another way (a GPU, or a model loaded in another dtype:"
                " set the model's dtype instead), so set matmul_dtype to float32"
            )
        if not fast_linear.available(matmul_dtype):
            raise ValueError(
                "matmul_dtype bfloat16 needs oneDNN's bfloat16 products, which this PyTorch or CPU"
                f" lacks (CPU capability {torch.backends.cpu.get_cpu_capability()}); set matmul_dtype"
                " to float32"
            )
    if packed_linears is None:
        packed_linears = on_cpu and fast_linear.available()
    linears = (
        fast_linear.PackedLinears(
            lambda: backend.model,
            rows=backend.max_batch,
            budget_bytes=int(packed_weights_mb * 2**20),
            groups=layer_groups if unrecognized is None else None,
            dtype=matmul_dtype,
        )
        if packed_linears
        else None
    )
    direct = DirectDecode(lambda: backend.model, linears) if unrecognized is None else None
    release_openmp_threads()  # the checks above ran parallel regions in the caller's thread
    return DecodingPaths(
        "slots" if shape is not None else "dynamic", slots, prefix_cache, static, linears, direct
    )
