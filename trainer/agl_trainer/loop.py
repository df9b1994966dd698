"""The training loop: rollouts through the store and the gateway, transitions, LightningRL updates.

:func:`train` runs a whole job: it starts (or connects to) the store, serves the policy through the
gateway, starts the runner's workers and then, step by step, samples tasks, waits for their rollouts,
turns spans into transitions, assigns credit, computes group advantages, updates the policy and
publishes it. It evaluates on the validation split before, during and after training, saves
checkpoints it can resume from after a crash, and keeps ``metrics.jsonl``, a reward-curve PNG and
(when installed) TensorBoard scalars in ``output_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from agl_core._serve import BackgroundServer
from agl_core.credit import CreditResult, assign_rewards
from agl_core.gateway import create_gateway_app
from agl_core.records import Rollout, RolloutStatus, Task, Transition
from agl_core.runner import LLM_RESOURCE, Runner, load_agent, resolve_mode, run_command
from agl_core.store import SqliteStore, StoreClient
from agl_core.store.server import create_store_app
from agl_core.tracing import make_otlp_exporter, setup_tracing
from agl_core.transitions import TransitionResult, episode_rewards, explain_untrained, spans_to_transitions

from .algo import Advantaged, GroupReport, compute_advantages
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainerConfig
from .data import TaskSampler, load_splits
from .reporting import Display, Scalars, mean_se, plot_reward_curve

__all__ = ["EvalResult", "RunExistsError", "RunResult", "StepMetrics", "train"]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "reward_curve.png"
INFLIGHT_FILE = "inflight.json"
CHECKPOINTS_DIR = "checkpoints"


class RunExistsError(ValueError):
    """``output_dir`` already holds a run and neither ``--resume`` nor ``--overwrite`` was given."""


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    step: int
    policy_version: int
    rollouts: int
    rollouts_failed: int
    rollouts_late: int
    transitions: int
    trained_transitions: int
    mean_reward: float | None
    loss: float | None
    grad_norm: float | None
    tokens: int
    tokens_per_s: float
    groups_skipped: int
    problems: dict[str, int]
    #: Rollouts that finished but gave no trained transition, counted by reason.
    untrained: dict[str, int]
    #: Intermediate rewards applied, by kind (``agl_core.credit.REWARD_KINDS``).
    reward_events: dict[str, int]
    #: Per agent name (:data:`UNNAMED_AGENT` for calls no agent claimed): its LLM calls in the step's rollouts
    #: and how many went into the update, ``{"writer": {"calls": 12, "trained": 8}}``.
    agents: dict[str, dict[str, int]]
    #: Every task rolled out this step, the redrawn ones (``train.resample_rounds``) included.
    tasks: list[str]
    #: Tasks drawn beyond ``tasks_per_step`` because too few groups had differing rewards.
    redrawn_tasks: int
    seconds: float


#: The name ``StepMetrics.agents`` gives to LLM calls no agent claimed.
UNNAMED_AGENT = "(unnamed)"


@dataclasses.dataclass(frozen=True)
class _Batch:
    result: TransitionResult
    credit: CreditResult
    untrained: dict[str, str]
    samples: list[Advantaged]
    report: GroupReport
    group_of: dict[str, str]

    @property
    def signal_groups(self) -> int:
        """Groups whose rollouts scored differently: the ones that train."""
        return self.report.groups - self.report.skipped_no_variance - self.report.skipped_singleton


def _agent_counts(calls: Sequence[Transition], trained: Sequence[Transition]) -> dict[str, dict[str, int]]:
    """LLM calls and trained transitions per agent name, in order of first appearance."""
    counts: dict[str, dict[str, int]] = {}
    for key, group in (("calls", calls), ("trained", trained)):
        for t in group:
            counts.setdefault(t.agent_name or UNNAMED_AGENT, {"calls": 0, "trained": 0})[key] += 1
    return counts


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Score on the validation split: the mean over tasks of each task's mean reward (a failed or late
    rollout scores 0), its standard error, and the number of tasks."""

    step: int
    mean: float
    se: float
    n: int
    rollouts_failed: int
    task_scores: dict[str, float]

    def describe(self) -> str:
        failed = f", {self.rollouts_failed} rollouts failed" if self.rollouts_failed else ""
        return f"{self.mean:.3f} ± {self.se:.3f} (SE, n={self.n} tasks{failed})"


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


