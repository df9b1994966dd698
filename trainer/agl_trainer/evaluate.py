"""``agl eval``: score a policy on a task file the way the trainer's validation does.

    agl eval CONFIG                                  # the base model on the config's validation split
    agl eval CONFIG --checkpoint runs/x              # the newest checkpoint of a run
    agl eval CONFIG --checkpoint DIR --baseline      # ... and the base model, with the paired change
    agl eval CONFIG --tasks dev.jsonl --samples 4 --per-field op --output scores.jsonl

The policy is served through the gateway as in training (the config's ``serving``, ``gateway`` and
``runner`` sections), the agent runs on every task ``--samples`` times (default
``validation.rollouts_per_task``) with ``llm.split == "val"`` so agents that follow ``llm.evaluating``
decode greedily, and each task's score is the mean reward of its rollouts (a failed one scores 0):
:func:`~agl_trainer.run.rollouts.score_tasks`, the scorer of the trainer's validation. The rollouts go to a
store in a temporary directory (or to ``store.url``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl_core.records import Span, Task

from .config import ConfigError, PolicyConfig, TrainerConfig, add_override_argument, load_config
from .reporting.display import held_out_line
from .reporting.results import EvalResult
from .run.data import DatasetError, find_task_file, load_splits, load_tasks
from .run.rollouts import RolloutQueue, ScoredRollout, score_tasks
from .run.signals import stop_on_signals
from .saved import Checkpoint, find_checkpoint
from .stats import mean_se, paired_change

if TYPE_CHECKING:
    from agl_core.gateway.prompts import PromptPolicy
    from agl_core.plugins import CliCommand

    from .run.services import Services

__all__ = [
    "EVAL_COMMAND",
    "Checkpoint",
    "EvalError",
    "Evaluation",
    "PolicyScore",
    "check_field",
    "evaluate",
    "find_checkpoint",
    "per_field_table",
    "report",
    "write_task_scores",
]


class EvalError(ValueError):
    """An evaluation cannot run as asked (a missing checkpoint, a task field no task has); the message
    says what to pass instead."""


@dataclasses.dataclass(frozen=True)
class PolicyScore:
    """One policy's score: what was scored, the result, every rollout behind it (in task order) and,
    when asked for, each rollout's spans by rollout id."""

    policy: str
    result: EvalResult
    rollouts: list[ScoredRollout]
    spans: dict[str, list[Span]]


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """:func:`evaluate`'s answer: the tasks, the policy's score and, when asked for, the baseline's."""

    tasks: list[Task]
    score: PolicyScore
    baseline: PolicyScore | None = None

    @property
    def result(self) -> EvalResult:
        return self.score.result


class _Progress:
    """Rollout progress for :class:`~agl_trainer.run.rollouts.RolloutQueue`: lines only."""

    def __init__(self, echo: Callable[[str], None]) -> None:
        self.line = echo

    def rollouts(self, label: str, done: int, failed: int, total: int) -> None:
        pass


def _quiet(line: str) -> None:
    pass


#: What an agent may see as ``llm.split``.
SPLITS = ("val", "train")


def _choose_tasks(
    config: TrainerConfig, tasks: Sequence[Task] | str | Path | None, limit: int | None
) -> list[Task]:
    # both the Python API and the command come through here, so the bound is checked in one place
    if limit is not None and limit < 1:
        raise EvalError(f"limit must be at least 1, got {limit}")
    if tasks is None:
        chosen = load_splits(config.tasks)[1] if config.tasks is not None else []
        if not chosen:
            raise EvalError(
                "the config has no validation split (tasks.val or tasks.val_fraction); pass a task file"
                " (--tasks FILE)"
            )
        limit = limit or config.validation.max_tasks
    elif isinstance(tasks, (str, Path)):
        chosen = load_tasks(find_task_file(tasks, config.base_dir))
    else:
        chosen = list(tasks)
    return chosen[:limit] if limit else chosen


