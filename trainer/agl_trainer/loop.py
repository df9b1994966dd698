"""The training loop: rollouts through the store and the gateway, transitions, LightningRL updates.

:func:`train` runs a whole job: it starts (or connects to) the store, serves the policy through the
gateway, starts the runner's workers (:mod:`agl_trainer.services`) and then, step by step, samples tasks
and runs a training step (:mod:`agl_trainer.step`: rollouts, transitions, credit, group advantages, the
update, publishing the new policy). It evaluates on the validation split before, during and after
training, saves checkpoints it can resume from after a crash, and keeps ``metrics.jsonl``, a reward-curve
PNG and (when installed) TensorBoard scalars in ``output_dir``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from agl_core.records import Task
from agl_core.runner import load_agent, resolve_mode

from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainerConfig
from .cpu import size_torch_threads
from .data import TaskSampler, load_splits
from .memory import limit_arenas, release_free_memory
from .pipeline import AsyncTrainStep
from .policy import TrainablePolicy, load_trainable_policy, make_learner
from .reporting import Display, held_out_line, plot_reward_curve, step_lines
from .results import UNNAMED_AGENT, EvalResult, StepMetrics
from .rollouts import PatientClient, RolloutQueue, score_tasks
from .runfile import RUN_FILE, RunFile
from .services import (
    AgentFn,
    Services,
    remote_agent,
    start_run_dashboard,
    start_runners,
    start_services,
    start_store,
)
from .step import TIED_GROUPS, TrainStep
from .trackers import Trackers, masked_config, open_trackers

__all__ = [
    "UNNAMED_AGENT",
    "EvalResult",
    "RunExistsError",
    "RunResult",
    "StepMetrics",
    "agent_name",
    "job_agent",
    "job_tasks",
    "train",
]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "reward_curve.png"
INFLIGHT_FILE = "inflight.json"
CHECKPOINTS_DIR = "checkpoints"


def agent_name(agent: AgentFn) -> str:
    """``module:qualified.name`` of an agent function, for titles and messages."""
    qualname = getattr(agent, "__qualname__", type(agent).__qualname__)
    return f"{getattr(agent, '__module__', None) or '?'}:{qualname}"


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


class _RunLog:
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


def _save(
    config: TrainerConfig,
    policy: TrainablePolicy,
    services: Services,
    step: int,
    sampler: TaskSampler,
    before: EvalResult | None,
) -> Path | None:
    if not policy.trains_in_process:
        return None  # the verl update keeps the weights in its workers (verl's own checkpoints)
    state = {
        "policy_version": services.serving.policy_version,
        "sampler": sampler.state_dict(),
        "before": dataclasses.asdict(before) if before else None,
        "config": config.model_dump(mode="json"),
    }
    if policy.updates:
        state["policy_updates"] = dict(policy.updates)
    return save_checkpoint(
        config.output_dir / CHECKPOINTS_DIR,
        step,
        model=policy.model,
        optimizer=policy.checkpointed_optimizers,
        state=state,
        keep=config.checkpoint.keep,
    )


def _restore(
    path: Path,
    config: TrainerConfig,
    policy: TrainablePolicy,
    services: Services,
    sampler: TaskSampler,
    log: _RunLog,
) -> tuple[int, EvalResult | None]:
    """Load the checkpoint at ``path`` into the policy and the sampler, serve its weights under their
    version and replay the metrics up to it; returns its step and its before-training score."""
    if not policy.trains_in_process:
        raise CheckpointError("--resume needs the torch update (update.backend: torch)")
    state = load_checkpoint(
        path,
        model=policy.model,
        optimizer=policy.checkpointed_optimizers,
    )
    step = int(state["step"])
    sampler.load_state_dict(state["sampler"])
    for name, count in (state.get("policy_updates") or {}).items():
        if name in policy.updates:
            policy.updates[name] = int(count)
    version = int(state["policy_version"])
    if version > services.serving.policy_version:
        services.serving.publish(policy.model, version)  # serve the restored weights under their version
    before = EvalResult(**state["before"]) if state.get("before") else None
    changed = _config_changes(state.get("config") or {}, masked_config(config.model_dump(mode="json")))
    if changed:
        log.display.line("note: config differs from the checkpoint's in: " + ", ".join(changed))
    log.replay(step)
    return step, before


def idle_policies(config: TrainerConfig, history: Sequence[StepMetrics]) -> list[str]:
    """A sentence for each policy of ``config`` that served no call in the run's steps (``history``): its
    agents' patterns match no agent that called the gateway, which is most often a typo."""
    if not config.policies or not history:
        return []
    called = {name for m in history for name, row in (m.policies or {}).items() if row.get("calls")}
    return [
        f"policy {p.name!r} served no call in {len(history)} step(s): no calling agent matched its agents"
        f" {list(p.agents)}; check the patterns against the agent names 'agl inspect ROLLOUT_ID' shows"
        for p in config.policies
        if p.name not in called
    ]


