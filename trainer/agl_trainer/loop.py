"""The training loop: rollouts through the store and the gateway, transitions, LightningRL updates."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agl_core._serve import BackgroundServer
from agl_core.credit import assign_credit, select_agents
from agl_core.gateway import create_gateway_app
from agl_core.records import RolloutStatus, Task
from agl_core.runner import LLM_RESOURCE, Runner, load_agent
from agl_core.store import SqliteStore, StoreClient
from agl_core.store.server import create_store_app
from agl_core.tracing import make_otlp_exporter, setup_tracing
from agl_core.transitions import spans_to_transitions

from .algo import compute_advantages
from .config import TrainerConfig

__all__ = ["StepMetrics", "load_tasks", "train"]

logger = logging.getLogger(__name__)


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
    groups_skipped: int
    problems: dict[str, int]
    seconds: float


def load_tasks(path: Path) -> list[Task]:
    """Tasks from a JSONL file: one JSON object per line; ``id`` (if present) is the task id."""
    tasks = []
    seen: set[str] = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not valid JSON: {exc}") from None
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{number}: each line must be a JSON object, got {type(item).__name__}")
        task_id = str(item.get("id", f"line-{number}"))
        if task_id in seen:
            raise ValueError(f"{path}:{number}: duplicate task id {task_id!r}")
        seen.add(task_id)
        tasks.append(Task(task_id, item))
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


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
    loss = f"{m.loss:+.4f} grad_norm={m.grad_norm:.3f}" if m.loss is not None and m.grad_norm is not None else "skipped"
    extra = f" failed={m.rollouts_failed}" if m.rollouts_failed else ""
    extra += f" late={m.rollouts_late}" if m.rollouts_late else ""
    return (
        f"step {m.step}/{total_steps}  rollouts={m.rollouts}{extra}  transitions={m.transitions}"
        f" (trained {m.trained_transitions})  mean_reward={reward}  loss={loss}  tokens={m.tokens}"
        f"  policy=v{m.policy_version}  {m.seconds:.1f}s"
    )


def train(config: TrainerConfig, *, echo: Callable[[str], None] = print) -> list[StepMetrics]:
    """Run the whole training job described by ``config``; returns one :class:`StepMetrics` per step.

    Starts (unless ``store.url`` is given) the embedded store, then the gateway in front of the policy,
    then the runner's workers, and trains for ``train.steps`` steps. Everything it started is stopped on
    return, also on error.
    """
    import warnings

    import torch

    from .hf_backend import HFBackend
    from .model import load_policy
    from .update import update_step

    torch.set_num_threads(config.train.threads)
    # peft asks transformers a deprecated question on every wrap; not actionable for a user.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    torch.manual_seed(config.train.seed)
    rng = random.Random(config.train.seed)
    agent = load_agent(config.agent, search_paths=(config.base_dir,))
    tasks = load_tasks(config.tasks)
    out_dir = config.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / "metrics.jsonl"

    started: list[Callable[[], None]] = []
    try:
        if config.store.url:
            store_url = config.store.url
        else:
            store = SqliteStore(out_dir / config.store.path)
            started.append(store.close)
            store_server = BackgroundServer(create_store_app(store)).start()
            started.append(store_server.stop)
            store_url = store_server.url
        echo(f"store: {store_url} ({'remote' if config.store.url else out_dir / config.store.path})")
        client = StoreClient(store_url)
        started.append(client.close)

        t0 = time.monotonic()
        model, tokenizer = load_policy(config.model.source, seed=config.model.seed)
        if config.model.lora is not None:
            from peft import LoraConfig, get_peft_model

            lora = config.model.lora
            model = get_peft_model(
                model,
                LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           target_modules=list(lora.target_modules), task_type="CAUSAL_LM"),
            )
        trainable = [p for p in model.parameters() if p.requires_grad]
        echo(
            f"model: {config.model.source} loaded in {time.monotonic() - t0:.1f}s,"
            f" {sum(p.numel() for p in trainable):,} trainable parameters"
        )
        optimizer = torch.optim.AdamW(trainable, lr=config.algorithm.learning_rate)
        reference = None
        if config.algorithm.kl_coef > 0:
            if config.model.lora is None:
                raise ValueError("algorithm.kl_coef > 0 needs model.lora (the base model is the reference)")
            from .update import reference_logprobs_fn

            reference = reference_logprobs_fn(model, tokenizer.pad_token_id or 0)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

        backend = HFBackend(
            model, tokenizer, model_name=config.model.served_name,
            default_max_tokens=config.gateway.default_max_tokens,
        )
        started.append(backend.close)
        gateway_provider = _tracer_provider(store_url, "agl-gateway")
        started.append(gateway_provider.shutdown)
        gateway = BackgroundServer(
            create_gateway_app(backend, tracer_provider=gateway_provider), config.gateway.host, config.gateway.port
        ).start()
        started.append(gateway.stop)
        echo(f"gateway: {gateway.url}/v1 serving {config.model.served_name!r}")

        # The agent's own spans (its framework callback, rewards) go through the global provider, which is
        # what an adapter uses by default.
        agent_provider = setup_tracing(store_url, service_name="agl-agent")
        started.append(agent_provider.force_flush)

        def publish() -> None:
            client.put_resource(
                LLM_RESOURCE,
                {"base_url": gateway.url, "model": config.model.served_name, "policy_version": backend.policy_version},
            )

        publish()
        runner = Runner(agent, client, agent_provider, workers=config.runner.workers).start()
        started.append(runner.stop)

        history: list[StepMetrics] = []
        steps = config.train.steps
        for step in range(1, steps + 1):
            step_start = time.monotonic()
            chosen = rng.sample(tasks, min(config.train.tasks_per_step, len(tasks)))
            requests = [
                {
                    "task_id": task.task_id,
                    "input": task.input,
                    "group_id": f"step{step}:{task.task_id}",
                    "metadata": {"step": step},
                    "max_attempts": config.runner.max_attempts,
                }
                for task in chosen
                for _ in range(config.train.rollouts_per_task)
            ]
            queued = client.enqueue_rollouts(requests)
            ids = [r.rollout_id for r in queued]
            finished = client.wait_for_rollouts(ids, timeout_s=config.runner.step_timeout_s)
            gateway_provider.force_flush()
            done = [r for r in finished if r.status == RolloutStatus.SUCCEEDED]
            failed = [r for r in finished if r.status.finished and r.status != RolloutStatus.SUCCEEDED]
            late = [r for r in finished if not r.status.finished]
            for r in failed[:3]:
                last_error = (r.attempts[-1].error or "").strip().splitlines()[-1:] if r.attempts else []
                echo(f"  rollout {r.rollout_id} {r.status.value}: {last_error[0] if last_error else ''}")

            result = spans_to_transitions(client.all_spans([r.rollout_id for r in done]))
            transitions = assign_credit(
                select_agents(result.transitions, config.algorithm.agents),
                config.algorithm.credit,
                gamma=config.algorithm.gamma,
            )
            transitions = [t for t in transitions if t.prompt_ids and t.response_ids]
            samples, report = compute_advantages(
                transitions, {r.rollout_id: r.group_id or r.rollout_id for r in done}, config.algorithm.name
            )
            rewards = [r.reward for r in done if r.reward is not None]
            stats = None
            if samples:
                with backend.lock:
                    stats = update_step(
                        model, optimizer, samples,
                        clip_eps=config.algorithm.clip_eps, pad_id=pad_id,
                        max_grad_norm=config.algorithm.max_grad_norm,
                        micro_batch_tokens=config.algorithm.micro_batch_tokens,
                        kl_coef=config.algorithm.kl_coef, reference=reference,
                    )
                    backend.policy_version += 1
                publish()
            # lets `agl store serve --retention consumed` drop spans that training has used
            client.mark_consumed([r.rollout_id for r in finished if r.status.finished])
            metrics = StepMetrics(
                step=step,
                policy_version=backend.policy_version,
                rollouts=len(done),
                rollouts_failed=len(failed),
                rollouts_late=len(late),
                transitions=len(result.transitions),
                trained_transitions=len(samples),
                mean_reward=sum(rewards) / len(rewards) if rewards else None,
                loss=stats.loss if stats else None,
                grad_norm=stats.grad_norm if stats else None,
                tokens=stats.tokens if stats else 0,
                groups_skipped=report.skipped_no_variance + report.skipped_singleton,
                problems=result.reasons(),
                seconds=time.monotonic() - step_start,
            )
            history.append(metrics)
            with metrics_path.open("a") as fh:
                fh.write(json.dumps({"time": time.time(), **dataclasses.asdict(metrics)}) + "\n")
            echo(_format(metrics, steps))
            if report.skipped_no_variance:
                echo(f"  {report.skipped_no_variance}/{report.groups} task groups had equal rewards (no signal), skipped")
            for reason, count in result.reasons().items():
                echo(f"  {count} x {reason}")
        echo(f"done: metrics in {metrics_path}" + ("" if config.store.url else f", spans in {out_dir / config.store.path}"))
        return history
    finally:
        for stop in reversed(started):
            try:
                stop()
            except Exception:  # shutting down: report, but keep stopping the rest
                logger.exception("agl: error while shutting down")

