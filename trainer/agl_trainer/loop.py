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
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agl_core.records import Task
from agl_core.runner import load_agent, resolve_mode

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import TrainerConfig
from .data import TaskSampler, load_splits
from .memory import release_free_memory
from .pipeline import AsyncTrainStep
from .policy import TrainablePolicy, load_trainable_policy, make_learner
from .reporting import step_lines
from .results import UNNAMED_AGENT, EvalResult, StepMetrics
from .rollouts import PatientClient, RolloutQueue
from .run_context import (
    CHECKPOINTS_DIR,
    INFLIGHT_FILE,
    RunContext,
    RunExistsError,
    RunLog,
    RunResult,
)
from .runfile import RunFile
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
from .trackers import masked_config

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


def agent_name(agent: AgentFn) -> str:
    """``module:qualified.name`` of an agent function, for titles and messages."""
    qualname = getattr(agent, "__qualname__", type(agent).__qualname__)
    return f"{getattr(agent, '__module__', None) or '?'}:{qualname}"


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
    log: RunLog,
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


def _step_phase(run_file: RunFile, step: str, what: str) -> None:
    run_file.phase(f"{step}: {what}")


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
    out = config.output_dir
    steps = config.train.steps
    validating = bool(val_tasks) and (
        config.validation.before or config.validation.after or config.validation.every_steps
    )
    context = RunContext(
        config,
        title=config.agent or agent_name(agent_fn),
        steps=steps,
        echo=echo,
        resume=resume,
        overwrite=overwrite,
        own_store=None if config.store.url else config.store.path,
    )
    with context:
        checkpoint, stack, display, run_file, log = (
            context.checkpoint,
            context.stack,
            context.display,
            context.run_file,
            context.log,
        )
        sampler = TaskSampler(train_tasks, seed=config.train.seed)

        def held_out_pass(step: int, label: str) -> EvalResult:
            return context.held_out_pass(queue, step, label, val_tasks)

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
        context.closing_lines(before, after, last_saved)
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
        return context.result(before, after, last_saved)