def _tracer_provider(store_url: str, service: str) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(make_otlp_exporter(store_url), schedule_delay_millis=200))
    return provider


def _format(m: StepMetrics, total_steps: int) -> str:
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
    return (
        f"step {m.step}/{total_steps}  rollouts={m.rollouts}{extra}  transitions={m.transitions}"
        f" (trained {m.trained_transitions})  mean_reward={reward}  loss={loss}  tokens={m.tokens}"
        f" ({m.tokens_per_s:,.0f}/s)  policy=v{m.policy_version}  {m.seconds:.1f}s"
    )


def _paired_difference(before: EvalResult, after: EvalResult) -> tuple[float, float, int]:
    """Mean and SE of the per-task difference after - before, over the tasks both evaluated."""
    common = sorted(set(before.task_scores) & set(after.task_scores))
    diffs = [after.task_scores[t] - before.task_scores[t] for t in common]
    mean, se = mean_se(diffs)
    return mean, se, len(common)


class _Run:
    """One training job's state and services; :func:`train` drives it."""

    def __init__(self, config: TrainerConfig, display: Display, stack: ExitStack) -> None:
        self.config = config
        self.display = display
        self.stack = stack
        self.out = config.output_dir
        self.metrics_path = self.out / METRICS_FILE
        self.plot_path = self.out / PLOT_FILE
        self.train_curve: list[tuple[int, float]] = []
        self.val_curve: list[tuple[int, float, float]] = []
        self.history: list[StepMetrics] = []
        self.before: EvalResult | None = None
        self.plot: Path | None = None
        self.scalars = Scalars(self.out / "tensorboard", config.logging.tensorboard)
        stack.callback(self.scalars.close)

    # --- services ---------------------------------------------------------------------------------

    def start(self) -> None:
        import torch

        from .model import load_policy, load_tokenizer, torch_device
        from .serving import start_serving

        config, stack = self.config, self.stack
        if config.store.url:
            self.store_url = config.store.url
        else:
            store = SqliteStore(self.out / config.store.path)
            stack.callback(store.close)
            server = BackgroundServer(create_store_app(store)).start()
            stack.callback(server.stop)
            self.store_url = server.url
        self.display.line(
            f"store: {self.store_url} ({'remote' if config.store.url else self.out / config.store.path})"
        )
        self.client = StoreClient(self.store_url)
        stack.callback(self.client.close)

        t0 = time.monotonic()
        self.model: Any = None
        self.optimizer: Any = None
        self.reference = None
        self.updater: Any = None
        if config.update.backend == "verl":
            # verl's workers hold the policy; this process only needs the tokenizer
            self.tokenizer = load_tokenizer(config.model.source)
        else:
            model, self.tokenizer = load_policy(config.model.source, seed=config.model.seed)
            model = model.to(torch_device(config.update.device))
            if config.model.lora is not None:
                from peft import LoraConfig, get_peft_model

                lora = config.model.lora
                model = get_peft_model(
                    model,
                    LoraConfig(
                        r=lora.r,
                        lora_alpha=lora.alpha,
                        lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules),
                        task_type="CAUSAL_LM",
                    ),
                )
            self.model = model
            trainable = [p for p in model.parameters() if p.requires_grad]
            self.display.line(
                f"model: {config.model.source} loaded in {time.monotonic() - t0:.1f}s on {next(model.parameters()).device},"
                f" {sum(p.numel() for p in trainable):,} trainable parameters"
            )
            self.optimizer = torch.optim.AdamW(trainable, lr=config.algorithm.learning_rate)
            if config.algorithm.kl_coef > 0:
                if config.model.lora is None:
                    raise ValueError(
                        "algorithm.kl_coef > 0 needs model.lora (the base model is the reference)"
                    )
                from .update import reference_logprobs_fn

                self.reference = reference_logprobs_fn(
                    model, self.tokenizer.pad_token_id or 0, bf16=config.update.bf16
                )
        tok = self.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if config.update.backend == "verl":
            from .verl_backend import VerlUpdater

            self.updater = VerlUpdater(config, pad_id=self.pad_id)
            stack.callback(self.updater.close)
            self.display.line(f"update: verl actor on Ray ({config.model.source})")

        self.serving = start_serving(config, self.model, tok)
        stack.callback(self.serving.close)
        self.gateway_provider = _tracer_provider(self.store_url, "agl-gateway")
        stack.callback(self.gateway_provider.shutdown)
        self.gateway = BackgroundServer(
            create_gateway_app(
                self.serving.backend, tracer_provider=self.gateway_provider, renderer=self.serving.renderer
            ),
            config.gateway.host,
            config.gateway.port,
        ).start()
        stack.callback(self.gateway.stop)
        self.display.line(
            f"gateway: {self.gateway.url}/v1 serving {config.model.served_name!r} ({self.serving.kind} backend)"
        )

    def start_runners(self, agent: Any) -> None:
        # The agent's own spans (its framework callback, rewards) go through the global provider, which is
        # what an adapter uses by default.
        config = self.config
        self.agent_provider = setup_tracing(self.store_url, service_name="agl-agent")
        self.stack.callback(self.agent_provider.force_flush)
        self.publish()
        if not config.runner.workers:
            command = run_command(
                config.agent,
                self.store_url,
                workers=1,
                mode=config.runner.mode,
                rollout_timeout_s=config.runner.rollout_timeout_s,
                paths=[config.base_dir],
            )
            self.display.line(f"runner: none started (runner.workers: 0); start runners with:\n  {command}")
            return
        runner = Runner(
            agent,
            self.client,
            self.agent_provider,
            workers=config.runner.workers,
            mode=config.runner.mode,
            rollout_timeout_s=config.runner.rollout_timeout_s,
            otlp_endpoint=self.store_url,
        ).start()
        self.stack.callback(lambda: runner.stop(timeout_s=10.0))
        timeout = (
            f", {config.runner.rollout_timeout_s:g}s per rollout" if config.runner.rollout_timeout_s else ""
        )
        self.display.line(f"runner: {runner.workers} worker(s) in {runner.mode} mode{timeout}")

    def publish(self) -> None:
        self.client.put_resource(
            LLM_RESOURCE,
            {
                "base_url": self.gateway.url,
                "model": self.config.model.served_name,
                "policy_version": self.serving.policy_version,
            },
        )

    # --- rollouts ---------------------------------------------------------------------------------

    def run_rollouts(
        self, label: str, requests: list[dict[str, Any]]
    ) -> tuple[list[Rollout], list[Rollout], list[Rollout]]:
        """Enqueue, wait until done or the step deadline, cancel the late ones; (succeeded, failed, late)."""
        queued = self.client.enqueue_rollouts(requests)
        ids = [r.rollout_id for r in queued]
        # a run killed while these are in flight cancels them when resumed
        (self.out / INFLIGHT_FILE).write_text(json.dumps({"rollout_ids": ids}))
        deadline = time.monotonic() + self.config.runner.step_timeout_s
        while True:
            rollouts = self.client.get_rollouts(ids)
            ok = sum(r.status == RolloutStatus.SUCCEEDED for r in rollouts)
            bad = sum(r.status.finished and r.status != RolloutStatus.SUCCEEDED for r in rollouts)
            self.display.rollouts(label, ok, bad, len(ids))
            if ok + bad == len(ids) or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
        late = [r for r in rollouts if not r.status.finished]
        if late:
            self.client.cancel_rollouts([r.rollout_id for r in late])
        # the runner flushes the agent's spans before completing; the gateway's are batched
        self.gateway_provider.force_flush()
        (self.out / INFLIGHT_FILE).unlink(missing_ok=True)
        done = [r for r in rollouts if r.status == RolloutStatus.SUCCEEDED]
        failed = [r for r in rollouts if r.status.finished and r.status != RolloutStatus.SUCCEEDED]
        for r in failed[:3]:
            last_error = (r.attempts[-1].error or "").strip().splitlines()[-1:] if r.attempts else []
            self.display.line(
                f"  rollout {r.rollout_id} {r.status.value}: {last_error[0] if last_error else ''}"
            )
        if len(failed) > 3:
            self.display.line(f"  ... and {len(failed) - 3} more failed rollouts (agl inspect ROLLOUT_ID)")
        if late:
            self.display.line(
                f"  {len(late)} rollouts were not done after runner.step_timeout_s={self.config.runner.step_timeout_s:g}s"
                " and were cancelled"
            )
        return done, failed, late

    def cancel_inflight(self) -> None:
        path = self.out / INFLIGHT_FILE
        if path.is_file():
            ids = json.loads(path.read_text()).get("rollout_ids", [])
            if ids:
                self.client.cancel_rollouts(ids)
                self.display.line(f"cancelled {len(ids)} rollouts left over from the interrupted step")
            path.unlink()

    # --- validation -------------------------------------------------------------------------------

    def evaluate(self, step: int, tasks: Sequence[Task]) -> EvalResult:
        v = self.config.validation
        chosen = list(tasks[: v.max_tasks] if v.max_tasks else tasks)
        requests = [
            {
                "task_id": t.task_id,
                "input": t.input,
                "group_id": f"val{step}:{t.task_id}",
                "metadata": {"split": "val", "step": step},
                "max_attempts": self.config.runner.max_attempts,
            }
            for t in chosen
            for _ in range(v.rollouts_per_task)
        ]
        done, failed, late = self.run_rollouts(f"validation @ step {step}", requests)
        rewards = _rewards(done, self.client.all_spans)
        per_task: dict[str, list[float]] = {t.task_id: [] for t in chosen}
        for r in done:
            per_task[r.task_id or ""].append(rewards.get(r.rollout_id, 0.0))
        for r in [*failed, *late]:
            per_task[r.task_id or ""].append(0.0)
        scores = {tid: sum(v) / len(v) for tid, v in per_task.items() if v}
        mean, se = mean_se(list(scores.values()))
        self.client.mark_consumed([r.rollout_id for r in [*done, *failed]])
        return EvalResult(step, mean, se, len(scores), len(failed) + len(late), scores)

    def record_eval(self, result: EvalResult, label: str) -> None:
        self.val_curve.append((result.step, result.mean, result.se))
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps({"kind": "val", "time": time.time(), **dataclasses.asdict(result)}) + "\n")
        self.scalars.add(result.step, {"val/mean_reward": result.mean, "val/se": result.se})
        self.display.line(f"validation ({label}, step {result.step}): {result.describe()}")

    # --- one training step ------------------------------------------------------------------------

    def _episodes(self, done: list[Rollout], failed: list[Rollout]) -> tuple[list[Rollout], list[Any]]:
        """The finished rollouts to train on, and the spans of their last attempts."""
        rewards_config = self.config.algorithm.rewards
        # a timed-out rollout has no episode reward; it is trained only when the config gives it one
        used = done + [
            r
            for r in failed
            if r.status == RolloutStatus.TIMED_OUT and rewards_config.timeout_episode_reward is not None
        ]
        # a retried rollout keeps the spans of its earlier attempts (even late LLM calls of a timed-out
        # one); only its last attempt is the episode being trained
        last_attempts = {r.attempts[-1].attempt_id for r in used if r.attempts}
        spans = [
            s
            for s in self.client.all_spans([r.rollout_id for r in used])
            if s.attempt_id is None or s.attempt_id in last_attempts
        ]
        return used, spans

    def _batch(self, used: list[Rollout], spans: list[Any]) -> _Batch:
        """The step's episodes as training data: transitions, credit and group advantages."""
        config = self.config
        result = spans_to_transitions(spans, timeout_reward=config.algorithm.rewards.timeout_episode_reward)
        credit = assign_rewards(
            result,
            spans,
            strategy=config.algorithm.credit,
            gamma=config.algorithm.gamma,
            weights=config.algorithm.reward_weights(),
            agents=config.algorithm.agents,
        )
        transitions = [t for t in credit.transitions if t.prompt_ids and t.response_ids]
        group_of = {r.rollout_id: r.group_id or r.rollout_id for r in used}
        samples, report = compute_advantages(
            transitions, group_of, config.algorithm.name, scores=credit.scores
        )
        return _Batch(
            result,
            credit,
            explain_untrained([r.rollout_id for r in used], result, transitions),
            samples,
            report,
            group_of,
        )

    def train_step(
        self, step: int, tasks: list[Task], draw: Callable[[int], list[Task]] | None = None
    ) -> StepMetrics:
        """Roll out ``tasks``, update the policy on the result and publish it. With ``train.resample_rounds``,
        ``draw(n)`` gives ``n`` more tasks when fewer than ``tasks_per_step`` groups have differing rewards."""
        from .update import update_step

        config = self.config
        step_start = time.monotonic()
        done: list[Rollout] = []
        failed: list[Rollout] = []
        late: list[Rollout] = []
        used: list[Rollout] = []
        spans: list[Any] = []
        drawn, first_draw, extra_rounds = list(tasks), len(tasks), 0
        while True:
            prefix = f"step{step}" if not extra_rounds else f"step{step}.{extra_rounds}"
            requests = [
                {
                    "task_id": t.task_id,
                    "input": t.input,
                    "group_id": f"{prefix}:{t.task_id}",
                    "metadata": {"split": "train", "step": step, "round": extra_rounds},
                    "max_attempts": config.runner.max_attempts,
                }
                for t in tasks
                for _ in range(config.train.rollouts_per_task)
            ]
            label = f"rollouts of step {step}" + (f" (redraw {extra_rounds})" if extra_rounds else "")
            round_done, round_failed, round_late = self.run_rollouts(label, requests)
            done, failed, late = done + round_done, failed + round_failed, late + round_late
            # each round fetches only its own spans; the batch is rebuilt over all rounds' episodes
            round_used, round_spans = self._episodes(round_done, round_failed)
            used, spans = used + round_used, spans + round_spans
            batch = self._batch(used, spans)
            missing = config.train.tasks_per_step - batch.signal_groups
            if draw is None or missing <= 0 or extra_rounds >= config.train.resample_rounds:
                break
            extra_rounds += 1
            tasks = draw(missing)
            drawn += tasks
        result, credit, untrained, samples, report = (
            batch.result,
            batch.credit,
            batch.untrained,
            batch.samples,
            batch.report,
        )
        rewards = list(_rewards(done, lambda ids: spans).values())
        stats, update_s = None, 0.0
        if samples:
            t0 = time.monotonic()
            version = self.serving.policy_version + 1
            if self.updater is None:
                # under the serving lock no batch runs on half-updated weights or under the old version
                with self.serving.lock:
                    stats = update_step(
                        self.model,
                        self.optimizer,
                        samples,
                        clip_eps=config.algorithm.clip_eps,
                        pad_id=self.pad_id,
                        max_grad_norm=config.algorithm.max_grad_norm,
                        micro_batch_tokens=config.algorithm.micro_batch_tokens,
                        kl_coef=config.algorithm.kl_coef,
                        reference=self.reference,
                        bf16=config.update.bf16,
                    )
                    self.serving.publish(self.model, version)
            else:
                stats = self.updater.update(samples, group_of=batch.group_of)
                self.serving.publish_adapter(self.updater.export_adapter(version), version)
            update_s = time.monotonic() - t0
            self.publish()
        # lets `agl store serve --retention consumed` drop spans that training has used
        self.client.mark_consumed([r.rollout_id for r in [*done, *failed]])
        metrics = StepMetrics(
            step=step,
            policy_version=self.serving.policy_version,
            rollouts=len(done),
            rollouts_failed=len(failed),
            rollouts_late=len(late),
            transitions=len(result.transitions),
            trained_transitions=len(samples),
            mean_reward=sum(rewards) / len(rewards) if rewards else None,
            loss=stats.loss if stats else None,
            grad_norm=stats.grad_norm if stats else None,
            tokens=stats.tokens if stats else 0,
            tokens_per_s=(stats.tokens / update_s) if stats and update_s > 0 else 0.0,
            groups_skipped=report.skipped_no_variance + report.skipped_singleton,
            problems=result.reasons(),
            untrained=dict(Counter(untrained.values())),
            reward_events=credit.counts(),
            agents=_agent_counts(result.transitions, [s.transition for s in samples]),
            tasks=[t.task_id for t in drawn],
            redrawn_tasks=len(drawn) - first_draw,
            seconds=time.monotonic() - step_start,
        )
        self.display.line(_format(metrics, config.train.steps))
        if metrics.redrawn_tasks:
            self.display.line(
                f"  redrew {metrics.redrawn_tasks} tasks in {extra_rounds} round(s) for groups with differing"
                f" rewards: {batch.signal_groups} of {report.groups} groups train"
            )
        if report.skipped_no_variance:
            self.display.line(
                f"  {report.skipped_no_variance}/{report.groups} task groups had equal rewards (no signal), skipped"
            )
        if len(metrics.agents) > 1 or config.algorithm.agents:
            self.display.line(
                "  agents: "
                + ", ".join(
                    f"{name} {c['trained']}/{c['calls']} calls trained" for name, c in metrics.agents.items()
                )
            )
        for line in credit.summary():
            self.display.line(f"  {line}")
        call_problems = Counter(p.reason for p in result.problems if p.span_id is not None)
        for reason, count in call_problems.most_common():
            self.display.line(f"  {count} LLM calls not trained: {reason}")
        if untrained:
            where = "" if config.store.url else f" --store {self.out / config.store.path}"
            self.display.line(
                f"  {len(untrained)} rollouts gave no training data (see: agl inspect {next(iter(untrained))}{where}):"
            )
            for reason, count in Counter(untrained.values()).most_common():
                self.display.line(f"    {count} x {reason}")
        return metrics

    def record_step(self, metrics: StepMetrics) -> None:
        self.history.append(metrics)
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps({"kind": "train", "time": time.time(), **dataclasses.asdict(metrics)}) + "\n")
        if metrics.mean_reward is not None:
            self.train_curve.append((metrics.step, metrics.mean_reward))
        self.scalars.add(
            metrics.step,
            {
                "train/mean_reward": metrics.mean_reward,
                "train/loss": metrics.loss,
                "train/grad_norm": metrics.grad_norm,
                "train/tokens_per_s": metrics.tokens_per_s,
                "train/rollouts_failed": float(metrics.rollouts_failed),
                "train/policy_version": float(metrics.policy_version),
            },
        )

    def redraw(self) -> None:
        if self.config.logging.plot:
            self.plot = plot_reward_curve(
                self.plot_path,
                self.train_curve,
                self.val_curve,
                title=f"{self.config.agent} ({self.config.algorithm.name})",
            )

    # --- checkpoints ------------------------------------------------------------------------------

    def save(self, step: int, sampler: TaskSampler) -> Path | None:
        if self.model is None:  # the verl update keeps the weights in its workers (verl's own checkpoints)
            return None
        state = {
            "policy_version": self.serving.policy_version,
            "sampler": sampler.state_dict(),
            "before": dataclasses.asdict(self.before) if self.before else None,
            "config": self.config.model_dump(mode="json"),
        }
        return save_checkpoint(
            self.out / CHECKPOINTS_DIR,
            step,
            model=self.model,
            optimizer=self.optimizer,
            state=state,
            keep=self.config.checkpoint.keep,
        )

    def restore(self, path: Path, sampler: TaskSampler) -> int:
        state = load_checkpoint(path, model=self.model, optimizer=self.optimizer)
        step = int(state["step"])
        sampler.load_state_dict(state["sampler"])
        version = int(state["policy_version"])
        if version > self.serving.policy_version:
            self.serving.publish(self.model, version)  # serve the restored weights under their version
        if state.get("before"):
            self.before = EvalResult(**state["before"])
        changed = _config_changes(state.get("config") or {}, self.config.model_dump(mode="json"))
        if changed:
            self.display.line("note: config differs from the checkpoint's in: " + ", ".join(changed))
        self._replay_metrics(step)
        return step

    def _replay_metrics(self, step: int) -> None:
        """Keep the metrics up to the checkpoint's step (later lines belong to steps that will run again)
        and rebuild the curves from them."""
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
            elif row.get("mean_reward") is not None:
                self.train_curve.append((row["step"], row["mean_reward"]))
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        tmp.replace(self.metrics_path)