def _check_policies(policies: Sequence[PolicyConfig], checkpoint: Checkpoint) -> None:
    """Refuse a checkpoint whose adapters do not fit the config's policies (one adapter per policy, or
    one shared adapter without policies)."""
    names = [p.name for p in policies]
    if checkpoint.adapters and not names:
        raise EvalError(
            f"{checkpoint.path} holds one adapter per policy ({', '.join(checkpoint.adapters)}); evaluate it"
            " with the config of its run (its policies: route each agent to its adapter)"
        )
    if names and not checkpoint.adapters:
        raise EvalError(
            f"{checkpoint.path} holds one shared policy, and the config has policies ({', '.join(names)});"
            " evaluate it with a config without policies:"
        )
    missing = [n for n in names if n not in checkpoint.adapters]
    if missing:
        raise EvalError(
            f"{checkpoint.path} holds no adapter of policy {missing[0]!r} (it has"
            f" {', '.join(checkpoint.adapters)}); evaluate it with the policies of its run"
        )


def _serve_checkpoint(services: Services, checkpoint: Checkpoint) -> None:
    """Serve ``checkpoint`` from the next request on, under its policy version (or the next one)."""
    from agl_core.gateway.backend import PolicyUpdate

    from .run.serving import HFServing

    serving = services.serving
    version = max(checkpoint.policy_version or 0, serving.policy_version + 1)
    if checkpoint.adapters:
        serving.publish_adapters(checkpoint.adapters, version)
    elif checkpoint.adapter is not None:
        serving.publish_adapter(checkpoint.adapter, version)
    elif isinstance(serving, HFServing):
        serving.backend.load_policy(PolicyUpdate(version, str(checkpoint.path), "full"))
    else:
        raise EvalError(
            f"{checkpoint.path} holds full weights, and vLLM serving loads LoRA adapters only; evaluate it"
            " with --set serving.backend=hf"
        )
    services.publish()


def evaluate(
    config: TrainerConfig,
    *,
    tasks: Sequence[Task] | str | Path | None = None,
    checkpoint: str | Path | None = None,
    baseline: bool | str | Path = False,
    samples: int | None = None,
    limit: int | None = None,
    split: str = "val",
    keep_spans: bool = False,
    store: str | Path | None = None,
    prompts: Sequence[PromptPolicy] = (),
    echo: Callable[[str], None] = _quiet,
) -> Evaluation:
    """Score a policy on ``tasks`` (a task file, relative to the working directory or else to the
    config's folder; tasks; or by default the config's validation split cut to ``validation.max_tasks``;
    ``limit``: only the first N) with ``samples`` rollouts per task (default
    ``validation.rollouts_per_task``).

    The policy is the base model, or ``checkpoint`` (see :func:`find_checkpoint`). ``baseline`` scores
    a second policy first on the same tasks: ``True`` the base model, a path another checkpoint.
    ``split`` is what agents see as ``llm.split`` (``"val"``: ``llm.evaluating``, greedy decoding).
    ``keep_spans`` keeps every rollout's spans in the answer; ``store`` keeps the rollouts and their
    spans in that SQLite file (for ``agl inspect``) instead of a temporary one. ``prompts``: prompt
    policies (:mod:`agl_core.gateway.prompts`) the gateway applies while the policy is scored, not while
    the baseline is (with prompts, ``baseline=True`` without a checkpoint is the same model without
    them). ``echo`` gets progress
    lines (services started, failed rollouts). Raises :class:`EvalError` (or
    :class:`~agl_trainer.run.data.DatasetError`) for bad input before anything starts.
    """
    from agl_core.runner import load_agent, resolve_mode

    from .run.services import load_served_model, start_runners, start_services, start_store

    if samples is not None and samples < 1:
        raise EvalError(f"samples must be at least 1, got {samples}")
    if split not in SPLITS:
        raise EvalError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if store is not None and config.store.url:
        raise EvalError(
            f"the config sends rollouts to store.url {config.store.url}; drop --store, or that key"
        )
    chosen = _choose_tasks(config, tasks, limit)
    policies = _policies_to_score(config, checkpoint, baseline, prompts)
    if config.agent is None:
        raise EvalError("the config names no agent: set 'agent: module:function' in it")
    agent = load_agent(config.agent, search_paths=(config.base_dir,))
    resolve_mode(agent, config.runner.mode)  # a bad agent or mode fails before anything starts
    per_task = samples or config.validation.rollouts_per_task

    scores: list[PolicyScore] = []
    with ExitStack() as stack:
        if store is None:
            store = (
                Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agl-eval-"))) / "store.sqlite"
            )
        connection = start_store(config.store, stack, file=Path(store), echo=echo)
        model, tokenizer = load_served_model(config, echo=echo)
        services = start_services(config, stack, connection, model=model, tokenizer=tokenizer, echo=echo)
        queue = RolloutQueue(
            services.client,
            _Progress(echo),
            step_timeout_s=config.runner.step_timeout_s,
            flush=services.flush,
        )
        start_runners(config, services, agent, stack, echo=echo)
        for i, (label, policy) in enumerate(policies):
            if policy is not None:
                _serve_checkpoint(services, policy)
            if prompts and i == len(policies) - 1:  # the scored policy's pass, after any baseline's
                _apply_prompts(services, prompts)
            scored = score_tasks(
                queue,
                chosen,
                step=(policy.step or 0) if policy is not None else 0,
                rollouts_per_task=per_task,
                max_attempts=config.runner.max_attempts,
                split=split,
                label=f"eval {label}",
                keep_spans=keep_spans,
            )
            scores.append(PolicyScore(label, scored.result, scored.rollouts, scored.spans))
    return Evaluation(chosen, scores[-1], scores[0] if len(scores) > 1 else None)


