"""What a round does with the model: train a candidate from the serving version on chosen rollouts
(``train_from_traces``), score it against the serving version on the held-out tasks (``agl eval``'s
scorer), and save the untrained adapter that stands for the base model when it must be published.

:class:`RoundWork` is the seam: the service calls these three through it, so a custom scorer (an
offline judge, a larger held-out set) can replace the default.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..config import TrainerConfig

if TYPE_CHECKING:
    from ..run.traces import Selection

__all__ = ["RoundWork", "TrainerRoundWork", "copy_adapter"]


class RoundWork(Protocol):
    def train(self, round_dir: Path, selection: Selection, parent_adapter: Path | None) -> Path:
        """Train a candidate on the rollouts of ``selection`` (the watcher's spans of the round's chosen
        rollouts) starting from ``parent_adapter`` (``None``: the base model); the directory of the
        candidate's LoRA adapter."""
        ...

    def score(self, candidate: Path, serving: Path | None) -> tuple[dict[str, float], dict[str, float]]:
        """Per-task held-out scores ``(serving, candidate)`` on the same tasks."""
        ...

    def base_adapter(self, path: Path) -> None:
        """Save an adapter that changes nothing (the base model) in ``path``."""
        ...


class TrainerRoundWork:
    """The default: the trainer's own stored-traces training and held-out scorer."""

    def __init__(self, config: TrainerConfig, echo: Callable[[str], None]) -> None:
        self.config, self.echo = config, echo

    def train(self, round_dir: Path, selection: Selection, parent_adapter: Path | None) -> Path:
        from ..run.offline import train_from_traces
        from ..saved import find_checkpoint

        config = self.config
        assert config.traces is not None
        derived = config.model_copy(
            update={
                "output_dir": round_dir,
                "model": config.model.model_copy(
                    update={"init_adapter": None if parent_adapter is None else str(parent_adapter)}
                ),
                "validation": config.validation.model_copy(update={"before": False, "after": False}),
                "checkpoint": config.checkpoint.model_copy(update={"every_steps": 0, "keep": 1}),
                "improve": None,
            }
        )
        train_from_traces(
            derived, echo=lambda line: self.echo(f"  {line}"), overwrite=True, selection=selection
        )
        adapter = find_checkpoint(round_dir).adapter
        if adapter is None:
            raise RuntimeError(f"the round in {round_dir} saved no LoRA adapter (is model.lora set?)")
        return adapter

    def check_held_out(self) -> int:
        """Read the held-out tasks the gate scores on, before any round trains: a missing or malformed
        task file is found at the start, not after a round's training. How many tasks there are; raises
        ``ValueError`` (a ``DatasetError``) saying what is wrong."""
        from ..run.data import load_splits

        if self.config.tasks is None:
            raise ValueError("the gate scores the held-out tasks of tasks.val, and the config has no tasks:")
        held_out = load_splits(self.config.tasks)[1]
        if not held_out:
            raise ValueError(
                "the gate scores the held-out tasks, and the config has none (set tasks.val or"
                " tasks.val_fraction)"
            )
        return len(held_out)

    def score(self, candidate: Path, serving: Path | None) -> tuple[dict[str, float], dict[str, float]]:
        from ..evaluate import evaluate

        config = self.config.model_copy(update={"improve": None})
        result = evaluate(
            config,
            checkpoint=candidate,
            baseline=True if serving is None else serving,
            echo=lambda line: self.echo(f"  {line}"),
        )
        assert result.baseline is not None
        return dict(result.baseline.result.task_scores), dict(result.score.result.task_scores)

    def base_adapter(self, path: Path) -> None:
        from peft import get_peft_model

        from ..learning.policy import peft_lora_config
        from ..model import load_policy

        if self.config.model.lora is None:
            raise ValueError("agl improve publishes LoRA adapters; set model.lora")
        model, _ = load_policy(self.config.model.source, seed=self.config.model.seed)
        peft_model = get_peft_model(model, peft_lora_config(self.config.model.lora))
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        peft_model.save_pretrained(str(tmp))
        tmp.rename(path)


def copy_adapter(source: Path, target: Path) -> Path:
    """Copy an adapter directory to ``target`` (through a temporary name, so ``target`` is whole or
    absent); ``target``."""
    if target.is_dir():
        return target
    tmp = target.with_name(f"{target.name}.tmp-{int(time.time() * 1000)}")
    shutil.copytree(source, tmp)
    tmp.rename(target)
    return target
