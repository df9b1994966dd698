"""Training from Python: :class:`Trainer`, the same job as ``agl train`` and ``agl dev`` without a config
file or an importable agent module.

    trainer = Trainer({"output_dir": "runs/x", "model": {"source": "smollm2"}}, echo=print)
    trainer.dev(solve, tasks)               # a few rollouts, no update: why each would not train
    result = trainer.fit(solve, tasks[:40], val=tasks[40:])
    print(result.summary())

The config is validated when the :class:`Trainer` is built, as ``agl train`` validates a file; the agent
function and the tasks are checked when :meth:`Trainer.fit` or :meth:`Trainer.dev` is called, before
anything starts. The agent runs in this process (runner mode ``thread`` or ``async``), so it may be
defined anywhere, a notebook included; ``runner.mode: process`` needs one a new process can import.

Nothing heavy is imported here: torch and the services load when a job starts.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from agl_core.records import Task

from .config import TrainerConfig, config_from_dict, load_config
from .dev import DEFAULT_ROLLOUTS
from .reporting.display import dev_lines, held_out_line
from .reporting.results import DevResult, EvalResult, StepMetrics
from .run.data import load_tasks, split_tasks, tasks_from_records
from .stats import paired_change

if TYPE_CHECKING:
    from .run.loop import RunResult
    from .run.services import AgentFn

__all__ = ["ConfigSource", "FitResult", "TaskSource", "Trainer"]

logger = logging.getLogger(__name__)

#: A config: a dict (the YAML's contents; relative paths from the working directory), the path of a YAML
#: file (relative paths from its folder), or a validated :class:`~agl_trainer.config.TrainerConfig`.
ConfigSource: TypeAlias = "TrainerConfig | Mapping[str, Any] | str | os.PathLike[str]"
#: Tasks: a list of JSON-able dicts (``id``, when present, is the task id) or
#: :class:`~agl_core.records.Task` records, or the path of a ``.jsonl`` / ``.parquet`` task file.
TaskSource: TypeAlias = "Sequence[Mapping[str, Any] | Task] | str | os.PathLike[str]"


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What :meth:`Trainer.fit` did and left behind (paths are absolute)."""

    #: The run's folder (``output_dir``).
    output_dir: Path
    #: ``metrics.jsonl``: one line per step and per validation.
    metrics: Path
    #: The newest checkpoint (``output_dir/checkpoints/step-N``); ``None`` when no step trained (or the
    #: verl update keeps its own).
    checkpoint: Path | None
    #: The SQLite file of the embedded store (every span); ``None`` with ``store.url``.
    store: Path | None
    #: ``reward_curve.png``; ``None`` with ``logging.plot: false`` or without matplotlib.
    plot: Path | None
    #: Training steps this call ran (fewer than ``train.steps`` when it resumed a run).
    steps: int
    #: Held-out score before the first step and after the last (mean ± SE over the validation tasks);
    #: ``None`` without a validation split, or with ``validation.before`` / ``after`` off.
    before: EvalResult | None
    after: EvalResult | None
    #: ``after - before`` over the tasks both scored, and its paired standard error (as ``agl train``
    #: prints); ``None`` unless both scores are there.
    change: float | None
    change_se: float | None
    #: Each step's metrics, as in ``metrics.jsonl``.
    history: tuple[StepMetrics, ...]

    @classmethod
    def of_run(cls, config: TrainerConfig, run: RunResult) -> FitResult:
        """The result of ``run``, a finished :func:`~agl_trainer.run.loop.train` of ``config``."""
        from .run.run_context import METRICS_FILE

        out = config.output_dir.absolute()
        change = change_se = None
        if run.before is not None and run.after is not None:
            paired = paired_change(run.before.task_scores, run.after.task_scores)
            change, change_se = paired.change, paired.se
        return cls(
            output_dir=out,
            metrics=out / METRICS_FILE,
            checkpoint=run.checkpoint.absolute() if run.checkpoint is not None else None,
            store=None if config.store.url else out / config.store.path,
            plot=run.plot.absolute() if run.plot is not None else None,
            steps=len(run.history),
            before=run.before,
            after=run.after,
            change=change,
            change_se=change_se,
            history=tuple(run.history),
        )

    def summary(self) -> str:
        """The lines ``agl train`` ends with: the held-out scores (before -> after, the paired change),
        the checkpoint and where the metrics are."""
        lines = []
        if self.before is not None and self.after is not None:
            lines.append(held_out_line(self.before, self.after))
        elif self.after is not None or self.before is not None:
            label, score = ("after", self.after) if self.after is not None else ("before", self.before)
            assert score is not None
            lines.append(f"held-out reward {label} training: {score.describe()}")
        lines.append(f"steps: {self.steps}")
        lines.append(f"checkpoint: {self.checkpoint or 'none (no step trained)'}")
        lines.append(f"metrics: {self.metrics}")
        return "\n".join(lines)