def _policies_to_score(
    config: TrainerConfig,
    checkpoint: str | Path | None,
    baseline: bool | str | Path,
    prompts: Sequence[PromptPolicy],
) -> list[tuple[str, Checkpoint | None]]:
    """``(label, checkpoint or None for the base model)`` of each pass, the baseline's first; checked
    against the config's policies before anything starts."""
    target = find_checkpoint(checkpoint) if checkpoint is not None else None
    if target is not None:
        _check_policies(config.policies, target)
    policies: list[tuple[str, Checkpoint | None]] = []
    if baseline is not False:
        if target is None and not prompts:
            raise EvalError(
                "a baseline is compared with a checkpoint or a prompt; pass --checkpoint DIR or --prompt FILE"
            )
        base = None if baseline is True else find_checkpoint(baseline)
        if base is not None:
            _check_policies(config.policies, base)
        if base is not None and target is not None and (base.adapter is None) != (target.adapter is None):
            raise EvalError(
                f"{base.path} and {target.path} hold different kinds of weights (a LoRA adapter and full"
                " weights); compare checkpoints of the same kind, or each with the base model"
            )
        policies.append((base.describe() if base else f"{config.model.source} (base model)", base))
    label = target.describe() if target else f"{config.model.source} (base model)"
    if prompts:
        label += " with prompt " + ", ".join(f"v{p.version} ({p.agent or 'every agent'})" for p in prompts)
    policies.append((label, target))
    return policies


def _apply_prompts(services: Services, prompts: Sequence[PromptPolicy]) -> None:
    """Publish ``prompts`` to the job's own gateway (its admin API, as a production gateway takes them)."""
    import httpx

    for prompt in prompts:
        answer = httpx.post(services.gateway.url + "/agl/v1/prompt", json=prompt.to_json(), timeout=30)
        if answer.status_code != 200:
            raise EvalError(f"the gateway refused prompt v{prompt.version}: {answer.text[:300]}")


