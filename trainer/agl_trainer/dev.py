"""``agl dev`` and ``Trainer.dev``: a few rollouts through the whole pipeline, without an update.

The rollouts run as a training step's do: the store (a temporary SQLite file, ``--store FILE``, or
``store.url``), the policy served through the gateway by the configured backend, the runner's workers
running the agent with ``llm.split == "train"``, then spans -> transitions -> credit. Nothing is trained
and no checkpoint is read or written. The report (:func:`~agl_trainer.reporting.display.dev_lines`) gives per
rollout its id, status, reward, LLM calls and transitions, and every reason it, or one of its calls,
would not train: the reasons ``agl train`` prints and ``agl inspect`` shows.

This module imports cheaply (it holds the ``agl dev`` command); the services, the model and torch are
imported when a dev run starts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from agl_core.records import Rollout, RolloutStatus, Span, Task

from .config import REQUIRED_KEYS, ConfigError, TrainerConfig, add_override_argument, load_config
from .learning.batch import Batch, trainable_transitions
from .reporting.display import dev_lines
from .reporting.results import DevResult, DevRollout
from .run.data import DatasetError, find_task_file, load_tasks
from .run.rollouts import RolloutRound, error_line, rollout_rewards

if TYPE_CHECKING:
    from agl_core.plugins import CliCommand

    from .run.services import AgentFn

__all__ = ["DEFAULT_ROLLOUTS", "DEV_COMMAND", "run_dev"]

#: Rollouts a dev run makes unless told otherwise.
DEFAULT_ROLLOUTS = 4


def _quiet(line: str) -> None:
    pass


def run_dev(
    config: TrainerConfig,
    *,
    agent: AgentFn | None = None,
    tasks: Sequence[Task] | None = None,
    n: int = DEFAULT_ROLLOUTS,
    store: str | Path | None = None,
    echo: Callable[[str], None] = _quiet,
) -> DevResult:
    """Run ``n`` rollouts of ``agent`` (default: the config's) on ``tasks`` (default: the config's training
    tasks), one per task in order, starting over when there are fewer tasks than ``n``, and say what
    training would make of each; nothing is trained.

    ``store`` keeps the rollouts and their spans in that SQLite file (for ``agl inspect``) instead of a
    temporary one. ``echo`` gets progress lines (services started, failed rollouts); the report is
    :func:`~agl_trainer.reporting.display.dev_lines` of the answer. Raises ``ValueError`` (a
    :class:`~agl_trainer.run.data.DatasetError` for tasks) before anything starts when the input cannot run.
    """
    from .learning.batch import build_batch
    from .reporting.display import Display
    from .run.loop import job_agent, job_tasks
    from .run.rollouts import RolloutQueue
    from .run.services import load_served_model, start_runners, start_services, start_store
    from .run.step import episodes

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n is the number of rollouts to run, a whole number of at least 1; got {n!r}")
    if store is not None and config.store.url:
        raise ValueError(
            f"the config sends rollouts to store.url {config.store.url}; drop --store, or that key"
        )
    if store is not None and not Path(store).parent.is_dir():
        raise ValueError(f"--store {store}: the folder {Path(store).parent} does not exist")
    agent_fn = job_agent(config, agent)
    chosen = list(tasks) if tasks is not None else job_tasks(config.tasks, None)[0]
    if not chosen:
        raise DatasetError("no tasks to run")
    picks = [chosen[k % len(chosen)] for k in range(n)]
    requests = [
        {
            "task_id": task.task_id,
            "input": task.input,
            "group_id": f"dev:{task.task_id}",
            "metadata": {"split": "train", "step": 0, "dev_index": i},
            "max_attempts": config.runner.max_attempts,
        }
        for i, task in enumerate(picks)
    ]
    with ExitStack() as stack:
        if store is None:
            file = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agl-dev-"))) / "store.sqlite"
        else:
            file = Path(store)
        connection = start_store(config.store, stack, file=file, echo=echo)
        model, tokenizer = load_served_model(config, echo=echo)
        services = start_services(config, stack, connection, model=model, tokenizer=tokenizer, echo=echo)
        queue = RolloutQueue(
            services.client,
            Display("plain", 1, echo=echo),
            step_timeout_s=config.runner.step_timeout_s,
            flush=services.flush,
        )
        start_runners(config, services, agent_fn, stack, echo=echo)
        finished = queue.run(f"{n} dev rollouts", requests)
        everything = [*finished.done, *finished.failed, *finished.late]
        spans = services.client.all_spans([r.rollout_id for r in everything])

    def spans_of(ids: list[str]) -> list[Span]:
        wanted = set(ids)
        return [s for s in spans if s.rollout_id in wanted]

    used, used_spans = episodes(config.algorithm, finished, spans_of)
    batch = build_batch(config, used, used_spans)
    rewards = rollout_rewards(finished.done, spans_of)
    described = [_describe(r, finished, batch, rewards, spans, config) for r in everything]
    order = {r.rollout_id: int(r.metadata.get("dev_index", 0)) for r in everything}
    described.sort(key=lambda d: order[d.rollout_id])
    kept = config.store.url or (str(file) if store is not None else None)
    return DevResult(tuple(described), kept)


def _describe(
    rollout: Rollout,
    finished: RolloutRound,
    batch: Batch,
    rewards: dict[str, float],
    spans: Sequence[Span],
    config: TrainerConfig,
) -> DevRollout:
    """What training would make of ``rollout``: counts from ``batch`` and the reasons behind them."""
    from agl_core.pipeline.report import count_llm_calls

    rid = rollout.rollout_id
    last = rollout.attempts[-1] if rollout.attempts else None
    own = [
        s for s in spans if s.rollout_id == rid and (last is None or s.attempt_id in (None, last.attempt_id))
    ]
    made = [t for t in batch.result.transitions if t.rollout_id == rid]
    credited = [t for t in batch.credit.transitions if t.rollout_id == rid]
    trained = [t for t in trainable_transitions(batch.credit) if t.rollout_id == rid]
    reasons: list[str] = []
    status = rollout.status
    if any(r.rollout_id == rid for r in finished.late):
        status = RolloutStatus.CANCELLED
        reasons.append(
            f"rollout still running after runner.step_timeout_s={config.runner.step_timeout_s:g}s; cancelled"
        )
    elif rid not in batch.group_of:  # finished without an episode to train on
        cause = error_line(last.error if last is not None else None)
        reasons.append(f"rollout {status.value}" + (f": {cause}" if cause else ""))
        if status == RolloutStatus.TIMED_OUT:
            reasons.append("timed-out rollouts train only with algorithm.rewards.timeout_episode_reward set")
    else:
        if rid in batch.untrained:
            reasons.append(batch.untrained[rid])
        for problem in batch.result.problems:
            if problem.rollout_id != rid or problem.span_id is None:
                continue
            text = problem.reason + (f" ({problem.detail})" if problem.detail else "")
            if text not in reasons and problem.reason not in reasons:
                reasons.append(text)
        if trained:  # the rollout trains, but not every one of its transitions does
            unselected, tokenless = len(made) - len(credited), len(credited) - len(trained)
            if unselected:
                reasons.append(
                    f"{unselected} LLM call(s) by agents not selected for training (algorithm.agents, or"
                    " served by the base model with policies:)"
                )
            if tokenless:
                reasons.append(f"{tokenless} LLM call(s) recorded no prompt or no response tokens")
    return DevRollout(
        rollout_id=rid,
        task_id=rollout.task_id,
        status=status,
        reward=rewards.get(rid),
        llm_calls=count_llm_calls(own),
        transitions=len(made),
        trained=len(trained),
        reasons=tuple(reasons),
    )


def _fail(message: str) -> int:
    print(f"agl dev: {message}", file=sys.stderr)
    return 2


class DevCommand:
    """``agl dev``: the ``agl`` subcommand (an entry point in the ``agl.commands`` group, implementing
    :class:`agl_core.plugins.CliCommand`); it imports torch only when it runs."""

    name = "dev"
    help = "run a few rollouts through the whole pipeline without training, and say why each would not train"
    extra = "trainer"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("config", help="path of the trainer's YAML config")
        parser.add_argument(
            "--tasks",
            metavar="FILE",
            help="JSONL or Parquet task file, relative to the working directory or else to the config's"
            " folder (default: the config's training tasks)",
        )
        parser.add_argument(
            "-n",
            "--n",
            dest="n",
            type=int,
            default=DEFAULT_ROLLOUTS,
            metavar="N",
            help="rollouts to run, one per task in order (default: %(default)s)",
        )
        parser.add_argument(
            "--store",
            metavar="FILE",
            help="keep the rollouts and their spans in this SQLite file, for agl inspect (default: a"
            " temporary one)",
        )
        add_override_argument(parser, "runner.workers=1")

    def run(self, args: argparse.Namespace) -> int:
        required = tuple(k for k in REQUIRED_KEYS if k != "tasks") if args.tasks else REQUIRED_KEYS
        try:
            config = load_config(args.config, args.overrides, required=required)
        except ConfigError as exc:
            return _fail(str(exc))
        from .model import ModelNotFoundError
        from .requirements import check_requirements

        try:
            check_requirements(config)
            tasks = load_tasks(find_task_file(args.tasks, config.base_dir)) if args.tasks else None
            result = run_dev(
                config,
                tasks=tasks,
                n=args.n,
                store=args.store,
                echo=lambda line: print(line, file=sys.stderr, flush=True),
            )
        except (DatasetError, ModelNotFoundError, ValueError) as exc:
            return _fail(str(exc).replace("\n", " "))
        except KeyboardInterrupt:
            print("agl dev: interrupted", file=sys.stderr)
            return 130
        for line in dev_lines(result):
            print(line)
        return 0 if result.trainable else 1


#: The ``agl dev`` command (entry point ``agl.commands: dev``).
DEV_COMMAND: CliCommand = DevCommand()
