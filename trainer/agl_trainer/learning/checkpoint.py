"""Checkpoints: everything a killed run needs to continue as if it had not stopped.

A checkpoint is a directory ``output_dir/checkpoints/step-NNNNNN`` holding the trained weights (a PEFT
adapter directory under LoRA, loadable by PEFT and vLLM; otherwise ``model.safetensors``), the optimizer
state, the torch RNG state and ``state.json`` (step, policy version, data position, the config with its
secrets masked). It is written under a temporary name and renamed when complete, so a SIGKILL while
saving leaves the previous checkpoint as the newest one.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from agl_core.settings import masked_config

from ..model import load_adapter_weights
from ..saved import STATE_FILE

__all__ = ["CheckpointError", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "save_checkpoint"]

_PREFIX = "step-"


class CheckpointError(RuntimeError):
    """A checkpoint is missing or does not fit the run; the message says what to do."""


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config")


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and (p / STATE_FILE).is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: Any,
    optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer],
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write the checkpoint of ``step`` and drop all but the ``keep`` newest; returns its directory.

    ``optimizer`` may be a mapping ``{policy: optimizer}`` (a policy per agent): the model then holds one
    adapter per policy, saved under ``adapter/<policy>/``, and ``optimizer.pt`` maps each policy to its
    optimizer's state."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:06d}"
    tmp = root / f".tmp-{_PREFIX}{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    if _is_peft(model):
        model.save_pretrained(tmp / "adapter")
    else:
        from safetensors.torch import save_model

        save_model(model, str(tmp / "model.safetensors"))
    if isinstance(optimizer, Mapping):
        torch.save({name: o.state_dict() for name, o in optimizer.items()}, tmp / "optimizer.pt")
    else:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(torch.get_rng_state(), tmp / "rng.pt")
    # state.json last: its presence marks the directory complete (see list_checkpoints). Secrets in the
    # config (tokens, passwords in URLs) are masked: a resumed run takes them from its config and env again.
    (tmp / STATE_FILE).write_text(json.dumps(masked_config({"step": step, **state}), indent=2, default=str))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(
    path: Path, *, model: Any, optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer]
) -> dict[str, Any]:
    """Restore weights, optimizer and RNG from ``path`` into the given objects; returns ``state.json``.
    With a mapping of optimizers (a policy per agent), every policy's adapter and optimizer."""
    state: dict[str, Any] = json.loads((path / STATE_FILE).read_text())  # save_checkpoint wrote an object
    if isinstance(optimizer, Mapping):
        _load_policies(path, model, optimizer)
    elif _is_peft(model):
        adapter = path / "adapter" / "adapter_model.safetensors"
        if not adapter.is_file() and (path / "adapter").is_dir():
            raise CheckpointError(
                f"{path} holds one adapter per policy (a run with policies:); resume it with its policies"
            )
        if not adapter.is_file():
            raise CheckpointError(
                f"{path} holds full model weights, but this run trains a LoRA adapter; resume with the "
                "checkpoint's model.lora setting"
            )
        unexpected = load_adapter_weights(model, adapter)
        if unexpected:
            raise CheckpointError(
                f"{path}: the adapter does not fit this model (unexpected keys {unexpected[:3]})"
            )
    else:
        weights = path / "model.safetensors"
        if not weights.is_file():
            raise CheckpointError(
                f"{path} holds a LoRA adapter, but this run trains all weights; resume with the checkpoint's "
                "model.lora setting"
            )
        from safetensors.torch import load_model

        load_model(model, str(weights))
    if not isinstance(optimizer, Mapping):
        try:
            optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        except (ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: the optimizer state does not fit this model: {exc}") from None
    torch.set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return state


def _load_policies(path: Path, model: Any, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
    """Each policy's adapter and optimizer state from a checkpoint of a run with ``policies``."""
    saved = torch.load(path / "optimizer.pt", weights_only=True)
    if not isinstance(saved, dict) or not all(
        isinstance(k, str) and isinstance(v, dict) for k, v in saved.items()
    ):
        raise CheckpointError(
            f"{path} was written by a run with one shared policy; resume it without policies: (or start over)"
        )
    missing = [name for name in optimizers if name not in saved]
    if missing:
        raise CheckpointError(
            f"{path} holds no adapter of policy {missing[0]!r} (it has {', '.join(sorted(saved)) or 'none'});"
            " resume with the checkpoint's policies, or start over"
        )
    for name, optimizer in optimizers.items():
        adapter = path / "adapter" / name / "adapter_model.safetensors"
        if not adapter.is_file():
            raise CheckpointError(f"{path}: the adapter of policy {name!r} is missing ({adapter})")
        unexpected = load_adapter_weights(model, adapter, name)
        if unexpected:
            raise CheckpointError(
                f"{path}: policy {name!r}'s adapter does not fit this model ({unexpected[:3]})"
            )
        try:
            optimizer.load_state_dict(saved[name])
        except (ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: policy {name!r}'s optimizer state does not fit: {exc}") from None
