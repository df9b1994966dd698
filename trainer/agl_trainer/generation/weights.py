"""New policy versions for the transformers backend (:meth:`HFBackend.load_policy
<agl_trainer.generation.hf_backend.HFBackend.load_policy>`): a LoRA adapter checked against the served
model's layers before it loads, an adapter for one policy of several, or the full weights. Each raises
:class:`~agl_core.gateway.backend.BackendError` with what did not fit."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from agl_core.gateway.backend import BackendError

__all__ = ["check_adapter_fits", "load_full", "load_lora", "load_policy_lora"]


def check_adapter_fits(model: Any, path: Path, served_name: str) -> None:
    """Refuse, before anything is loaded, an adapter whose LoRA matrices do not fit the served model's
    layers (an adapter trained on another base model), naming both models."""
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        return  # PEFT reports what is missing
    from safetensors import safe_open

    modules = dict(model.named_modules())
    with safe_open(str(weights), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118  (safe_open has keys(), not iteration)
            if ".lora_A." not in key and ".lora_B." not in key:
                continue
            owner = key.split(".lora_")[0].removeprefix("base_model.model.")
            module = next(
                (m for name, m in modules.items() if name == owner or name.endswith("." + owner)), None
            )
            base = getattr(module, "base_layer", module)
            shape = handle.get_slice(key).get_shape()
            wanted = (
                getattr(base, "in_features", None)
                if ".lora_A." in key
                else getattr(base, "out_features", None)
            )
            got = shape[1] if ".lora_A." in key else shape[0]
            if module is None or (wanted is not None and wanted != got):
                trained_on = "another model"
                config_file = path / "adapter_config.json"
                with contextlib.suppress(OSError, ValueError):
                    trained_on = (
                        json.loads(config_file.read_text()).get("base_model_name_or_path") or trained_on
                    )
                served = getattr(getattr(model, "config", None), "_name_or_path", "") or served_name
                detail = "no such layer" if module is None else f"{got} features, the layer has {wanted}"
                raise BackendError(
                    f"the adapter in {path} does not fit the served model: it was trained on {trained_on}"
                    f" and this gateway serves {served} ({key}: {detail})"
                )


def load_lora(model: Any, path: Path, name: str, served_name: str) -> Any:
    """The served model with the PEFT adapter in ``path`` loaded as ``name`` and made the active adapter
    (the previous one deleted; a plain model wrapped in a PEFT model)."""
    if not (path / "adapter_config.json").is_file():
        raise BackendError(f"{path} has no adapter_config.json; is it a PEFT LoRA adapter directory?")
    check_adapter_fits(model, path, served_name)
    from peft import PeftModel

    if isinstance(model, PeftModel):
        previous = model.active_adapter
        model.load_adapter(str(path), adapter_name=name)
        model.set_adapter(name)
        if previous != name and previous in model.peft_config:
            model.delete_adapter(previous)
    else:
        model = PeftModel.from_pretrained(model, str(path), adapter_name=name)
    model.eval()
    return model


def load_policy_lora(model: Any, path: Path, policy: str, *, routed: bool) -> Any:
    """Serve the adapter in ``path`` to ``policy``'s agents (a policy per agent): its weights replace
    those of the adapter named ``policy``, or it is loaded under that name."""
    if not routed:
        raise BackendError(
            f"an adapter for policy {policy!r} was published, but this backend serves one policy to"
            " every agent; give it the policies (route=...)"
        )
    if not (path / "adapter_config.json").is_file():
        raise BackendError(f"{path} has no adapter_config.json; is it a PEFT LoRA adapter directory?")
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        model = PeftModel.from_pretrained(model, str(path), adapter_name=policy)
    elif policy in model.peft_config:
        from ..model import load_adapter_weights

        weights = path / "adapter_model.safetensors"
        if not weights.is_file():
            raise BackendError(f"{path} has no adapter_model.safetensors")
        if load_adapter_weights(model, weights, policy):
            raise BackendError(f"{path} does not fit policy {policy!r}'s adapter (other LoRA settings?)")
    else:
        model.load_adapter(str(path), adapter_name=policy)
    model.eval()
    return model


def load_full(model: Any, path: Path, device: torch.device) -> None:
    """Load every weight of the model's architecture from the ``*.safetensors`` files in ``path`` into
    ``model`` (its base model under a PEFT wrapper) in place."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise BackendError(f"{path} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file), device=str(device)))
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    missing, unexpected = target.load_state_dict(state, strict=False)
    tied = (
        {k for k in missing if k.endswith("lm_head.weight")}
        if getattr(target.config, "tie_word_embeddings", False)
        else set()
    )
    lora = {k for k in missing if "lora_" in k}
    if unexpected or set(missing) - tied - lora:
        shown = sorted(set(unexpected) | (set(missing) - tied - lora))[:5]
        raise BackendError(
            f"the weights in {path} do not fit the served model (mismatched keys: {', '.join(shown)})"
        )
