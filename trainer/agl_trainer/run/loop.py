"""The training loop: rollouts through the store and the gateway, transitions, LightningRL updates.

:func:`train` runs a whole job: it starts (or connects to) the store, serves the policy through the
gateway, starts the runner's workers (:mod:`agl_trainer.run.services`) and then, step by step, samples tasks
and runs a training step (:mod:`agl_trainer.run.step`: rollouts, transitions, credit, group advantages, the
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
from agl_core.settings import masked_config

from ..config import PolicyConfig, TasksConfig, TrainerConfig
from ..learning.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ..learning.policy import TrainablePolicy, load_trainable_policy
from ..memory import release_free_memory
from ..reporting.display import step_lines
from ..reporting.results import UNNAMED_AGENT, EvalResult, StepMetrics
from .data import TaskSampler, load_splits
from .learner import make_learner
from .pipeline import AsyncTrainStep
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


def idle_policies(policies: Sequence[PolicyConfig], history: Sequence[StepMetrics]) -> list[str]:
    """A sentence for each of ``policies`` that served no call in the run's steps (``history``): its
    agents' patterns match no agent that called the gateway, which is most often a typo."""
    if not policies or not history:
        return []
    called = {name for m in history for name, row in (m.policies or {}).items() if row.get("calls")}
    return [
        f"policy {p.name!r} served no call in {len(history)} step(s): no calling agent matched its agents"
        f" {list(p.agents)}; check the patterns against the agent names 'agl inspect ROLLOUT_ID' shows"
        for p in policies
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
        remote_agent(config.agent)  # runners started elsewhere need the agent's name
    return agent


def job_tasks(
    section: TasksConfig | None, tasks: tuple[list[Task], list[Task]] | None
) -> tuple[list[Task], list[Task]]:
    """The training and validation tasks of a job: ``tasks`` when given, else the task files of the
    config's ``tasks`` section."""
    if tasks is not None:
        return tasks
    if section is None:
        raise ValueError("no tasks: set 'tasks' in the config (a task file), or pass the tasks")
    return load_splits(section)


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
    section trains on stored rollouts instead: :func:`agl_trainer.run.offline.train_from_traces`.
    """
    if config.traces is not None:
        raise ValueError("a config with traces: trains with agl_trainer.run.offline.train_from_traces")
    agent_fn = job_agent(config, agent)
    train_tasks, val_tasks = job_tasks(config.tasks, tasks)
    if resume and config.update.backend == "verl":
        raise ValueError(
            "--resume is not supported with update.backend verl (its weights live in verl's workers)"
        )
    steps = config.train.steps
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
        job = _OnlineJob(context, agent_fn, train_tasks, val_tasks)
        before = job.resume_or_score()
        last_saved = context.checkpoint
        for step in range(job.start_step, steps + 1):
            last_saved = job.step(step, before) or last_saved
        job.trainer_close()
        after = None
        if job.validating and config.validation.after:
            after = job.held_out_pass(steps, "after training")
            context.log.record_eval(after, "after training")
            context.log.redraw()
        context.closing_lines(before, after, last_saved)
        job.finish()
        return context.result(before, after, last_saved)


def _filter_note(config: TrainerConfig) -> str:
    """How ``tasks.filter`` chose the training tasks, for the run's ``tasks:`` line ('' without one)."""
    rule = config.tasks.filter if config.tasks is not None else None
    if rule is None:
        return ""
    return f" (tasks.filter: scores in ({rule.above}, {rule.below}) in {rule.scores.name})"


class _OnlineJob:
    """The steps of online training inside a :class:`RunContext`: the store, the policy, the services
    that serve it, the runners running the agent, and each step's rollouts and update."""

    def __init__(
        self, context: RunContext, agent_fn: AgentFn, train_tasks: list[Task], val_tasks: list[Task]
    ) -> None:
        config, display, stack, out = context.config, context.display, context.stack, context.out
        self.context, self.config, self.agent_fn, self.val_tasks = context, config, agent_fn, val_tasks
        self.steps = context.steps
        self.validating = bool(val_tasks) and bool(
            config.validation.before or config.validation.after or config.validation.every_steps
        )
        self.sampler = TaskSampler(train_tasks, seed=config.train.seed)
        display.line(
            f"tasks: {len(train_tasks)} train{_filter_note(config)}, {len(val_tasks)} validation"
            + (
                ""
                if val_tasks
                else " (no validation split: set tasks.val or tasks.val_fraction to measure held-out reward)"
            )
        )
        store = start_store(config.store, stack, file=out / config.store.path, echo=display.line)
        if config.logging.dashboard:
            display.line(f"dashboard: {start_run_dashboard(config, stack, store)}")
        self.policy = load_trainable_policy(config, stack, echo=display.line)
        self.services = start_services(
            config, stack, store, model=self.policy.model, tokenizer=self.policy.tokenizer, echo=display.line
        )
        self.queue = RolloutQueue(
            PatientClient(self.services.client, warn=display.line),
            display,
            step_timeout_s=config.runner.step_timeout_s,
            flush=self.services.flush,
            inflight=out / INFLIGHT_FILE,
            run=out.name,
        )
        learner = make_learner(config, self.policy, self.services)
        self.trainer: TrainStep | AsyncTrainStep
        if config.train.mode == "async":
            self.trainer = AsyncTrainStep(config, self.queue, learner)
            stack.callback(self.trainer.close)
        else:
            self.trainer = TrainStep(config, self.queue, learner)
        self.start_step = 1
        self.trained_any = context.checkpoint is not None  # a resumed run trained before
        self.warnings_seen: list[str] = []
        #: ``agl inspect``'s --store argument for this run's own store ("" with a store server).
        self.where = "" if config.store.url else f" --store {out / config.store.path}"

    def held_out_pass(self, step: int, label: str) -> EvalResult:
        return self.context.held_out_pass(self.queue, step, label, self.val_tasks)

    def resume_or_score(self) -> EvalResult | None:
        """Resume from the context's checkpoint, or start the runners and score the held-out tasks before
        training; the score before training."""
        context, config, checkpoint = self.context, self.config, self.context.checkpoint
        before: EvalResult | None = None
        if checkpoint is not None:
            done_step, before = _restore(
                checkpoint, config, self.policy, self.services, self.sampler, context.log
            )
            self.start_step = done_step + 1
            context.display.line(
                f"resumed from {checkpoint} at step {self.start_step}"
                f" (policy v{self.services.serving.policy_version})"
            )
            self.queue.cancel_inflight()  # before any worker can pick up the killed step's rollouts
        start_runners(config, self.services, self.agent_fn, context.stack, echo=context.display.line)
        if checkpoint is None and self.validating and config.validation.before:
            before = self.held_out_pass(0, "before training")
            context.log.record_eval(before, "before training")
        return before

    def step(self, step: int, before: EvalResult | None) -> Path | None:
        """One training step (rollouts, transitions, the update), recorded, validated when due; the
        checkpoint it wrote, if it wrote one."""
        context, config, display, steps = self.context, self.config, self.context.display, self.steps
        display.start_step(step, step - 1)
        context.phase(f"step {step} of {steps}")
        self.trainer.on_phase = functools.partial(_step_phase, context.run_file, f"step {step} of {steps}")
        outcome = self.trainer.run(
            step, self.sampler.sample(config.train.tasks_per_step), draw=self.sampler.sample
        )
        release_free_memory()  # the update's activations, before the next rollouts allocate caches
        metrics = outcome.metrics
        for line in step_lines(
            outcome, steps, show_agents=bool(config.algorithm.agents), inspect_hint=self.where
        ):
            display.line(line)
        if metrics.warning is not None:
            display.line(f"  warning: step {step} trained nothing: {metrics.warning}")
            self.warnings_seen.append(metrics.warning)
        else:
            self.trained_any = True
        every = config.validation.every_steps
        during = None
        if self.validating and every and step % every == 0 and step != steps:
            t0 = time.monotonic()
            during = self.held_out_pass(step, "during training")
            metrics.phases["validation"] = round(time.monotonic() - t0, 3)
        context.log.record_step(metrics)
        if during is not None:
            context.log.record_eval(during, "during training")
        saved = None
        every = config.checkpoint.every_steps
        if self.trained_any and (step == steps or (every and step % every == 0)):
            context.phase(f"step {step} of {steps}: writing a checkpoint")
            saved = _save(config, self.policy, self.services, step, self.sampler, before)
        context.log.redraw()
        display.end_step(
            step, reward=metrics.mean_reward, loss=metrics.loss, tokens_per_s=metrics.tokens_per_s
        )
        return saved

    def trainer_close(self) -> None:
        if isinstance(self.trainer, AsyncTrainStep):
            self.trainer.close()  # the groups still in flight would train no step

    def finish(self) -> None:
        """The closing warnings and the done line; a run in which no step trained for a reason other than
        tied groups raises :class:`NothingTrainedError`."""
        context, config, display, log = self.context, self.config, self.context.display, self.context.log
        for line in idle_policies(config.policies, log.history):
            display.line(f"warning: {line}")
        display.line(
            f"done: metrics in {log.metrics_path}"
            + ("" if config.store.url else f", spans in {context.out / config.store.path}")
        )
        failures = [w for w in self.warnings_seen if w != TIED_GROUPS]
        if not self.trained_any and self.steps >= self.start_step and not failures:
            # the agent works but every group tied: no signal yet, which is not a failure of the run
            display.line(f"warning: no step trained: {TIED_GROUPS}; no checkpoint was written")
        elif not self.trained_any and self.steps >= self.start_step:
            raise NothingTrainedError(
                f"no step trained: {failures[0]}; no checkpoint was written. Inspect a rollout with"
                f" 'agl inspect ROLLOUT_ID{self.where}' (ids in {log.metrics_path})"
            )