class Trainer:
    """A training job from Python: :meth:`fit` trains as ``agl train`` does, :meth:`dev` runs a few
    rollouts without training as ``agl dev`` does.

    ``config`` is a dict, the path of a YAML file, or a :class:`~agl_trainer.config.TrainerConfig`,
    validated here with the same messages as ``agl train`` (an unknown key is named, with the key meant);
    its ``agent`` and ``tasks`` may be left out when :meth:`fit` and :meth:`dev` are given them.
    ``overrides`` are ``--set`` style ``key.sub=value`` strings. ``echo`` gets the progress lines a run
    prints under ``agl train`` (``print`` shows them); by default they go to this module's logger at INFO
    level. Raises :class:`~agl_trainer.config.ConfigError` for a bad config, ``TypeError`` for a bad
    argument.
    """

    def __init__(
        self,
        config: ConfigSource,
        *,
        overrides: Sequence[str] = (),
        echo: Callable[[str], None] | None = None,
    ) -> None:
        if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
            raise TypeError(f"overrides must be a list of 'key.sub=value' strings, got {overrides!r}")
        if echo is not None and not callable(echo):
            raise TypeError(f"echo must be a function taking a line of text (print, say), got {echo!r}")
        if isinstance(config, TrainerConfig):
            if overrides:
                data = config.model_dump(exclude_unset=True, exclude={"base_dir"})
                config = config_from_dict(data, overrides, base_dir=config.base_dir, required=())
            self._config = config
        elif isinstance(config, Mapping):
            self._config = config_from_dict(config, overrides, required=())
        elif isinstance(config, (str, os.PathLike)):
            self._config = load_config(Path(config), overrides, required=())
        else:
            raise TypeError(
                "config must be a dict, the path of a YAML config file or a TrainerConfig, got"
                f" {type(config).__name__}"
            )
        self._echo = echo

    @property
    def config(self) -> TrainerConfig:
        """The validated config (``agent`` and ``tasks`` as the config gave them, possibly ``None``)."""
        return self._config

    def fit(
        self,
        agent: AgentFn | None = None,
        train: TaskSource | None = None,
        val: TaskSource | None = None,
        *,
        resume: bool = False,
        overwrite: bool = False,
    ) -> FitResult:
        """Train as ``agl train`` does and return what the run did (:class:`FitResult`).

        ``agent`` is the agent function, ``agent(task, llm) -> reward`` or ``async def`` (the runner calls
        it in this process, so it need not be importable); ``train`` and ``val`` are the training and
        held-out tasks (:data:`TaskSource`). Each replaces the config's ``agent``, ``tasks.train`` and
        ``tasks.val`` when given; a ``tasks.val_fraction`` in the config splits the ``train`` given when
        no ``val`` is. ``resume`` continues the run in ``output_dir`` from its newest checkpoint (give the
        same tasks); ``overwrite`` starts it over. Bad input raises before anything starts: ``TypeError``
        (an agent that is not a function of two arguments, tasks neither a list nor a path),
        :class:`~agl_trainer.run.data.DatasetError` (bad tasks), ``ValueError`` (a runner mode that cannot
        run the agent, an existing run in ``output_dir``). A run in which no step trained raises
        :class:`~agl_trainer.run.loop.NothingTrainedError`, as ``agl train`` exits 1.
        """
        from .run.loop import train as run_training
        from .run.offline import train_from_traces

        agent_fn = _checked_agent(agent)
        config = self._config_for(agent_fn)
        tasks = self._splits(train, val) if train is not None or val is not None else None
        if tasks is not None:
            config = config.model_copy(update={"tasks": None})
        if self._echo is None and config.logging.progress == "auto":
            # no live display on the terminal: its lines go to the logger
            config = config.model_copy(
                update={"logging": config.logging.model_copy(update={"progress": "plain"})}
            )
        run = (run_training if config.traces is None else train_from_traces)(
            config,
            echo=self._progress,
            resume=resume,
            overwrite=overwrite,
            agent=agent_fn,
            tasks=tasks,
        )
        return FitResult.of_run(config, run)

    def dev(
        self,
        agent: AgentFn | None = None,
        tasks: TaskSource | None = None,
        *,
        n: int = DEFAULT_ROLLOUTS,
        store: str | os.PathLike[str] | None = None,
    ) -> DevResult:
        """Run ``n`` rollouts through the whole pipeline (store, gateway, runner, spans -> transitions ->
        credit) without an update, as ``agl dev`` does, print the report (to ``echo``, else stdout) and
        return it.

        ``agent`` and ``tasks`` replace the config's (default: its training tasks); rollout ``k`` runs task
        ``k % len(tasks)``. ``store`` keeps the rollouts and their spans in that SQLite file for
        ``agl inspect`` (default: a temporary one). Bad input raises as :meth:`fit` does, before anything
        starts; ``n`` below 1 raises ``ValueError``.
        """
        from .dev import run_dev

        agent_fn = _checked_agent(agent)
        config = self._config_for(agent_fn)
        chosen = _tasks(tasks, "tasks") if tasks is not None else None
        result = run_dev(
            config,
            agent=agent_fn,
            tasks=chosen,
            n=n,
            store=None if store is None else Path(store),
            echo=self._progress,
        )
        report = self._echo or print
        for line in dev_lines(result):
            report(line)
        return result

    def _progress(self, line: str) -> None:
        if self._echo is not None:
            self._echo(line)
        else:
            logger.info("%s", line)

    def _config_for(self, agent: AgentFn | None) -> TrainerConfig:
        """The config with the agent given here replacing its own."""
        return self._config if agent is None else self._config.model_copy(update={"agent": None})

    def _splits(self, train: TaskSource | None, val: TaskSource | None) -> tuple[list[Task], list[Task]]:
        """The training and validation tasks: the ones given, the config's task files for the others."""
        given = self._config.tasks
        if train is not None:
            train_tasks, train_name = _tasks(train, "train"), _name(train, "train")
        elif given is not None:
            train_tasks, train_name = load_tasks(given.train), str(given.train)
        else:
            raise ValueError(
                "no training tasks: pass train (a list of task dicts or a task file), or set tasks"
            )
        if val is not None:
            val_tasks: list[Task] | None = _tasks(val, "val")
            val_name = _name(val, "val")
        elif given is not None and given.val is not None:
            val_tasks, val_name = load_tasks(given.val), str(given.val)
        else:
            val_tasks, val_name = None, "val"
        return split_tasks(
            train_tasks,
            val_tasks,
            val_fraction=given.val_fraction if given is not None and val_tasks is None else None,
            split_seed=given.split_seed if given is not None else 0,
            names=(train_name, val_name),
        )


