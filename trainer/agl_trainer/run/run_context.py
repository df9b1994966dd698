"""The skeleton every training job shares, whatever its steps are made of (rollouts run now, or traces
already stored): :class:`RunContext` checks and prepares ``output_dir``, seeds, opens the display, the run
file (``run.json``, what the dashboard shows of a running job) and the run log (``metrics.jsonl``, the
reward curve, the trackers), runs the held-out passes and prints the closing lines. What it starts closes
with it, in reverse order, also on error.

:func:`agl_trainer.run.loop.train` (online rollouts) and :func:`agl_trainer.run.offline.train_from_traces`
(stored traces) are the two step sources plugged into it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

from agl_core.records import Task
from agl_core.settings import masked_config

from ..config import TrainerConfig
from ..cpu import size_torch_threads
from ..learning.checkpoint import CheckpointError, latest_checkpoint
from ..memory import limit_arenas
from ..reporting.display import Display, held_out_line, plot_reward_curve
from ..reporting.results import EvalResult, StepMetrics
from ..reporting.trackers import Trackers, open_trackers
from .rollouts import RolloutQueue, score_tasks
from .runfile import RUN_FILE, RunFile

__all__ = [
    "CHECKPOINTS_DIR",
    "INFLIGHT_FILE",
    "METRICS_FILE",
    "PLOT_FILE",
    "RunContext",
    "RunExistsError",
    "RunLog",
    "RunResult",
    "held_out_score",
    "prepare_output",
]

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "reward_curve.png"
INFLIGHT_FILE = "inflight.json"
CHECKPOINTS_DIR = "checkpoints"


class RunExistsError(ValueError):
    """``output_dir`` already holds a run and neither ``--resume`` nor ``--overwrite`` was given."""


@dataclasses.dataclass(frozen=True)
class RunResult:
    history: list[StepMetrics]
    before: EvalResult | None
    after: EvalResult | None
    plot: Path | None
    checkpoint: Path | None

    def __len__(self) -> int:  # the number of steps this call ran
        return len(self.history)

    def __getitem__(self, index: int) -> StepMetrics:
        return self.history[index]


class RunLog:
    """What a run leaves in ``output_dir`` as it goes: ``metrics.jsonl``, the reward curve, the scalars
    in the experiment trackers (``logging.tensorboard``, ``logging.trackers``), and the lines on the
    display. The trackers start here, before any rollout, and end when ``stack`` closes, after getting
    the last reward curve."""

    def __init__(self, config: TrainerConfig, display: Display, stack: ExitStack, *, title: str) -> None:
        self.config = config
        self.title = title
        self.display = display
        self.metrics_path = config.output_dir / METRICS_FILE
        self.plot_path = config.output_dir / PLOT_FILE
        self.train_curve: list[tuple[int, float]] = []
        self.val_curve: list[tuple[int, float, float]] = []
        #: With ``policies``: each policy's mean call reward by step.
        self.policy_curves: dict[str, list[tuple[int, float]]] = {}
        self.history: list[StepMetrics] = []
        self.plot: Path | None = None
        self.trackers: Trackers = open_trackers(config, warn=lambda text: display.line(f"warning: {text}"))
        stack.push(self._exit)
        for tracker in self.trackers:
            if tracker.name != "tensorboard":  # train() prints the TensorBoard command at the end
                display.line(tracker.hint)

    def _exit(self, exc_type: type[BaseException] | None, *_: object) -> bool:
        self.close(failed=exc_type is not None)
        return False

    def close(self, *, failed: bool = False) -> None:
        """Give the trackers the last reward curve and end their runs (failed when ``failed``)."""
        if self.plot is not None and self.plot.is_file():
            self.trackers.log_artifact(self.plot)
        self.trackers.close(failed=failed)

    def record_step(self, metrics: StepMetrics) -> None:
        self.history.append(metrics)
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps({"kind": "train", "time": time.time(), **dataclasses.asdict(metrics)}) + "\n")
        self._add_point(metrics.step, metrics.mean_reward, metrics.policies)
        self.trackers.add(
            metrics.step,
            {
                "train/mean_reward": metrics.mean_reward,
                "train/loss": metrics.loss,
                "train/grad_norm": metrics.grad_norm,
                "train/tokens_per_s": metrics.tokens_per_s,
                "train/rollouts_failed": float(metrics.rollouts_failed),
                "train/policy_version": float(metrics.policy_version),
                # every series the dashboard plots (its run page), under the same names
                "train/kl": metrics.kl,
                "train/approx_kl": metrics.approx_kl,
                "train/generation_tokens_per_s": metrics.generation_tokens_per_s,
                "train/rollouts": float(metrics.rollouts),
                "train/rollouts_late": float(metrics.rollouts_late),
                "memory/peak_rss_mb": metrics.peak_rss_mb,
                **{f"time/{phase}_s": _number(seconds) for phase, seconds in metrics.phases.items()},
                **{
                    f"agent/{name}/{key}": _number(row.get(key))
                    for name, row in metrics.agents.items()
                    for key in ("calls", "trained")
                },
            },
        )
        if metrics.pipeline is not None:
            p = metrics.pipeline
            self.trackers.add(
                metrics.step,
                {
                    "async/dropped_groups": float(p["dropped_groups"]),
                    "async/mean_staleness": _mean_staleness(p["staleness"]),
                    "async/finished_during_update": float(p["finished_during_update"]),
                    "async/wait_s": float(p["wait_s"]),
                },
            )
        for name, row in (metrics.policies or {}).items():
            self.trackers.add(
                metrics.step,
                {
                    f"policy/{name}/reward": row.get("reward"),
                    f"policy/{name}/loss": row["loss"],
                    f"policy/{name}/grad_norm": row["grad_norm"],
                    f"policy/{name}/trained": float(row["trained"]),
                    f"policy/{name}/calls": float(row["calls"]),
                },
            )

    def _add_point(
        self, step: int, mean_reward: float | None, policies: dict[str, dict[str, Any]] | None
    ) -> None:
        if mean_reward is not None:
            self.train_curve.append((step, mean_reward))
        for name, row in (policies or {}).items():
            if row.get("reward") is not None and row.get("calls"):
                self.policy_curves.setdefault(name, []).append((step, float(row["reward"])))

    def record_eval(self, result: EvalResult, label: str) -> None:
        self.val_curve.append((result.step, result.mean, result.se))
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps({"kind": "val", "time": time.time(), **dataclasses.asdict(result)}) + "\n")
        self.trackers.add(result.step, {"val/mean_reward": result.mean, "val/se": result.se})
        self.display.line(f"validation ({label}, step {result.step}): {result.describe()}")

    def redraw(self) -> None:
        if self.config.logging.plot:
            self.plot = plot_reward_curve(
                self.plot_path,
                self.train_curve,
                self.val_curve,
                title=f"{self.title} ({self.config.algorithm.name})",
                policies=self.policy_curves,
            )

    def replay(self, step: int) -> None:
        """Keep the metrics up to the checkpoint's ``step`` (later lines belong to steps that will run
        again) and rebuild the curves from them."""
        if not self.metrics_path.is_file():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the kill
            if row.get("step", 0) > step:
                continue
            kept.append(line)
            if row.get("kind") == "val":
                self.val_curve.append((row["step"], row["mean"], row["se"]))
            else:
                self._add_point(row["step"], row.get("mean_reward"), row.get("policies"))
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        tmp.replace(self.metrics_path)


def _mean_staleness(histogram: dict[str, int]) -> float | None:
    total = sum(histogram.values())
    return sum(int(k) * n for k, n in histogram.items()) / total if total else None


def _number(value: Any) -> float | None:
    """A metric as a tracker takes it: a float, or ``None`` for anything that is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def prepare_output(out: Path, *, resume: bool, overwrite: bool, store_file: str | None) -> Path | None:
    """Check ``out`` against the flags; returns the checkpoint to resume from."""
    if resume and overwrite:
        raise ValueError("--resume and --overwrite contradict each other; pass one of them")
    checkpoint = latest_checkpoint(out / CHECKPOINTS_DIR)
    has_run = (out / METRICS_FILE).is_file() or checkpoint is not None
    if resume:
        if checkpoint is None:
            raise CheckpointError(
                f"nothing to resume in {out}: it holds no checkpoint"
                + (" (the run stopped before its first one)" if has_run else "")
                + "; start the run without --resume (add --overwrite to replace what is there)"
            )
        return checkpoint
    if has_run and not overwrite:
        raise RunExistsError(
            f"{out} already holds a training run; pass --resume to continue it, --overwrite to start over "
            "(deleting its checkpoints, metrics and store), or choose another output_dir"
            " (--set output_dir=...)"
        )
    if overwrite:
        for name in (METRICS_FILE, PLOT_FILE, INFLIGHT_FILE, RUN_FILE):
            (out / name).unlink(missing_ok=True)
        for name in (CHECKPOINTS_DIR, "tensorboard"):
            shutil.rmtree(out / name, ignore_errors=True)
        if store_file:
            for suffix in ("", "-wal", "-shm"):
                (out / f"{store_file}{suffix}").unlink(missing_ok=True)
    return None