def read_prompts(path: str | Path) -> list[PromptPolicy]:
    """The prompt policies in the JSON file ``path`` (one object, as ``POST /agl/v1/prompt`` takes, or a
    list of them, one per agent); :class:`EvalError` naming the file and what is wrong."""
    from agl_core.gateway.prompts import parse_prompt_policy

    file = Path(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise EvalError(f"--prompt {file}: cannot read it as JSON: {exc}") from None
    items = data if isinstance(data, list) else [data]
    if not items:
        raise EvalError(f"--prompt {file}: the list holds no prompt")
    prompts: list[PromptPolicy] = []
    for i, item in enumerate(items):
        try:
            prompts.append(parse_prompt_policy(item))
        except ValueError as exc:
            where = f" (item {i})" if isinstance(data, list) else ""
            raise EvalError(f"--prompt {file}{where}: {exc}") from None
    agents = [p.agent for p in prompts]
    if len(set(agents)) != len(agents):
        raise EvalError(f"--prompt {file}: two prompts for the same agent; give one per agent")
    return prompts


def _field_value(task: Task, field: str) -> str:
    value = task.input.get(field) if isinstance(task.input, dict) else None
    return "(missing)" if value is None else str(value)


def check_field(tasks: Sequence[Task], field: str) -> None:
    """Raise :class:`EvalError` unless some task's input has ``field``."""
    if any(isinstance(t.input, dict) and field in t.input for t in tasks):
        return
    known = sorted({k for t in tasks if isinstance(t.input, dict) for k in t.input})
    raise EvalError(f"no task has a field {field!r}; the tasks' fields are: {', '.join(known) or '(none)'}")


def per_field_table(evaluation: Evaluation, field: str) -> str:
    """The per-task scores grouped by the tasks' ``field``: tasks, mean ± SE per value (and, with a
    baseline, its mean ± SE and the paired change), values in sorted order."""
    groups: dict[str, list[str]] = defaultdict(list)
    for task in evaluation.tasks:
        groups[_field_value(task, field)].append(task.task_id)
    after = evaluation.result
    before = evaluation.baseline.result if evaluation.baseline is not None else None
    rows = [[field, "tasks", "score"] + (["baseline", "change"] if before is not None else [])]
    for value in sorted(groups):
        ids = [t for t in groups[value] if t in after.task_scores]
        mean, se = mean_se([after.task_scores[t] for t in ids])
        row = [value, str(len(groups[value])), f"{mean:.3f} ± {se:.3f}"]
        if before is not None:
            common = [t for t in ids if t in before.task_scores]
            b_mean, b_se = mean_se([before.task_scores[t] for t in common])
            paired = paired_change(
                {t: before.task_scores[t] for t in common}, {t: after.task_scores[t] for t in common}
            )
            row += [f"{b_mean:.3f} ± {b_se:.3f}", f"{paired.change:+.3f} ± {paired.se:.3f}"]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    )


def write_task_scores(evaluation: Evaluation, path: Path) -> None:
    """One JSON line per task: its id, score, each rollout's reward, status and id, the baseline's score
    when there is one, and the task's input."""
    rollouts: dict[str, list[ScoredRollout]] = defaultdict(list)
    for r in evaluation.score.rollouts:
        rollouts[r.task_id].append(r)
    with path.open("w", encoding="utf-8") as fh:
        for task in evaluation.tasks:
            row: dict[str, Any] = {
                "task_id": task.task_id,
                "score": evaluation.result.task_scores.get(task.task_id),
                "rewards": [r.reward for r in rollouts[task.task_id]],
                "statuses": [r.status.value for r in rollouts[task.task_id]],
                "rollout_ids": [r.rollout_id for r in rollouts[task.task_id]],
            }
            if evaluation.baseline is not None:
                row["baseline_score"] = evaluation.baseline.result.task_scores.get(task.task_id)
            row["input"] = task.input
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def report(evaluation: Evaluation) -> list[str]:
    """The lines ``agl eval`` prints: each policy's mean ± SE and n, then (with a baseline) the paired
    before/after line ``agl train`` ends with."""
    lines = []
    if evaluation.baseline is not None:
        lines.append(f"{evaluation.baseline.policy}: {evaluation.baseline.result.describe()}")
    lines.append(f"{evaluation.score.policy}: {evaluation.result.describe()}")
    if evaluation.baseline is not None:
        lines.append(held_out_line(evaluation.baseline.result, evaluation.result))
    return lines


def _fail(message: str) -> int:
    print(f"agl eval: {message}", file=sys.stderr)
    return 2


def _stopped(terminated: bool, store: str | None) -> int:
    """The closing line of an evaluation stopped by Ctrl-C or SIGTERM; its exit status (130, 143)."""
    how = "terminated (SIGTERM)" if terminated else "interrupted"
    kept = f"the rollouts that finished are in {store}" if store else "no score was computed or written"
    print(f"agl eval: {how} before it finished; {kept}; run it again to score", file=sys.stderr)
    return 143 if terminated else 130


