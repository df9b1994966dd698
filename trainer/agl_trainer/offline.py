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
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from agl_core.records import Task, Transition

from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainerConfig
from .loop import job_agent, job_tasks
from .reporting import format_step
from .results import EvalResult, StepMetrics
from .run_context import CHECKPOINTS_DIR, INFLIGHT_FILE, RunContext, RunResult
from .services import AgentFn, Services
from .step import agent_counts
from .traces import (
    NothingSelectedError,
    minibatches,
    prepare_rl,
    prepare_sft,
    read_store,
    reason_counts,
    select,
    steps_for,
)

__all__ = ["train_from_traces"]


def _counted(reasons: dict[str, int]) -> str:
    return "; ".join(f"{n} x {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1]))


def train_from_traces(
    config: TrainerConfig,
    *,
    echo: Callable[[str], None] = print,
    resume: bool = False,
    overwrite: bool = False,
    agent: AgentFn | None = None,
    tasks: tuple[list[Task], list[Task]] | None = None,
) -> RunResult:
    """Train on the stored rollouts ``config.traces`` selects (see the module docstring).

    Raises :class:`~agl_trainer.traces.NothingSelectedError` (a ``ValueError``) before any model loads
    when the filter matches nothing, or nothing it matched can be trained on by ``algorithm.name``; the
    message says what matched how many and why the rest was refused.
    """
    traces = config.traces
    if traces is None:
        raise ValueError("train_from_traces needs a config with a traces: section")
    spans, records = read_store(traces.store)
    timed_out = config.algorithm.rewards.timeout_episode_reward is not None
    selection = select(traces, spans, records, timed_out_too=timed_out)
    if not selection.rollouts:
        raise NothingSelectedError(f"{selection.describe()} (in {traces.store}); nothing to train on")
    sft = config.algorithm.name == "sft"
    problems: dict[str, int]
    refused_rollouts: dict[str, int] = {}
    if sft:
        sft_data = prepare_sft(config, selection)
        problems = sft_data.reasons()
        if not sft_data.examples:
            raise NothingSelectedError(
                f"{selection.describe()}; none of their LLM calls can be fine-tuned on: {_counted(problems)}"
            )
        units = len(sft_data.examples)
    else:
        rl = prepare_rl(config, selection)
        problems = reason_counts([p for p in rl.result.problems if p.span_id is not None])
        refused_rollouts = dict(Counter(rl.refused.values()))
        if not rl.samples:
            skipped = rl.report.skipped_singleton + rl.report.skipped_no_variance
            raise NothingSelectedError(
                f"{selection.describe()}; none can train {config.algorithm.name} off-policy:"
                f" {_counted(refused_rollouts) or 'no rollout refused'}"
                + (
                    f"; {skipped} of {rl.report.groups} task groups skipped (a single rollout or tied"
                    " rewards: no baseline to compare with)"
                    if skipped
                    else ""
                )
            )
        units = len({rl.group_of[s.transition.rollout_id] for s in rl.samples})
    validating = False
    val_tasks: list[Task] = []
    agent_fn: AgentFn | None = None
    if (agent is not None or config.agent is not None) and (tasks is not None or config.tasks is not None):
        agent_fn = job_agent(config, agent)
        _, val_tasks = job_tasks(config, tasks)
        validating = bool(val_tasks) and (config.validation.before or config.validation.after)

    out = config.output_dir
    own_store = None if config.store.url else config.store.path
    if own_store is not None and Path(traces.store).resolve() == (out / own_store).resolve():
        own_store = None  # never delete the traces being trained on
    steps = steps_for(config, units)

    from .policy import load_trainable_policy
    from .services import start_runners, start_services, start_store

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
        checkpoint, stack, display, log = context.checkpoint, context.stack, context.display, context.log
        display.line(selection.describe())
        policy = load_trainable_policy(config, stack, echo=display.line)
        model, optimizer = policy.model, policy.optimizer
        assert model is not None and optimizer is not None  # traces: trains with the torch update
        batches: list[list[Any]]
        exact_of: dict[tuple[str, int], bool] = {}
        if sft:
            from .finetune import example_transition

            vocab = int(model.get_input_embeddings().num_embeddings)
            usable: list[Transition] = []
            for example in sft_data.examples:
                made = example_transition(policy.tokenizer, vocab, example)
                if isinstance(made, str):
                    problems[made] = problems.get(made, 0) + 1
                    continue
                usable.append(made)
                exact_of[(made.rollout_id, made.call_index)] = example.exact
            if not usable:
                raise NothingSelectedError(
                    f"{selection.describe()}; none of their LLM calls can be fine-tuned on:"
                    f" {_counted(problems)}"
                )
            n_exact = sum(exact_of.values())
            display.line(
                f"sft data: {len(usable)} LLM calls ({n_exact} exact token ids, {len(usable) - n_exact}"
                " re-tokenised from recorded messages)"
                + (f"; not used: {_counted(problems)}" if problems else "")
            )
            batches = minibatches(
                usable, lambda t: (t.rollout_id, t.call_index), traces.batch_size, steps, config.train.seed
            )
        else:
            display.line(
                f"off-policy {config.algorithm.name} data: {len(rl.samples)} LLM calls in {units} task groups"
                + (f"; rollouts refused: {_counted(refused_rollouts)}" if refused_rollouts else "")
                + (f"; calls not used: {_counted(problems)}" if problems else "")
            )
            batches = minibatches(
                list(rl.samples),
                lambda s: rl.group_of[s.transition.rollout_id],
                traces.batch_size,
                steps,
                config.train.seed,
            )
        rewards = {r.rollout_id: r.reward for r in selection.rollouts}

        services = None
        queue = None
        if validating and agent_fn is not None:
            from .rollouts import RolloutQueue

            store = start_store(config, stack, file=out / config.store.path, echo=display.line)
            services = start_services(
                config, stack, store, model=model, tokenizer=policy.tokenizer, echo=display.line
            )
            queue = RolloutQueue(
                services.client,
                display,
                step_timeout_s=config.runner.step_timeout_s,
                flush=services.flush,
                inflight=out / INFLIGHT_FILE,
            )
            start_runners(config, services, agent_fn, stack, echo=display.line)

        start_step = 1
        before: EvalResult | None = None
        if checkpoint is not None:
            state = load_checkpoint(checkpoint, model=model, optimizer=optimizer)
            start_step = int(state["step"]) + 1
            before = EvalResult(**state["before"]) if state.get("before") else None
            log.replay(start_step - 1)
            display.line(f"resumed from {checkpoint} at step {start_step}")
        elif queue is not None and config.validation.before:
            before = context.held_out_pass(queue, 0, "before training", val_tasks)
            log.record_eval(before, "before training")

        last_saved: Path | None = checkpoint
        for step in range(start_step, steps + 1):
            display.start_step(step, step - 1)
            context.phase(f"step {step} of {steps}")
            t0 = time.monotonic()
            batch = batches[step - 1]
            version = step
            from .update import UpdateSettings

            settings = UpdateSettings.of(config.algorithm, config.update, next(model.parameters()).device)
            if sft:
                from .finetune import sft_update_step

                transitions: Sequence[Transition] = batch
                with _serving(services, model, version):
                    stats = sft_update_step(model, optimizer, batch, pad_id=policy.pad_id, **settings.sft())
                exact = sum(exact_of[(t.rollout_id, t.call_index)] for t in batch)
            else:
                from .update import update_step

                transitions = [s.transition for s in batch]
                with _serving(services, model, version):
                    stats = update_step(
                        model,
                        optimizer,
                        batch,
                        pad_id=policy.pad_id,
                        reference=policy.reference,
                        **settings.ppo(),
                    )
                exact = len(transitions)
            seconds = time.monotonic() - t0
            rollout_ids = list(dict.fromkeys(t.rollout_id for t in transitions))
            batch_rewards = [r for r in (rewards.get(rid) for rid in rollout_ids) if r is not None]
            metrics = StepMetrics(
                step=step,
                policy_version=version,
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
                groups_skipped=0 if sft else rl.report.skipped_no_variance + rl.report.skipped_singleton,
                problems=dict(problems),
                untrained=dict(refused_rollouts),
                reward_events={} if sft else rl.credit.counts(),
                agents=agent_counts(transitions, transitions),
                tasks=list(dict.fromkeys(t.task_id or t.rollout_id for t in transitions)),
                redrawn_tasks=0,
                seconds=seconds,
                rollout_ids=rollout_ids,
                exact_transitions=exact,
                retokenised_transitions=len(transitions) - exact,
            )
            display.line(
                format_step(metrics, steps) + f"  exact={exact} re-tokenised={len(transitions) - exact}"
            )
            log.record_step(metrics)
            every = config.checkpoint.every_steps
            if step == steps or (every and step % every == 0):
                last_saved = save_checkpoint(
                    out / CHECKPOINTS_DIR,
                    step,
                    model=model,
                    optimizer=optimizer,
                    state={
                        "policy_version": version,
                        "before": None if before is None else before.__dict__,
                        "config": config.model_dump(mode="json"),
                        "traces": {"store": traces.store, "rollouts": len(selection.rollouts)},
                    },
                    keep=config.checkpoint.keep,
                )
            log.redraw()
            display.end_step(
                step, reward=metrics.mean_reward, loss=metrics.loss, tokens_per_s=metrics.tokens_per_s
            )
        after = None
        if queue is not None and config.validation.after:
            after = context.held_out_pass(queue, steps, "after training", val_tasks)
            log.record_eval(after, "after training")
            log.redraw()
        context.closing_lines(before, after, last_saved)
        display.line(f"done: metrics in {log.metrics_path}")
        return context.result(before, after, last_saved)


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
