"""What a training run shows and leaves behind: the live display, the reward curve, TensorBoard scalars."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Display", "Scalars", "mean_se", "plot_reward_curve"]

logger = logging.getLogger(__name__)


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for fewer than two values)."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


class Display:
    """Progress of a run. ``plain`` prints one line per event (logs, pipes, CI); ``rich`` keeps a live
    bar with the step, rollouts done/failed, reward, loss, tokens/s and ETA, printing the same lines
    above it."""

    def __init__(self, mode: str, total_steps: int, *, echo: Callable[[str], None] = print) -> None:
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() and os.environ.get("TERM") != "dumb" else "plain"
        self.mode = mode
        self.echo = echo
        self.total_steps = total_steps
        self._progress: Any = None
        self._bar: Any = None
        self._rollouts: Any = None
        self._fields = {"reward": "-", "loss": "-", "tok_s": "-", "failed": 0}
        if mode == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=False,
            )

    def __enter__(self) -> Display:
        if self._progress is not None:
            self._progress.start()
            self._bar = self._progress.add_task("steps", total=self.total_steps, info="")
            self._rollouts = self._progress.add_task("rollouts", total=1, info="", visible=False)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.update(self._rollouts, visible=False)
            self._progress.stop()

    def line(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            self.echo(text)

    def start_step(self, step: int, completed: int) -> None:
        if self._progress is not None:
            self._progress.update(
                self._bar, completed=completed, description=f"step {step}/{self.total_steps}"
            )

    def rollouts(self, label: str, done: int, failed: int, total: int) -> None:
        if self._progress is not None:
            info = f"{failed} failed" if failed else ""
            self._progress.update(
                self._rollouts,
                description=label,
                completed=done + failed,
                total=total,
                info=info,
                visible=True,
            )

    def end_step(
        self, completed: int, *, reward: float | None, loss: float | None, tokens_per_s: float
    ) -> None:
        if self._progress is not None:
            info = (
                (f"reward {reward:.3f}" if reward is not None else "reward n/a")
                + (f"  loss {loss:+.4f}" if loss is not None else "")
                + f"  {tokens_per_s:,.0f} tok/s"
            )
            self._progress.update(self._bar, completed=completed, info=info)
            self._progress.update(self._rollouts, visible=False)


class Scalars:
    """TensorBoard scalars under ``log_dir`` when tensorboard is installed (``mode`` ``auto``), or
    required (``True``); nothing when ``False``."""

    def __init__(self, log_dir: Path, mode: Any) -> None:
        self._writer: Any = None
        if mode is False:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            if mode is True:
                raise RuntimeError(
                    "logging.tensorboard is true but tensorboard is not installed: pip install 'tensorboard<2.20'"
                    " (or set logging.tensorboard: auto)"
                ) from None
            return
        self._writer = SummaryWriter(str(log_dir))

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def add(self, step: int, values: dict[str, float | None]) -> None:
        if self._writer is None:
            return
        for name, value in values.items():
            if value is not None and math.isfinite(value):
                self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def plot_reward_curve(
    path: Path,
    train: Sequence[tuple[int, float]],
    val: Sequence[tuple[int, float, float]] = (),
    *,
    title: str = "reward",
) -> Path | None:
    """Draw mean training reward by step and validation mean ± SE into ``path`` (written atomically).

    Returns the path, or ``None`` when matplotlib is missing (logged once).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("agl: matplotlib is not installed; no reward curve (pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    try:
        if train:
            xs, ys = zip(*train)
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2, label="train (mean reward of the step)")
        if val:
            xs, ys, errs = zip(*val)
            ax.errorbar(
                xs,
                ys,
                yerr=errs,
                marker="s",
                markersize=4,
                capsize=3,
                linewidth=1.2,
                label="validation (mean ± SE)",
            )
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if train or val:
            ax.legend(loc="best", fontsize=8)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.png")
        fig.savefig(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
    return path