def _config_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(_config_changes(a, b, f"{prefix}{key}."))
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


def _prepare_output(out: Path, *, resume: bool, overwrite: bool, store_file: str | None) -> Path | None:
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


def _validate(config: TrainerConfig, queue: RolloutQueue, step: int, tasks: Sequence[Task]) -> EvalResult:
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


def _step_phase(run_file: RunFile, step: str, what: str) -> None:
    run_file.phase(f"{step}: {what}")


def _number(value: Any) -> float | None:
    """A metric as a tracker takes it: a float, or ``None`` for anything that is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class NothingTrainedError(RuntimeError):
    """A run ended without one step that trained (every rollout failed, or none gave training data)."""


def job_agent(config: TrainerConfig, agent: AgentFn | None) -> AgentFn:
    """The agent a job runs: ``agent`` when given, else the config's ``module:function`` imported. Raises
    ``ValueError`` when there is neither, the import fails, or the runner's mode cannot run it (process
    mode and a function a worker process cannot import, say), before anything starts."""
    if agent is None:
        if config.agent is None:
            raise ValueError(
                "no agent: set 'agent: module:function' in the config, or pass the agent function"
            )
        agent = load_agent(config.agent, search_paths=(config.base_dir,))
    resolve_mode(agent, config.runner.mode)
    if not config.runner.workers:
        remote_agent(config)  # runners started elsewhere need the agent's name
    return agent


def job_tasks(
    config: TrainerConfig, tasks: tuple[list[Task], list[Task]] | None
) -> tuple[list[Task], list[Task]]:
    """The training and validation tasks of a job: ``tasks`` when given, else the config's task files."""
    if tasks is not None:
        return tasks
    if config.tasks is None:
        raise ValueError("no tasks: set 'tasks' in the config (a task file), or pass the tasks")
    return load_splits(config.tasks)