class EvalCommand:
    """``agl eval``: the ``agl`` subcommand (an entry point in the ``agl.commands`` group, implementing
    :class:`agl_core.plugins.CliCommand`); it imports torch only when it runs."""

    name = "eval"
    help = "score a policy (the base model or a checkpoint) on a task file, as validation does"
    extra = "trainer"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("config", help="path of the trainer's YAML config")
        parser.add_argument(
            "--tasks",
            metavar="FILE",
            help="JSONL or Parquet task file, relative to the working directory or else to the config's"
            " folder (default: the config's validation split)",
        )
        parser.add_argument(
            "--checkpoint",
            metavar="DIR",
            help="score this checkpoint (a checkpoints/step-N directory, an adapter directory, or a run's"
            " output_dir for its newest) instead of the base model",
        )
        parser.add_argument(
            "--baseline",
            nargs="?",
            const=True,
            default=False,
            metavar="DIR",
            help="also score the base model (or checkpoint DIR) and print the paired before/after change",
        )
        parser.add_argument(
            "--samples",
            type=int,
            metavar="N",
            help="rollouts per task (default: validation.rollouts_per_task)",
        )
        parser.add_argument("--limit", type=int, metavar="N", help="only the first N tasks")
        parser.add_argument(
            "--split",
            default="val",
            choices=SPLITS,
            help="what the agent sees as llm.split (default: val, greedy in agents that follow"
            " llm.evaluating; train samples as in training)",
        )
        parser.add_argument(
            "--per-field", metavar="FIELD", help="also print the scores grouped by a task field"
        )
        parser.add_argument("--output", metavar="FILE.jsonl", help="write one JSON line per task")
        parser.add_argument(
            "--prompt",
            metavar="FILE.json",
            help="score with these prompt policies applied by the gateway (one JSON object as POST"
            " /agl/v1/prompt takes, or a list, one per agent); with --baseline, against the same model"
            " without them",
        )
        parser.add_argument(
            "--store",
            metavar="FILE",
            help="keep the rollouts and their spans in this SQLite file, for agl inspect (default: a"
            " temporary one)",
        )
        add_override_argument(parser, "serving.backend=hf")

    def run(self, args: argparse.Namespace) -> int:
        try:
            config = load_config(args.config, args.overrides)
        except ConfigError as exc:
            return _fail(str(exc))
        from .model import ModelNotFoundError
        from .requirements import check_requirements

        try:
            check_requirements(config)
            tasks = _choose_tasks(config, args.tasks, args.limit)
            if args.per_field:
                check_field(tasks, args.per_field)
            if args.output and not Path(args.output).parent.is_dir():
                # found now, not after the whole evaluation has run
                raise EvalError(
                    f"--output {args.output}: the folder {Path(args.output).parent} does not exist"
                )
            for path in (args.checkpoint, args.baseline if isinstance(args.baseline, str) else None):
                if path is not None:
                    find_checkpoint(path)
            prompts = read_prompts(args.prompt) if args.prompt else []
        except (EvalError, DatasetError, ModelNotFoundError, ValueError) as exc:
            return _fail(str(exc).replace("\n", " "))
        with stop_on_signals() as received:
            try:
                evaluation = evaluate(
                    config,
                    tasks=tasks,
                    checkpoint=args.checkpoint,
                    baseline=args.baseline,
                    samples=args.samples,
                    split=args.split,
                    store=args.store,
                    prompts=prompts,
                    echo=lambda line: print(line, file=sys.stderr, flush=True),
                )
            except BaseException as exc:
                # a signal's exception may surface wrapped: what was received decides
                if received or isinstance(exc, KeyboardInterrupt):
                    return _stopped(signal.SIGTERM in received, args.store)
                if isinstance(exc, (EvalError, DatasetError, ModelNotFoundError, ValueError)):
                    return _fail(str(exc).replace("\n", " "))
                raise
        for line in report(evaluation):
            print(line)
        if args.per_field:
            print(per_field_table(evaluation, args.per_field))
        if args.output:
            write_task_scores(evaluation, Path(args.output))
            print(f"per-task scores: {args.output}")
        return 0

    def main(self, argv: Sequence[str] | None = None) -> int:
        """Run as a program of its own: ``python -m agl_trainer.evaluate CONFIG ...``."""
        parser = argparse.ArgumentParser(prog="agl eval", description=self.help)
        self.add_arguments(parser)
        return self.run(parser.parse_args(argv))


#: The ``agl eval`` command.
EVAL_COMMAND: CliCommand = EvalCommand()

if __name__ == "__main__":
    raise SystemExit(EvalCommand().main())
