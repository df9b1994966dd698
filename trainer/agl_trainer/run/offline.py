"""Training from stored traces (the ``traces`` section): no rollouts are run, the data are rollouts
already in a store, selected by ``traces.filter``.

``algorithm.name: sft`` fine-tunes on the response tokens of the selected rollouts' LLM calls (exact
gateway token ids where recorded, else the recorded messages re-tokenised with the policy's chat
template). ``grpo`` / ``ppo`` / ``reinforce_pp`` train off-policy with PPO-clip against the behaviour
logprobs the gateway recorded, with group advantages per task id; rollouts without token ids or logprobs
are refused with the reason.

Steps: ``train.steps`` optimizer steps (or ``traces.epochs`` passes), each on ``traces.batch_size``
examples (LLM calls for ``sft``, task groups for RL), in shuffled order reshuffled at each pass. The
run leaves what a normal run leaves: ``metrics.jsonl``, the progress lines, checkpoints ``agl eval
--checkpoint`` scores, and, when an agent and validation tasks are given, the before/after held-out
score.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl_core.pipeline.sft import SftResult
from agl_core.records import Task, Transition
from agl_core.settings import masked_url

from ..config import TracesConfig, TrainerConfig
from ..learning.checkpoint import load_checkpoint, save_checkpoint
from ..reporting.display import format_step
from ..reporting.results import EvalResult, StepMetrics
from .loop import job_agent, job_tasks
from .run_context import CHECKPOINTS_DIR, INFLIGHT_FILE, RunContext, RunResult
from .services import AgentFn, Services
from .step import agent_counts
from .traces import (
    NothingSelectedError,
    RlData,
    Selection,
    minibatches,
    prepare_rl,
    prepare_sft,
    read_store,
    reason_counts,
    select,
    steps_for,
)

if TYPE_CHECKING:
    from ..learning.update import UpdateStats
    from .rollouts import RolloutQueue

__all__ = ["train_from_traces"]


def _counted(reasons: dict[str, int]) -> str:
    return "; ".join(f"{n} x {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1]))


@dataclasses.dataclass
class _TraceData:
    """What the selected traces give ``algorithm.name`` to train on, found before any model loads."""

    selection: Selection
    #: ``sft``: the fine-tuning examples; otherwise ``None``.
    sft: SftResult | None
    #: RL: advantaged transitions by task group; ``None`` for ``sft``.
    rl: RlData | None
    #: LLM calls not used -> why; rollouts refused -> why (RL).
    problems: dict[str, int]
    refused_rollouts: dict[str, int]
    #: What one pass counts: LLM calls (``sft``) or task groups (RL).
    units: int


def _trace_data(config: TrainerConfig, traces: TracesConfig, selection: Selection | None) -> _TraceData:
    """Select the stored rollouts (unless ``selection`` is given) and prepare them for
    ``algorithm.name``; a selection that gives nothing to train on raises :class:`NothingSelectedError`
    saying what matched and why it was refused."""
    if selection is None:
        spans, records = read_store(traces.store)
        timed_out = config.algorithm.rewards.timeout_episode_reward is not None
        selection = select(traces, spans, records, timed_out_too=timed_out)
    if not selection.rollouts:
        raise NothingSelectedError(
            f"{selection.describe()} (in {masked_url(traces.store)}); nothing to train on"
        )
    if config.algorithm.name == "sft":
        sft = prepare_sft(config, selection)
        problems = sft.reasons()
        if not sft.examples:
            raise NothingSelectedError(
                f"{selection.describe()}; none of their LLM calls can be fine-tuned on: {_counted(problems)}"
            )
        return _TraceData(selection, sft, None, problems, {}, len(sft.examples))
    rl = prepare_rl(config, selection)
    problems = reason_counts([p for p in rl.result.problems if p.span_id is not None])
    refused = dict(Counter(rl.refused.values()))
    if not rl.samples:
        skipped = rl.report.skipped_singleton + rl.report.skipped_no_variance
        raise NothingSelectedError(
            f"{selection.describe()}; none can train {config.algorithm.name} off-policy:"
            f" {_counted(refused) or 'no rollout refused'}"
            + (
                f"; {skipped} of {rl.report.groups} task groups skipped (a single rollout or tied"
                " rewards: no baseline to compare with"
                + (
                    "; where no task repeats, as in production sessions, set traces.baseline: agent)"
                    if traces.baseline == "task"
                    else ")"
                )
                if skipped
                else ""
            )
        )
    units = len({_rl_unit(traces, rl, s) for s in rl.samples})
    return _TraceData(selection, None, rl, problems, refused, units)


def _rl_unit(traces: TracesConfig, rl: RlData, sample: Any) -> str:
    """What one batch slot holds in RL: a task group (``baseline: task``), or one rollout (``agent``:
    the group is the whole selection, so batches are made of rollouts)."""
    rollout = sample.transition.rollout_id
    return rl.group_of[rollout] if traces.baseline == "task" else rollout


def train_from_traces(
    config: TrainerConfig,
    *,
    echo: Callable[[str], None] = print,
    resume: bool = False,
    overwrite: bool = False,
    agent: AgentFn | None = None,
    tasks: tuple[list[Task], list[Task]] | None = None,
    selection: Selection | None = None,
) -> RunResult:
    """Train on the stored rollouts ``config.traces`` selects (see the module docstring), or on
    ``selection`` when the caller already holds it (``agl improve``'s watcher: the store is not read
    again).

    Raises :class:`~agl_trainer.run.traces.NothingSelectedError` (a ``ValueError``) before any model loads
    when the filter matches nothing, or nothing it matched can be trained on by ``algorithm.name``; the
    message says what matched how many and why the rest was refused.
    """
    traces = config.traces
    if traces is None:
        raise ValueError("train_from_traces needs a config with a traces: section")
    data = _trace_data(config, traces, selection)
    val_tasks: list[Task] = []
    agent_fn: AgentFn | None = None
    if (agent is not None or config.agent is not None) and (tasks is not None or config.tasks is not None):
        agent_fn = job_agent(config, agent)
        _, val_tasks = job_tasks(config.tasks, tasks)
    validating = bool(val_tasks) and (config.validation.before or config.validation.after)
    own_store = None if config.store.url else config.store.path
    if own_store is not None and Path(traces.store).resolve() == (config.output_dir / own_store).resolve():
        own_store = None  # never delete the traces being trained on
    steps = steps_for(config, data.units)
    context = RunContext(
        config,
        title=f"traces from {Path(traces.store).name}",
        steps=steps,
        echo=echo,
        resume=resume,
        overwrite=overwrite,
        own_store=own_store,
    )
    with context:
        job = _TracesJob(context, traces, data)
        queue = job.start_validation(agent_fn) if validating and agent_fn is not None else None
        before = job.resume_or_score(queue, val_tasks)
        last_saved = context.checkpoint
        for step in range(job.start_step, steps + 1):
            last_saved = job.step(step, before) or last_saved
        after = None
        if queue is not None and config.validation.after:
            after = context.held_out_pass(queue, steps, "after training", val_tasks)
            context.log.record_eval(after, "after training")
            context.log.redraw()
        context.closing_lines(before, after, last_saved)
        context.display.line(f"done: metrics in {context.log.metrics_path}")
        return context.result(before, after, last_saved)


class _TracesJob:
    """The steps of training from traces inside a :class:`RunContext`: the policy loaded, the data made
    into one batch per step, and, for validation, the services that serve the policy to the agent."""

    def __init__(self, context: RunContext, traces: TracesConfig, data: _TraceData) -> None:
        from ..learning.policy import load_trainable_policy
        from ..learning.update import UpdateSettings

        self.context, self.config, self.traces, self.data = context, context.config, traces, data
        self.steps = context.steps
        display = context.display
        display.line(data.selection.describe())
        self.policy = load_trainable_policy(self.config, context.stack, echo=display.line)
        model, optimizer = self.policy.model, self.policy.optimizer
        assert model is not None and optimizer is not None  # traces: trains with the torch update
        self.model, self.optimizer = model, optimizer
        device = next(model.parameters()).device
        self.settings = UpdateSettings.of(self.config.algorithm, self.config.update, device)
        #: (rollout id, call index) -> whether the call's token ids are the gateway's (``sft``).
        self.exact_of: dict[tuple[str, int], bool] = {}
        self.batches = self._sft_batches() if data.sft is not None else self._rl_batches()
        self.rewards = {r.rollout_id: r.reward for r in data.selection.rollouts}
        self.services: Services | None = None
        self.start_step = 1

    def _sft_batches(self) -> list[list[Any]]:
        from ..learning.finetune import example_transition

        data, tokenizer = self.data, self.policy.tokenizer
        assert data.sft is not None
        vocab = int(self.model.get_input_embeddings().num_embeddings)
        usable: list[Transition] = []
        for example in data.sft.examples:
            made = example_transition(tokenizer, vocab, example)
            if isinstance(made, str):
                data.problems[made] = data.problems.get(made, 0) + 1
                continue
            usable.append(made)
            self.exact_of[(made.rollout_id, made.call_index)] = example.exact
        if not usable:
            raise NothingSelectedError(
                f"{data.selection.describe()}; none of their LLM calls can be fine-tuned on:"
                f" {_counted(data.problems)}"
            )
        n_exact = sum(self.exact_of.values())
        self.context.display.line(
            f"sft data: {len(usable)} LLM calls ({n_exact} exact token ids, {len(usable) - n_exact}"
            " re-tokenised from recorded messages)"
            + (f"; not used: {_counted(data.problems)}" if data.problems else "")
        )
        key: Callable[[Transition], Any] = lambda t: (t.rollout_id, t.call_index)  # noqa: E731
        return minibatches(usable, key, self.traces.batch_size, self.steps, self.config.train.seed)

    def _rl_batches(self) -> list[list[Any]]:
        data, rl = self.data, self.data.rl
        assert rl is not None
        self.context.display.line(
            f"off-policy {self.config.algorithm.name} data: {len(rl.samples)} LLM calls in {data.units}"
            + (" task groups" if self.traces.baseline == "task" else " rollouts (baseline: the agents' mean)")
            + (f"; rollouts refused: {_counted(data.refused_rollouts)}" if data.refused_rollouts else "")
            + (f"; calls not used: {_counted(data.problems)}" if data.problems else "")
        )
        return minibatches(
            list(rl.samples),
            lambda s: _rl_unit(self.traces, rl, s),
            self.traces.batch_size,
            self.steps,
            self.config.train.seed,
        )

    def start_validation(self, agent_fn: AgentFn) -> RolloutQueue:
        """The store, the gateway serving the policy and the runners, for held-out passes."""
        from .rollouts import RolloutQueue
        from .services import start_runners, start_services, start_store

        config, context, display = self.config, self.context, self.context.display
        store = start_store(
            config.store, context.stack, file=context.out / config.store.path, echo=display.line
        )
        self.services = start_services(
            config, context.stack, store, model=self.model, tokenizer=self.policy.tokenizer, echo=display.line
        )
        queue = RolloutQueue(
            self.services.client,
            display,
            step_timeout_s=config.runner.step_timeout_s,
            flush=self.services.flush,
            inflight=context.out / INFLIGHT_FILE,
        )
        start_runners(config, self.services, agent_fn, context.stack, echo=display.line)
        return queue

    def resume_or_score(self, queue: RolloutQueue | None, val_tasks: Sequence[Task]) -> EvalResult | None:
        """Resume from the context's checkpoint (the held-out score it kept), or score the held-out tasks
        before training when validating; the score before training."""
        context, checkpoint = self.context, self.context.checkpoint
        if checkpoint is not None:
            state = load_checkpoint(checkpoint, model=self.model, optimizer=self.optimizer)
            self.start_step = int(state["step"]) + 1
            context.log.replay(self.start_step - 1)
            context.display.line(f"resumed from {checkpoint} at step {self.start_step}")
            return EvalResult(**state["before"]) if state.get("before") else None
        if queue is not None and self.config.validation.before:
            before = context.held_out_pass(queue, 0, "before training", val_tasks)
            context.log.record_eval(before, "before training")
            return before
        return None

    def step(self, step: int, before: EvalResult | None) -> Path | None:
        """One optimizer step on the step's batch, recorded; the checkpoint it wrote, if it wrote one."""
        context, config, data, settings = self.context, self.config, self.data, self.settings
        context.display.start_step(step, step - 1)
        context.phase(f"step {step} of {self.steps}")
        t0 = time.monotonic()
        batch = self.batches[step - 1]
        transitions: Sequence[Transition]
        with _serving(self.services, self.model, step):
            if data.sft is not None:
                from ..learning.finetune import sft_update_step

                transitions = batch
                stats = sft_update_step(
                    self.model, self.optimizer, batch, pad_id=self.policy.pad_id, **settings.sft()
                )
                exact = sum(self.exact_of[(t.rollout_id, t.call_index)] for t in batch)
            else:
                from ..learning.update import update_step

                transitions = [s.transition for s in batch]
                stats = update_step(
                    self.model,
                    self.optimizer,
                    batch,
                    pad_id=self.policy.pad_id,
                    reference=self.policy.reference,
                    **settings.ppo(),
                )
                exact = len(transitions)
        metrics = self._metrics(step, transitions, stats, exact, time.monotonic() - t0)
        context.display.line(
            format_step(metrics, self.steps) + f"  exact={exact} re-tokenised={len(transitions) - exact}"
        )
        context.log.record_step(metrics)
        saved = None
        every = config.checkpoint.every_steps
        if step == self.steps or (every and step % every == 0):
            saved = save_checkpoint(
                context.out / CHECKPOINTS_DIR,
                step,
                model=self.model,
                optimizer=self.optimizer,
                state={
                    "policy_version": step,
                    "before": None if before is None else before.__dict__,
                    "config": config.model_dump(mode="json"),
                    "traces": {
                        "store": masked_url(self.traces.store),
                        "rollouts": len(data.selection.rollouts),
                    },
                },
                keep=config.checkpoint.keep,
            )
        context.log.redraw()
        context.display.end_step(
            step, reward=metrics.mean_reward, loss=metrics.loss, tokens_per_s=metrics.tokens_per_s
        )
        return saved

    def _metrics(
        self, step: int, transitions: Sequence[Transition], stats: UpdateStats, exact: int, seconds: float
    ) -> StepMetrics:
        data, rl = self.data, self.data.rl
        rollout_ids = list(dict.fromkeys(t.rollout_id for t in transitions))
        batch_rewards = [r for r in (self.rewards.get(rid) for rid in rollout_ids) if r is not None]
        return StepMetrics(
            step=step,
            policy_version=step,
            rollouts=len(rollout_ids),
            rollouts_failed=0,
            rollouts_late=0,
            transitions=len(transitions),
            trained_transitions=len(transitions),
            mean_reward=sum(batch_rewards) / len(batch_rewards) if batch_rewards else None,
            loss=stats.loss,
            grad_norm=stats.grad_norm,
            tokens=stats.tokens,
            tokens_per_s=stats.tokens / seconds if seconds > 0 else 0.0,
            groups_skipped=0 if rl is None else rl.report.skipped_no_variance + rl.report.skipped_singleton,
            problems=dict(data.problems),
            untrained=dict(data.refused_rollouts),
            reward_events={} if rl is None else rl.credit.counts(),
            agents=agent_counts(transitions, transitions),
            tasks=list(dict.fromkeys(t.task_id or t.rollout_id for t in transitions)),
            redrawn_tasks=0,
            seconds=seconds,
            rollout_ids=rollout_ids,
            exact_transitions=exact,
            retokenised_transitions=len(transitions) - exact,
        )


@contextlib.contextmanager
def _serving(services: Services | None, model: Any, version: int) -> Iterator[None]:
    """Around an update: when a gateway serves the policy (validation), hold its lock, then serve the new
    weights as ``version``."""
    if services is None:
        yield
        return
    with services.serving.lock:
        yield
        services.serving.publish(model, version)
    services.publish()
