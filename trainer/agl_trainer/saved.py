"""What ``agl train`` saved, found from a path a user gives: a checkpoint directory, a PEFT adapter
directory or a run's output_dir (:func:`find_checkpoint`), and whether a LoRA adapter fits a ``model.lora``
shape (:func:`check_adapter_fits`). Reads only small JSON files and safetensors headers: no torch, so the
config layer can check a path before any model loads."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "STATE_FILE",
    "Checkpoint",
    "CheckpointError",
    "adapter_shapes",
    "adapter_weights",
    "check_adapter_fits",
    "find_checkpoint",
]

#: The file whose presence marks a checkpoint directory complete (written last).
STATE_FILE = "state.json"


class CheckpointError(ValueError):
    """A path holds no checkpoint or adapter of the kind asked for; the message says what to pass instead."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A policy ``agl train`` saved: a checkpoint directory (``output_dir/checkpoints/step-N``) with a
    LoRA ``adapter`` directory or full ``weights``, or a bare PEFT adapter directory."""

    path: Path
    adapter: Path | None
    weights: Path | None
    #: The training step and policy version it was saved at (``None`` for a bare adapter directory).
    step: int | None = None
    policy_version: int | None = None
    #: A checkpoint of a run with ``policies``: each policy's adapter directory (``adapter/<policy>``).
    adapters: dict[str, Path] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        return str(self.path) + (
            f" (policy v{self.policy_version})" if self.policy_version is not None else ""
        )


def find_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at ``path``: a checkpoint directory, its ``adapter`` directory, any PEFT adapter
    directory, or a directory of checkpoints (a run's ``output_dir`` or its ``checkpoints``), whose newest
    is taken. Raises :class:`CheckpointError` naming what was there instead."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory")
    if (path / STATE_FILE).is_file():
        state = json.loads((path / STATE_FILE).read_text())
        adapter = path / "adapter"
        weights = path / "model.safetensors"
        # a run with policies: one adapter per policy, in adapter/<policy>/
        adapters = {
            child.name: child
            for child in sorted(adapter.iterdir() if adapter.is_dir() else ())
            if (child / "adapter_config.json").is_file()
        }
        if not (adapter / "adapter_config.json").is_file() and not weights.is_file() and not adapters:
            raise CheckpointError(
                f"checkpoint {path} holds neither an adapter/ directory nor model.safetensors"
            )
        return Checkpoint(
            path,
            adapter if (adapter / "adapter_config.json").is_file() else None,
            weights if weights.is_file() else None,
            int(state["step"]) if "step" in state else None,
            int(state["policy_version"]) if "policy_version" in state else None,
            adapters,
        )
    if (path / "adapter_config.json").is_file():
        return Checkpoint(path, path, None)
    for root in (path / "checkpoints", path):
        found = sorted(
            (p for p in root.glob("step-*") if (p / STATE_FILE).is_file()),
            key=lambda p: p.name,
        )
        if found:
            return find_checkpoint(found[-1])
    raise CheckpointError(
        f"{path} holds no checkpoint: pass a checkpoint directory (OUTPUT_DIR/checkpoints/step-N), a LoRA"
        " adapter directory, or a run's output_dir"
    )


def adapter_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a safetensors file, from its header alone (the tensors are not read).
    :class:`CheckpointError` when the file is not safetensors."""
    try:
        with weights.open("rb") as fh:
            size_bytes = fh.read(8)
            if len(size_bytes) != 8:
                raise CheckpointError(f"{weights} is not a safetensors file (shorter than its header)")
            (size,) = struct.unpack("<Q", size_bytes)
            if size > 100_000_000:
                raise CheckpointError(f"{weights} is not a safetensors file (a header of {size:,} bytes)")
            header = json.loads(fh.read(size))
    except OSError as exc:
        raise CheckpointError(f"{weights} cannot be read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{weights} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{weights} is not a safetensors file (its header is not a mapping)")
    shapes: dict[str, tuple[int, ...]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(f"{weights}: tensor {name!r} has no valid shape in the header")
        shapes[name] = tuple(shape)
    return shapes


def _lora_settings(adapter: Path) -> dict[str, Any]:
    try:
        settings = json.loads((adapter / "adapter_config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{adapter}/adapter_config.json cannot be read as JSON: {exc}") from None
    if not isinstance(settings, dict) or settings.get("peft_type") != "LORA":
        found = settings.get("peft_type") if isinstance(settings, dict) else None
        raise CheckpointError(f"{adapter} holds a PEFT adapter of type {found!r}, not a LoRA adapter")
    return settings


def adapter_weights(path: str | Path, *, key: str) -> tuple[Checkpoint, Path]:
    """The checkpoint at ``path`` (any form :func:`find_checkpoint` takes) and its single LoRA adapter's
    ``adapter_model.safetensors``; :class:`CheckpointError` naming ``key`` (the config key that gave the
    path) when there is none."""
    try:
        checkpoint = find_checkpoint(path)
    except CheckpointError as exc:
        raise CheckpointError(f"{key}: {exc}") from None
    weights = checkpoint.adapter / "adapter_model.safetensors" if checkpoint.adapter is not None else None
    if weights is None or not weights.is_file():
        raise CheckpointError(
            f"{key}: {checkpoint.path} holds no single LoRA adapter (adapter_model.safetensors)"
        )
    return checkpoint, weights


class LoraShape(Protocol):
    """What an adapter's shape is checked against: ``model.lora`` (a ``LoraConfig``)."""

    @property
    def r(self) -> int: ...
    @property
    def alpha(self) -> float: ...
    @property
    def target_modules(self) -> list[str]: ...


def check_adapter_fits(path: str | Path, *, key: str, lora: LoraShape, like: Path | None = None) -> Path:
    """The ``adapter_model.safetensors`` of the single LoRA adapter at ``path`` (any form
    :func:`find_checkpoint` takes), checked to have ``lora``'s shape (rank, alpha, target modules) and,
    with ``like`` (another adapter's weights), the same tensors with the same shapes.
    :class:`CheckpointError` naming ``key`` (the config key that gave the path) and what differs."""
    r, alpha, target_modules = lora.r, lora.alpha, list(lora.target_modules)
    checkpoint, weights = adapter_weights(path, key=key)
    assert checkpoint.adapter is not None  # adapter_weights found one
    try:
        settings = _lora_settings(checkpoint.adapter)
        shapes = adapter_shapes(weights)
    except CheckpointError as exc:
        raise CheckpointError(f"{key}: {exc}") from None
    theirs = settings.get("target_modules")
    differences = []
    if settings.get("r") != r:
        differences.append(f"rank {settings.get('r')} where model.lora.r is {r}")
    if settings.get("lora_alpha") != alpha:
        differences.append(f"alpha {settings.get('lora_alpha')} where model.lora.alpha is {alpha}")
    if not isinstance(theirs, list) or sorted(theirs) != sorted(target_modules):
        differences.append(
            f"target modules {theirs} where model.lora.target_modules is {sorted(target_modules)}"
        )
    if differences:
        raise CheckpointError(
            f"{key}: the adapter in {checkpoint.adapter} does not fit model.lora: {'; '.join(differences)}"
        )
    if like is not None:
        expected = adapter_shapes(like)
        missing = sorted(set(expected) - set(shapes))
        extra = sorted(set(shapes) - set(expected))
        reshaped = sorted(n for n in set(shapes) & set(expected) if shapes[n] != expected[n])
        if missing or extra or reshaped:
            what = (
                f"{len(missing)} of its tensors missing (e.g. {missing[0]})"
                if missing
                else f"{len(extra)} tensors it does not have (e.g. {extra[0]})"
                if extra
                else f"{reshaped[0]} of shape {list(shapes[reshaped[0]])}, not {list(expected[reshaped[0]])}"
            )
            raise CheckpointError(
                f"{key}: the adapter in {checkpoint.adapter} does not fit the model {like.parent} was trained"
                f" on: against {like.name} there, {what}"
            )
    return weights