def _checked_agent(agent: Any) -> AgentFn | None:
    """``agent`` when it is a function the runner can call with ``(task, llm)``; ``TypeError`` if not."""
    if agent is None:
        return None
    if not callable(agent):
        hint = (
            "; to name it as 'module:function', set the config's agent key and leave the argument out"
            if isinstance(agent, str)
            else ""
        )
        raise TypeError(
            f"agent must be a function agent(task, llm) -> reward (or async def), got"
            f" {type(agent).__name__} {agent!r}{hint}"
        )
    checked: AgentFn = agent
    try:
        signature = inspect.signature(agent)
    except (TypeError, ValueError):
        return checked  # no signature to check (some builtins): the runner will tell
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            f"agent {getattr(agent, '__qualname__', agent)!r} must take two arguments, (task, llm);"
            f" its signature is {signature}"
        ) from None
    return checked


def _tasks(source: Any, name: str) -> list[Task]:
    """Tasks from a :data:`TaskSource`; ``name`` (``train``, ``val``) names it in errors."""
    if isinstance(source, (str, os.PathLike)):
        return load_tasks(Path(source))
    if isinstance(source, (list, tuple)):
        return tasks_from_records(source, name)
    hint = " (one task? put it in a list)" if isinstance(source, Mapping) else ""
    raise TypeError(
        f"{name} must be a list of task dicts or the path of a .jsonl or .parquet task file, got"
        f" {type(source).__name__}{hint}"
    )


def _name(source: Any, name: str) -> str:
    return str(source) if isinstance(source, (str, os.PathLike)) else name