def held_out_score(
    config: TrainerConfig, queue: RolloutQueue, step: int, tasks: Sequence[Task]
) -> EvalResult:
    """The validation score at ``step`` on the first ``validation.max_tasks`` of ``tasks``."""
    v = config.validation
    chosen = list(tasks[: v.max_tasks] if v.max_tasks else tasks)
    return score_tasks(
        queue,
        chosen,
        step=step,
        rollouts_per_task=v.rollouts_per_task,
        max_attempts=config.runner.max_attempts,
    ).result


class RunContext:
    """One training job's output folder, seed, display, run file, run log and held-out passes (module
    docstring). Use as a context manager; inside it, ``stack`` holds what the job starts (store,
    services, runners), closed before the display.

    ``title`` names the run (the agent, or where its traces come from); ``own_store``: the store file in
    ``output_dir`` that ``overwrite`` deletes (``None``: keep any, e.g. the traces being trained on)."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        title: str,
        steps: int,
        echo: Callable[[str], None] = print,
        resume: bool = False,
        overwrite: bool = False,
        own_store: str | None = None,
    ) -> None:
        self.config = config
        self.title = title
        self.steps = steps
        self.out = config.output_dir
        self._echo = echo
        self._flags = (resume, overwrite, own_store)
        #: The checkpoint to resume from (``resume``), set on entering.
        self.checkpoint: Path | None = None
        self.stack = ExitStack()

    def __enter__(self) -> RunContext:
        import warnings

        import torch

        config, (resume, overwrite, own_store) = self.config, self._flags
        self.out.mkdir(parents=True, exist_ok=True)
        self.checkpoint = prepare_output(self.out, resume=resume, overwrite=overwrite, store_file=own_store)
        size_torch_threads(config.train.threads)
        limit_arenas()  # before the store, gateway and runner threads start
        # peft asks transformers a deprecated question on every wrap; not actionable for a user.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(config.train.seed)
        # entered stack first, display second: the display closes first, then what the job started
        with ExitStack() as outer:
            outer.enter_context(self.stack)
            self.display = outer.enter_context(Display(config.logging.progress, self.steps, echo=self._echo))
            self.run_file = RunFile(
                self.out,
                title=self.title,
                config=masked_config(config.model_dump(mode="json")),
                steps=self.steps,
                resumed=self.checkpoint is not None,
            )
            self.stack.push(self.run_file)
            self.log = RunLog(config, self.display, self.stack, title=self.title)
            self._open = outer.pop_all()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._open.__exit__(exc_type, exc, tb)

    def phase(self, what: str) -> None:
        """What the job is doing now, for ``run.json`` (the dashboard)."""
        self.run_file.phase(what)

    def held_out_pass(self, queue: RolloutQueue, step: int, label: str, tasks: Sequence[Task]) -> EvalResult:
        """Score the held-out ``tasks`` at ``step`` (``label``: before, during or after training), saying
        so first; the caller records it (:meth:`RunLog.record_eval`) where its metrics belong."""
        v = self.config.validation
        count = min(len(tasks), v.max_tasks or len(tasks))
        self.phase(f"held-out pass {label}")
        self.display.line(
            f"validation ({label}): scoring {count} held-out task(s) x {v.rollouts_per_task} rollout(s)..."
        )
        return held_out_score(self.config, queue, step, tasks)

    def closing_lines(
        self, before: EvalResult | None, after: EvalResult | None, checkpoint: Path | None
    ) -> None:
        """The held-out change, the last checkpoint, the reward curve and the TensorBoard command."""
        if before is not None and after is not None:
            self.display.line(held_out_line(before, after))
        if checkpoint is not None:
            self.display.line(f"checkpoint: {checkpoint}")
        if self.log.plot is not None:
            self.display.line(f"reward curve: {self.log.plot}")
        if "tensorboard" in self.log.trackers:
            self.display.line(f"tensorboard: tensorboard --logdir {self.out / 'tensorboard'}")

    def result(
        self, before: EvalResult | None, after: EvalResult | None, checkpoint: Path | None
    ) -> RunResult:
        return RunResult(self.log.history, before, after, self.log.plot, checkpoint)
