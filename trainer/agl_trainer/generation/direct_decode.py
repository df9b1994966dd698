"""A decoding step that runs a Llama-family model's own modules directly, without its forward pass.

transformers' forward pass of a decoder does for one new token per row what it does for a whole prompt:
it checks and normalizes its arguments, builds the position embeddings and masks, and goes through its
cache object and its attention interface in every layer. For SmolLM2's 30 layers and 16 rows on 2 CPU
cores that machinery takes about 40 of a decoding step's 120 ms (bench/generation.py). :class:`DirectDecode`
calls the same modules in the order a Llama decoder layer runs them: the model's own embedding, norms,
rotary embedding, projections (LoRA-wrapped or not, and through the backend's oneDNN linears while they
are entered), activation and output layer, so what it computes is the model's own arithmetic. Each new
key and value goes straight into its row's slot, and attention is :func:`.attention.decode_attention`'s
(the prefix all rows share read once).

It serves models it recognizes: Llama, Mistral without a sliding window and Qwen2 (the same layer, with
biases on the projections), plain or under PEFT's LoRA, rows with one adapter or several (PEFT's
mixed-adapter batches). The first step after each change of the weights is also run through the model's
own forward pass and their logits compared; a step that disagrees is logged and every step after goes
through the forward pass, as does every step for a model this module does not recognize.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .attention import decode_attention

__all__ = ["DirectDecode", "layer_groups", "recognize"]

logger = logging.getLogger(__name__)

#: ``config.model_type`` of the architectures whose decoder layer is the one :meth:`DirectDecode.step` runs.
MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


def _base(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (or ``model`` itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def recognize(model: Any) -> str | None:
    """Why :class:`DirectDecode` cannot run ``model``'s decoding steps, or ``None`` when it can."""
    base = _base(model)
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(sorted(MODEL_TYPES))}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "the model attends within a sliding window"
    if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
        return "the model splits its projections (pretraining_tp)"
    inner = getattr(base, "model", None)
    needed = {
        "model": ("embed_tokens", "layers", "norm", "rotary_emb"),
        "layer": ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"),
        "attention": ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"),
        "mlp": ("gate_proj", "up_proj", "down_proj", "act_fn"),
    }
    if inner is None or not hasattr(base, "lm_head"):
        return "the model has no decoder stack and output layer where Llama keeps them"
    layers = getattr(inner, "layers", None) or []
    parts: list[tuple[str, Any]] = [("model", inner)]
    for layer in layers:
        parts.append(("layer", layer))
        parts += [("attention", getattr(layer, "self_attn", None)), ("mlp", getattr(layer, "mlp", None))]
    for kind, part in parts:
        missing = [name for name in needed[kind] if not hasattr(part, name)]
        if missing:
            return f"a {kind} of the model has no {', '.join(missing)}"
    return None


def _plain(module: Any) -> Any:
    """The linear layer under a PEFT LoRA layer (or ``module`` itself)."""
    get_base = getattr(module, "get_base_layer", None)
    return get_base() if callable(get_base) else module


def layer_groups(model: Any) -> list[list[torch.nn.Linear]]:
    """Per decoder layer of a model :func:`recognize` accepts, the linear layers that multiply the same
    input: the query, key and value projections, then the gate and up projections (under PEFT's LoRA
    layers, the plain layers it wraps); for :class:`~.fast_linear.PackedLinears`' grouped products."""
    groups: list[list[torch.nn.Linear]] = []
    for layer in _base(model).model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for members in (
            (attention.q_proj, attention.k_proj, attention.v_proj),
            (mlp.gate_proj, mlp.up_proj),
        ):
            plain = [_plain(m) for m in members]
            if all(isinstance(m, torch.nn.Linear) for m in plain):
                groups.append(plain)
    return groups


def logits_match(fast: torch.Tensor, reference: torch.Tensor, rounding: torch.dtype = torch.float32) -> bool:
    """Whether logits computed another way (the direct step, a replayed CUDA graph) are the reference's up
    to the rounding of the least precise of their dtypes and ``rounding`` (the dtype the products round
    to on the way, :mod:`.fast_linear`'s bfloat16 copies), compared in float32: within 1e-3, or within 4
    units in the last place of the largest logit (bfloat16 keeps 8 bits of mantissa, so kernels that sum
    in another order, or inputs that round to the other side of a bfloat16 step, differ by a few tenths
    on logits of 30)."""
    coarse = max((fast.dtype, reference.dtype, rounding), key=lambda dtype: torch.finfo(dtype).eps)
    fast, reference = fast.float(), reference.float()
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    ulps = 4 * torch.finfo(coarse).eps * max(scale, 1.0)
    return bool(torch.allclose(fast, reference, atol=max(1e-3, ulps), rtol=1e-3))