def _config_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(_config_changes(a, b, f"{prefix}{key}."))
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


def _rewards(done: Sequence[Rollout], spans_of: Callable[[list[str]], Sequence[Any]]) -> dict[str, float]:
    """Episode reward of each succeeded rollout: the value the runner recorded, or (for agents that call
    ``emit_reward`` themselves) the one in its spans (``spans_of(rollout_ids)``)."""
    out = {r.rollout_id: r.reward for r in done if r.reward is not None}
    missing = [r.rollout_id for r in done if r.reward is None]
    if missing:
        from_spans = episode_rewards(spans_of(missing))
        out.update({rid: v for rid, v in from_spans.items() if math.isfinite(v)})
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
            "(deleting its checkpoints, metrics and store), or choose another output_dir (--set output_dir=...)"
        )
    if overwrite:
        for name in (METRICS_FILE, PLOT_FILE, INFLIGHT_FILE):
            (out / name).unlink(missing_ok=True)
        for name in (CHECKPOINTS_DIR, "tensorboard"):
            shutil.rmtree(out / name, ignore_errors=True)
        if store_file:
            for suffix in ("", "-wal", "-shm"):
                (out / f"{store_file}{suffix}").unlink(missing_ok=True)
    return None


def train(
    config: TrainerConfig,
    *,
    echo: Callable[[str], None] = print,
    resume: bool = False,
    overwrite: bool = False,
) -> RunResult:
    """Run the training job ``config`` describes; see the module docstring.

    ``resume`` continues the run in ``output_dir`` from its newest checkpoint (no step repeated or
    skipped); ``overwrite`` replaces a run that is there. Without either, an existing run is an error.
    Everything started is stopped on return, also on error.
    """
    import warnings

    import torch

    out = config.output_dir
    out.mkdir(parents=True, exist_ok=True)
    if resume and config.update.backend == "verl":
        raise ValueError(
            "--resume is not supported with update.backend verl (its weights live in verl's workers)"
        )
    checkpoint = _prepare_output(
        out, resume=resume, overwrite=overwrite, store_file=None if config.store.url else config.store.path
    )
    torch.set_num_threads(config.train.threads)
    # peft asks transformers a deprecated question on every wrap; not actionable for a user.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    torch.manual_seed(config.train.seed)
    agent = load_agent(config.agent, search_paths=(config.base_dir,))
    resolve_mode(agent, config.runner.mode)  # a bad agent or mode fails before anything starts
    train_tasks, val_tasks = load_splits(config.tasks)
    sampler = TaskSampler(train_tasks, seed=config.train.seed)
    steps = config.train.steps
    validating = bool(val_tasks) and (
        config.validation.before or config.validation.after or config.validation.every_steps
    )

    with ExitStack() as stack, Display(config.logging.progress, steps, echo=echo) as display:
        run = _Run(config, display, stack)
        display.line(
            f"tasks: {len(train_tasks)} train, {len(val_tasks)} validation"
            + (
                ""
                if val_tasks
                else " (no validation split: set tasks.val or tasks.val_fraction to measure held-out reward)"
            )
        )
        run.start()
        start_step = 1
        if checkpoint is not None:
            start_step = run.restore(checkpoint, sampler) + 1
            display.line(
                f"resumed from {checkpoint} at step {start_step} (policy v{run.serving.policy_version})"
            )
        if checkpoint is not None:
            run.cancel_inflight()  # before any worker can pick up the killed step's rollouts
        run.start_runners(agent)
        if checkpoint is None and validating and config.validation.before:
            run.before = run.evaluate(0, val_tasks)
            run.record_eval(run.before, "before training")
        last_saved: Path | None = checkpoint
        for step in range(start_step, steps + 1):
            display.start_step(step, step - 1)
            metrics = run.train_step(step, sampler.sample(config.train.tasks_per_step), draw=sampler.sample)
            run.record_step(metrics)
            every = config.validation.every_steps
            if validating and every and step % every == 0 and step != steps:
                run.record_eval(run.evaluate(step, val_tasks), "during training")
            every = config.checkpoint.every_steps
            if step == steps or (every and step % every == 0):
                last_saved = run.save(step, sampler) or last_saved
            run.redraw()
            display.end_step(
                step, reward=metrics.mean_reward, loss=metrics.loss, tokens_per_s=metrics.tokens_per_s
            )
        after = None
        if validating and config.validation.after:
            after = run.evaluate(steps, val_tasks)
            run.record_eval(after, "after training")
            run.redraw()
        if run.before is not None and after is not None:
            diff, diff_se, n = _paired_difference(run.before, after)
            display.line(
                f"held-out reward: before {run.before.describe()} -> after {after.describe()}; "
                f"change {diff:+.3f} ± {diff_se:.3f} (paired SE over {n} tasks)"
            )
        if last_saved is not None:
            display.line(f"checkpoint: {last_saved}")
        if run.plot is not None:
            display.line(f"reward curve: {run.plot}")
        if run.scalars.enabled:
            display.line(f"tensorboard: tensorboard --logdir {out / 'tensorboard'}")
        display.line(
            f"done: metrics in {run.metrics_path}"
            + ("" if config.store.url else f", spans in {out / config.store.path}")
        )
        return RunResult(run.history, run.before, after, run.plot, last_saved)