def train(
    config: TrainerConfig,
    *,
    echo: Callable[[str], None] = print,
    resume: bool = False,
    overwrite: bool = False,
    agent: AgentFn | None = None,
    tasks: tuple[list[Task], list[Task]] | None = None,
) -> RunResult:
    """Run the training job ``config`` describes; see the module docstring.

    ``resume`` continues the run in ``output_dir`` from its newest checkpoint (no step repeated or
    skipped); ``overwrite`` replaces a run that is there. Without either, an existing run is an error.
    ``agent`` (a function, run by the runner in this process) and ``tasks`` (training and validation
    tasks) replace the config's ``agent`` and ``tasks``. A bad agent, mode or task file is reported before
    anything starts; everything started is stopped on return, also on error. A config with a ``traces``
    section trains on stored rollouts instead: :func:`agl_trainer.offline.train_from_traces`.
    """
    if config.traces is not None:
        raise ValueError("a config with traces: trains with agl_trainer.offline.train_from_traces")
    agent_fn = job_agent(config, agent)
    train_tasks, val_tasks = job_tasks(config, tasks)
    if resume and config.update.backend == "verl":
        raise ValueError(
            "--resume is not supported with update.backend verl (its weights live in verl's workers)"
        )
    import warnings

    import torch

    out = config.output_dir
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = _prepare_output(
        out, resume=resume, overwrite=overwrite, store_file=None if config.store.url else config.store.path
    )
    size_torch_threads(config.train.threads)
    limit_arenas()  # before the store, gateway and runner threads start
    # peft asks transformers a deprecated question on every wrap; not actionable for a user.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    torch.manual_seed(config.train.seed)
    sampler = TaskSampler(train_tasks, seed=config.train.seed)
    steps = config.train.steps
    validating = bool(val_tasks) and (
        config.validation.before or config.validation.after or config.validation.every_steps
    )

    title = config.agent or agent_name(agent_fn)
    with ExitStack() as stack, Display(config.logging.progress, steps, echo=echo) as display:
        run_file = RunFile(
            out,
            title=title,
            config=masked_config(config.model_dump(mode="json")),
            steps=steps,
            resumed=checkpoint is not None,
        )
        stack.push(run_file)

        def held_out_pass(step: int, label: str) -> EvalResult:
            count = min(len(val_tasks), config.validation.max_tasks or len(val_tasks))
            run_file.phase(f"held-out pass {label}")
            display.line(
                f"validation ({label}): scoring {count} held-out task(s)"
                f" x {config.validation.rollouts_per_task} rollout(s)..."
            )
            return _validate(config, queue, step, val_tasks)

        log = _RunLog(config, display, stack, title=title)
        display.line(
            f"tasks: {len(train_tasks)} train, {len(val_tasks)} validation"
            + (
                ""
                if val_tasks
                else " (no validation split: set tasks.val or tasks.val_fraction to measure held-out reward)"
            )
        )
        store = start_store(config, stack, file=out / config.store.path, echo=display.line)
        if config.logging.dashboard:
            display.line(f"dashboard: {start_run_dashboard(config, stack, store)}")
        policy = load_trainable_policy(config, stack, echo=display.line)
        services = start_services(
            config, stack, store, model=policy.model, tokenizer=policy.tokenizer, echo=display.line
        )
        queue = RolloutQueue(
            PatientClient(services.client, warn=display.line),
            display,
            step_timeout_s=config.runner.step_timeout_s,
            flush=services.flush,
            inflight=out / INFLIGHT_FILE,
            run=out.name,
        )
        learner = make_learner(config, policy, services)
        trainer: TrainStep | AsyncTrainStep
        if config.train.mode == "async":
            trainer = AsyncTrainStep(config, queue, learner)
            stack.callback(trainer.close)
        else:
            trainer = TrainStep(config, queue, learner)
        start_step = 1
        before: EvalResult | None = None
        if checkpoint is not None:
            done_step, before = _restore(checkpoint, config, policy, services, sampler, log)
            start_step = done_step + 1
            display.line(
                f"resumed from {checkpoint} at step {start_step} (policy v{services.serving.policy_version})"
            )
            queue.cancel_inflight()  # before any worker can pick up the killed step's rollouts
        start_runners(config, services, agent_fn, stack, echo=display.line)
        if checkpoint is None and validating and config.validation.before:
            before = held_out_pass(0, "before training")
            log.record_eval(before, "before training")
        last_saved: Path | None = checkpoint
        trained_any = checkpoint is not None  # a resumed run trained before
        warnings_seen: list[str] = []
        for step in range(start_step, steps + 1):
            display.start_step(step, step - 1)
            run_file.phase(f"step {step} of {steps}")
            trainer.on_phase = functools.partial(_step_phase, run_file, f"step {step} of {steps}")
            outcome = trainer.run(step, sampler.sample(config.train.tasks_per_step), draw=sampler.sample)
            release_free_memory()  # the update's activations, before the next rollouts allocate caches
            metrics = outcome.metrics
            where = "" if config.store.url else f" --store {out / config.store.path}"
            for line in step_lines(
                outcome, steps, show_agents=bool(config.algorithm.agents), inspect_hint=where
            ):
                display.line(line)
            if metrics.warning is not None:
                display.line(f"  warning: step {step} trained nothing: {metrics.warning}")
                warnings_seen.append(metrics.warning)
            else:
                trained_any = True
            every = config.validation.every_steps
            during = None
            if validating and every and step % every == 0 and step != steps:
                t0 = time.monotonic()
                during = held_out_pass(step, "during training")
                metrics.phases["validation"] = round(time.monotonic() - t0, 3)
            log.record_step(metrics)
            if during is not None:
                log.record_eval(during, "during training")
            every = config.checkpoint.every_steps
            if trained_any and (step == steps or (every and step % every == 0)):
                run_file.phase(f"step {step} of {steps}: writing a checkpoint")
                last_saved = _save(config, policy, services, step, sampler, before) or last_saved
            log.redraw()
            display.end_step(
                step, reward=metrics.mean_reward, loss=metrics.loss, tokens_per_s=metrics.tokens_per_s
            )
        if isinstance(trainer, AsyncTrainStep):
            trainer.close()  # the groups still in flight would train no step
        after = None
        if validating and config.validation.after:
            after = held_out_pass(steps, "after training")
            log.record_eval(after, "after training")
            log.redraw()
        if before is not None and after is not None:
            display.line(held_out_line(before, after))
        if last_saved is not None:
            display.line(f"checkpoint: {last_saved}")
        if log.plot is not None:
            display.line(f"reward curve: {log.plot}")
        if "tensorboard" in log.trackers:
            display.line(f"tensorboard: tensorboard --logdir {out / 'tensorboard'}")
        for line in idle_policies(config, log.history):
            display.line(f"warning: {line}")
        display.line(
            f"done: metrics in {log.metrics_path}"
            + ("" if config.store.url else f", spans in {out / config.store.path}")
        )
        failures = [w for w in warnings_seen if w != TIED_GROUPS]
        if not trained_any and steps >= start_step and not failures:
            # the agent works but every group tied: no signal yet, which is not a failure of the run
            display.line(f"warning: no step trained: {TIED_GROUPS}; no checkpoint was written")
        elif not trained_any and steps >= start_step:
            raise NothingTrainedError(
                f"no step trained: {failures[0]}; no checkpoint was written. Inspect a rollout with"
                f" 'agl inspect ROLLOUT_ID{where}' (ids in {log.metrics_path})"
            )
        return RunResult(log.history, before, after, log.plot, last_saved)