class DirectDecode:
    """Decoding steps through the model's modules (module docstring). ``model`` is a callable, so the
    backend's current model object is used (a PEFT wrapper may replace it when a first adapter loads)."""

    def __init__(self, model: Any, linears: Any = None) -> None:
        self._model = model
        #: The backend's :class:`~.fast_linear.PackedLinears` (``None``: none), whose grouped products a step
        #: uses where it has them.
        self._linears = linears
        #: Whether the next step is checked against the model's forward pass (after any weight change).
        self._check = True
        #: Turned off after a step that disagreed with the forward pass.
        self.enabled = True
        self._lora: set[int] | None = None
        self._owner: Any = None

    def reset(self) -> None:
        """The weights may change: the next step is checked again."""
        self._check = True
        self._lora = None

    @property
    def checking(self) -> bool:
        return self._check

    def checked(self, logits: torch.Tensor, reference: torch.Tensor) -> bool:
        """Compare a step's logits with the forward pass's for the same step; ``False`` (and off from now on,
        with a warning) when they disagree."""
        self._check = False
        rounding = getattr(self._linears, "dtype", torch.float32)
        if logits_match(logits, reference, rounding):
            return True
        logger.warning(
            "agl: the direct decoding step gave other logits than the model's forward pass (largest"
            " difference %.3g); decoding through the forward pass from now on",
            float((logits - reference).abs().max()),
        )
        self.enabled = False
        return False

    def _lora_layers(self, model: Any) -> set[int]:
        """ids of the modules that take PEFT's ``adapter_names`` (its LoRA layers)."""
        if self._lora is None or self._owner is not model:
            try:
                from peft.tuners.lora import LoraLayer
            except ImportError:  # no PEFT: no adapters
                self._lora = set()
            else:
                self._lora = {id(module) for module in model.modules() if isinstance(module, LoraLayer)}
            self._owner = model
        return self._lora

    def step(
        self,
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        ids: torch.Tensor,
        positions: torch.Tensor,
        shared: int,
        adapters: dict[str, Any],
    ) -> torch.Tensor:
        """The next-token logits (float32, ``[rows, vocab]``) after feeding each row its token ``ids``
        (``[rows]``) at ``positions`` (``[rows]``, each row's slot's next column); ``layers``: each layer's
        keys and values ``[slots, kv_heads, columns, head_dim]``, rows in slots ``0 .. rows - 1``;
        ``shared``: columns all rows hold alike (0: none); ``adapters``: the forward pass's
        ``adapter_names`` argument, if any."""
        model = self._model()
        base = _base(model)
        inner = base.model
        lora = self._lora_layers(model) if adapters else set()

        def project(module: Any, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = module(x, **adapters) if id(module) in lora else module(x)
            return out

        rows = ids.shape[0]
        row_index = torch.arange(rows, device=ids.device)
        width = int(positions.max()) + 1
        mask = (torch.arange(width, device=ids.device)[None, :] <= positions[:, None])[:, None, None]
        x = inner.embed_tokens(ids[:, None])  # [rows, 1, hidden]
        cos, sin = inner.rotary_emb(x, positions[:, None])  # [rows, 1, head_dim]
        linears = self._linears
        groups = linears.groups if linears is not None else []  # stacked while the batch runs
        grouped = len(groups) == 2 * len(inner.layers)
        for index, layer in enumerate(inner.layers):
            attention = layer.self_attn
            dim = int(attention.head_dim)
            h = layer.input_layernorm(x)
            if grouped:  # query, key and value in one product where the packed copies allow it
                linears.multiply_group(groups[2 * index], h)
            q = project(attention.q_proj, h).view(rows, 1, -1, dim).transpose(1, 2)
            k = project(attention.k_proj, h).view(rows, 1, -1, dim).transpose(1, 2)
            v = project(attention.v_proj, h).view(rows, 1, -1, dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)  # transformers' own (Llama, Mistral, Qwen2 alike)
            keys, values = layers[index]
            keys[row_index, :, positions] = k[:, :, 0].to(keys.dtype)
            values[row_index, :, positions] = v[:, :, 0].to(values.dtype)
            out = decode_attention(
                q, keys[:rows, :, :width], values[:rows, :, :width], mask, shared, float(attention.scaling)
            )
            x = x + project(attention.o_proj, out.reshape(rows, 1, -1))
            h = layer.post_attention_layernorm(x)
            if grouped:  # gate and up in one product
                linears.multiply_group(groups[2 * index + 1], h)
            x = x + self._mlp(layer.mlp, h, project)
        logits: torch.Tensor = project(base.lm_head, inner.norm(x))[:, -1].float()
        return logits

    @staticmethod
    def _mlp(mlp: Any, h: torch.Tensor, project: Any) -> torch.Tensor:
        """Llama's gated MLP, ``down(act(gate(h)) * up(h))``, each projection LoRA-aware."""
        gated: torch.Tensor = mlp.act_fn(project(mlp.gate_proj, h)) * project(mlp.up_proj, h)
        out: torch.Tensor = project(mlp.down_proj, gated)
        return out
