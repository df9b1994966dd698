"""What a training run shows and leaves behind: the live display, the per-step lines, the held-out
before/after summary, the reward curve; and the report of a dev run (the trackers' scalars:
:mod:`agl_trainer.reporting.trackers`)."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agl_core.policies import BASE

from ..stats import paired_change
from .results import DevResult, EvalResult, StepMetrics, StepOutcome

__all__ = [
    "Display",
    "dev_lines",
    "format_step",
    "held_out_line",
    "plot_reward_curve",
    "step_lines",
]

logger = logging.getLogger(__name__)


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


def plot_reward_curve(
    path: Path,
    train: Sequence[tuple[int, float]],
    val: Sequence[tuple[int, float, float]] = (),
    *,
    title: str = "reward",
    policies: Mapping[str, Sequence[tuple[int, float]]] | None = None,
) -> Path | None:
    """Draw mean training reward by step and validation mean ± SE into ``path`` (written atomically);
    with ``policies`` (a policy per agent), each policy's mean call reward by step as well.

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
            xs, ys = zip(*train, strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2, label="train (mean reward of the step)")
        for name, points in (policies or {}).items():
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, linestyle="--", marker=".", linewidth=1, label=f"train: {name}'s calls")
        if val:
            xs, ys, errs = zip(*val, strict=True)
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
        if train or val or policies:
            ax.legend(loc="best", fontsize=8)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.png")
        fig.savefig(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
    return path


def format_step(m: StepMetrics, total_steps: int) -> str:
    """The one line a training step prints."""
    reward = f"{m.mean_reward:.3f}" if m.mean_reward is not None else "n/a"
    # On-policy, the PPO loss starts near 0 by construction (ratio 1, advantages centred per group); the
    # gradient norm shows the update's size.
    loss = (
        f"{m.loss:+.4f} grad_norm={m.grad_norm:.3f}"
        if m.loss is not None and m.grad_norm is not None
        else "skipped"
    )
    extra = f" failed={m.rollouts_failed}" if m.rollouts_failed else ""
    extra += f" late={m.rollouts_late}" if m.rollouts_late else ""
    skipped = f", {m.groups_skipped} groups skipped" if m.groups_skipped else ""
    return (
        f"step {m.step}/{total_steps}  rollouts={m.rollouts}{extra}  transitions={m.transitions}"
        f" (trained {m.trained_transitions}{skipped})  mean_reward={reward}  loss={loss}  tokens={m.tokens}"
        f" ({m.tokens_per_s:,.0f}/s)  policy=v{m.policy_version}  {m.seconds:.1f}s"
    )


def _policy_text(name: str, row: dict[str, Any]) -> str:
    agents = ", ".join(row["agents"]) or "no calls"
    reward = f", reward {row['reward']:.3f}" if row.get("reward") is not None else ""
    if name == BASE:
        return f"base model served {agents} ({row['calls']} calls{reward}, not trained)"
    text = f"{name} [{agents}] {row['trained']}/{row['calls']} calls trained{reward}"
    if row["loss"] is not None:
        text += f", loss {row['loss']:+.4f}, update {row['updates']}"
    return text


def _pipeline_text(p: dict[str, Any]) -> str:
    staleness = ", ".join(f"{k} behind: {n}" for k, n in p["staleness"].items()) or "no trained calls"
    text = f"async: trained calls by staleness ({staleness}; at most {p['max_staleness']})"
    if p["dropped_groups"]:
        text += f", {p['dropped_groups']} group(s) dropped as too stale"
    return (
        text + f"; {p['in_flight_at_update']} rollouts in flight during the {p['update_s']:.1f}s update,"
        f" {p['finished_during_update']} finished in it; waited {p['wait_s']:.1f}s for finished groups"
    )


def _phases_text(metrics: StepMetrics) -> str:
    """``time: rollouts 41.2s (generating 35.0s: prefill 5.1s, decode 29.9s, 52 tok/s, 91% of prompt
    tokens cached), transitions 0.3s, update 12.1s, ...``."""
    phases = metrics.phases
    parts = []
    for name in ("rollouts", "transitions", "update", "publish"):
        if name not in phases:
            continue
        text = f"{name} {phases[name]:.1f}s"
        if name == "rollouts" and "generation" in phases:
            details = []
            if "prefill" in phases and "decode" in phases:
                details.append(f"prefill {phases['prefill']:.1f}s, decode {phases['decode']:.1f}s")
            if metrics.generation_tokens_per_s:
                details.append(f"{metrics.generation_tokens_per_s:.0f} tok/s")
            if metrics.prefix_reuse is not None:
                details.append(f"{metrics.prefix_reuse:.0%} of prompt tokens cached")
            text += f" (generating {phases['generation']:.1f}s" + (": " if details else "")
            text += ", ".join(details) + ")"
        parts.append(text)
    rss = f"; peak RSS {metrics.peak_rss_mb / 1024:.1f} GB" if metrics.peak_rss_mb else ""
    return "time: " + ", ".join(parts) + rss


def step_lines(
    outcome: StepOutcome, total_steps: int, *, show_agents: bool, inspect_hint: str = ""
) -> list[str]:
    """What a training step prints: :func:`format_step`, then what the batch left out and why.

    ``show_agents`` lists the calls trained per agent even when there is one agent (it is when
    ``algorithm.agents`` selects some); ``inspect_hint`` follows ``agl inspect ROLLOUT_ID`` in the hint for
    rollouts that gave no training data (e.g. `` --store runs/x/store.sqlite``).
    """
    metrics, batch = outcome.metrics, outcome.batch
    report = batch.report
    lines = [format_step(metrics, total_steps)]
    if metrics.redrawn_tasks:
        lines.append(
            f"  redrew {metrics.redrawn_tasks} tasks in {outcome.redraw_rounds} round(s) for groups with"
            f" differing rewards: {batch.signal_groups} of {report.groups} groups train"
        )
    if report.skipped_no_variance:
        lines.append(
            f"  {report.skipped_no_variance}/{report.groups} task groups skipped: tied rewards (every"
            " rollout of the task scored the same, no learning signal)"
        )
    if report.skipped_singleton:
        lines.append(
            f"  {report.skipped_singleton}/{report.groups} task groups skipped: a single finished rollout"
            " (nothing to compare it with; raise train.rollouts_per_task)"
        )
    if metrics.rollout_ids:
        shown = ", ".join(metrics.rollout_ids[:3])
        more = f" and {len(metrics.rollout_ids) - 3} more" if len(metrics.rollout_ids) > 3 else ""
        lines.append(
            f"  rollouts: {shown}{more} (all in metrics.jsonl; agl inspect ROLLOUT_ID{inspect_hint})"
        )
    if len(metrics.agents) > 1 or show_agents:
        lines.append(
            "  agents: "
            + ", ".join(
                f"{name} {c['trained']}/{c['calls']} calls trained" for name, c in metrics.agents.items()
            )
        )
    if metrics.pipeline is not None:
        lines.append("  " + _pipeline_text(metrics.pipeline))
    if metrics.phases:
        lines.append("  " + _phases_text(metrics))
    if metrics.policies is not None:
        served = [_policy_text(n, p) for n, p in metrics.policies.items() if p["calls"] or n != BASE]
        lines.append("  policies: " + "; ".join(served))
    lines.extend(f"  {line}" for line in batch.credit.summary())
    call_problems = Counter(p.reason for p in batch.result.problems if p.span_id is not None)
    lines.extend(
        f"  {count} LLM calls not trained: {reason}" for reason, count in call_problems.most_common()
    )
    untrained = batch.untrained
    if untrained:
        lines.append(
            f"  {len(untrained)} rollouts gave no training data"
            f" (see: agl inspect {next(iter(untrained))}{inspect_hint}):"
        )
        lines.extend(f"    {count} x {reason}" for reason, count in Counter(untrained.values()).most_common())
    return lines


def held_out_line(before: EvalResult, after: EvalResult) -> str:
    """The before/after summary of two scores on the same tasks, with the paired SE of the change."""
    paired = paired_change(before.task_scores, after.task_scores)
    left_out = f"; {paired.left_out} tasks left out (a NaN or infinite score)" if paired.left_out else ""
    return (
        f"held-out reward: before {before.describe()} -> after {after.describe()}; "
        f"change {paired.change:+.3f} ± {paired.se:.3f} (paired SE over {paired.n} tasks){left_out}"
    )


def dev_lines(result: DevResult) -> list[str]:
    """The report of a dev run: a line per rollout (id, task, status, reward, LLM calls, transitions and
    how many would train), each reason it or some of its calls would not train below it, then a summary
    and the ``agl inspect`` command for the first rollout that does not train fully."""
    lines = []
    for r in result.rollouts:
        reward = "-" if r.reward is None else f"{r.reward:.3f}"
        lines.append(
            f"rollout {r.rollout_id} (task {r.task_id}): {r.status.value}  reward={reward}"
            f"  llm_calls={r.llm_calls}  transitions={r.transitions}  trained={r.trained}"
        )
        lines.extend(f"  not trained: {reason}" for reason in r.reasons)
    trained = sum(r.trained for r in result.rollouts)
    lines.append(
        f"{result.trainable} of {len(result.rollouts)} rollouts would train ({trained} transition"
        f"{'' if trained == 1 else 's'}); no update was made"
    )
    shown = next((r for r in result.rollouts if r.reasons), result.rollouts[0] if result.rollouts else None)
    if shown is not None and result.store is not None:
        lines.append(f"span tree and transitions: agl inspect {shown.rollout_id} --store {result.store}")
    elif shown is not None:
        lines.append(
            "the rollouts were in a temporary store; to keep them for agl inspect, pass --store FILE"
            " (store=FILE from Python)"
        )
    return lines
