"""Task datasets: JSONL or Parquet files, a validation split, and a resumable sampler over epochs."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agl_core.records import Task

from ..config import TasksConfig
from ..config.data import TaskFilterConfig

__all__ = [
    "DatasetError",
    "TaskSampler",
    "filter_tasks",
    "find_task_file",
    "load_splits",
    "load_tasks",
    "read_task_scores",
    "split_tasks",
    "tasks_from_records",
]


class DatasetError(ValueError):
    """A task file cannot be used; the message names the file and the row."""


def _task(item: Any, where: str, row: int, seen: set[str]) -> Task:
    if not isinstance(item, dict):
        raise DatasetError(f"{where}: each task must be a JSON object, got {type(item).__name__}")
    task_id = str(item["id"]) if item.get("id") is not None else f"row-{row}"
    if task_id in seen:
        raise DatasetError(f"{where}: duplicate task id {task_id!r}; task ids must be unique within a file")
    seen.add(task_id)
    return Task(task_id, item)


def _read_jsonl(path: Path) -> list[Task]:
    tasks: list[Task] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not valid JSON: {exc}") from None
            tasks.append(_task(item, f"{path}:{number}", number, seen))
    return tasks


def _read_parquet(path: Path) -> list[Task]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow: pip install 'agl[parquet]'") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for a broken file
        raise DatasetError(f"{path}: not a readable Parquet file: {exc}") from None
    seen: set[str] = set()
    return [_task(_plain(row), f"{path} row {i}", i, seen) for i, row in enumerate(rows, start=1)]


def _plain(value: Any) -> Any:
    """Parquet values as JSON-able Python (dates and decimals become strings): what an agent would get
    from the same task in JSONL, and what the store can keep."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def find_task_file(path: str | Path, base_dir: Path) -> Path:
    """``path`` relative to the working directory when a file is there, else relative to ``base_dir`` (a
    config's folder, as the config names its own task files) when one is there; else ``path`` as given."""
    path = Path(path)
    if not path.is_file() and not path.is_absolute() and (base_dir / path).is_file():
        return base_dir / path
    return path


def load_tasks(path: str | Path) -> list[Task]:
    """Tasks from a ``.jsonl`` file (one JSON object per line) or a ``.parquet`` file (one per row)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"task file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        tasks = _read_jsonl(path)
    elif suffix == ".parquet":
        tasks = _read_parquet(path)
    else:
        raise DatasetError(f"{path}: task files must be .jsonl or .parquet")
    if not tasks:
        raise DatasetError(f"{path}: no tasks")
    return tasks


def tasks_from_records(items: Sequence[Mapping[str, Any] | Task], where: str = "tasks") -> list[Task]:
    """Tasks given in memory: each a JSON-able dict (its ``id``, when present, is the task id, as in a
    file) or a :class:`~agl_core.records.Task`. ``where`` names the list in errors (``train[3]: ...``).

    Raises :class:`DatasetError` for an empty list, an item that is neither, an input that cannot travel
    through the store as JSON, or a repeated task id.
    """
    if not items:
        raise DatasetError(f"{where}: no tasks (the list is empty)")
    tasks: list[Task] = []
    seen: set[str] = set()
    for number, item in enumerate(items):
        at = f"{where}[{number}]"
        if isinstance(item, Task):
            if item.task_id in seen:
                raise DatasetError(f"{at}: duplicate task id {item.task_id!r}; task ids must be unique")
            seen.add(item.task_id)
            task = item
        else:
            task = _task(item, at, number + 1, seen)
        try:
            json.dumps(task.input, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise DatasetError(
                f"{at}: the task cannot be sent to the agent as JSON ({exc}); use only dicts, lists, strings,"
                " finite numbers, booleans and None"
            ) from None
        tasks.append(task)
    return tasks


def split_tasks(
    train: list[Task],
    val: list[Task] | None,
    *,
    val_fraction: float | None = None,
    split_seed: int = 0,
    names: tuple[str, str] = ("train", "val"),
) -> tuple[list[Task], list[Task]]:
    """The training and validation tasks: ``val`` when given (no id may be in both), else the
    ``val_fraction`` of ``train`` held out (chosen once by ``split_seed``), else none. ``names`` name the
    two sources in errors (their files, say)."""
    if val is not None:
        overlap = {t.task_id for t in train} & {t.task_id for t in val}
        if overlap:
            sample = ", ".join(sorted(overlap)[:3])
            raise DatasetError(
                f"{len(overlap)} task id(s) are in both {names[0]} and {names[1]} (e.g. {sample}); "
                "validation tasks must be held out"
            )
        return train, val
    if val_fraction is not None:
        n_val = max(1, round(len(train) * val_fraction))
        if n_val >= len(train):
            raise DatasetError(
                f"{names[0]}: val_fraction {val_fraction} of {len(train)} tasks leaves none to train on"
            )
        order = list(range(len(train)))
        random.Random(split_seed).shuffle(order)
        held = set(order[:n_val])
        return [t for i, t in enumerate(train) if i not in held], [
            t for i, t in enumerate(train) if i in held
        ]
    return train, []


def load_splits(config: TasksConfig) -> tuple[list[Task], list[Task]]:
    """The training and validation tasks the config names (validation empty when it names none), the
    training tasks passed through ``tasks.filter`` when it is set."""
    train, val = split_tasks(
        load_tasks(config.train),
        load_tasks(config.val) if config.val is not None else None,
        val_fraction=config.val_fraction,
        split_seed=config.split_seed,
        names=(str(config.train), str(config.val)),
    )
    if config.filter is not None:
        train = filter_tasks(train, config.filter)
    return train, val


def read_task_scores(path: Path) -> dict[str, float | None]:
    """Task id -> score from a JSONL file of ``{"task_id": ..., "score": ...}`` lines (``agl eval
    --output``); a score of ``null`` (no rollout of the task finished) stays ``None``."""
    scores: dict[str, float | None] = {}
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: not JSON ({exc.msg})") from None
            task_id = row.get("task_id") if isinstance(row, dict) else None
            if not isinstance(task_id, str) or not task_id:
                raise DatasetError(
                    f"{where}: each line needs a task_id (a string), as agl eval --output writes"
                )
            score = row.get("score")
            if score is not None and (
                isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score)
            ):
                raise DatasetError(f"{where}: score {score!r} is not a finite number (or null)")
            if task_id in scores:
                raise DatasetError(f"{where}: task {task_id!r} is scored twice")
            scores[task_id] = None if score is None else float(score)
    return scores


def filter_tasks(tasks: Sequence[Task], rule: TaskFilterConfig) -> list[Task]:
    """The tasks whose score in ``rule.scores`` lies strictly between ``rule.above`` and ``rule.below``
    (unscored ones as ``rule.unscored`` says). :class:`DatasetError` when none is left, with the counts."""
    scores = read_task_scores(rule.scores)
    kept: list[Task] = []
    low = high = unscored = 0
    for task in tasks:
        score = scores.get(task.task_id)
        if score is None:
            unscored += 1
            if rule.unscored == "keep":
                kept.append(task)
        elif score <= rule.above:
            low += 1
        elif score >= rule.below:
            high += 1
        else:
            kept.append(task)
    if not kept:
        raise DatasetError(
            f"tasks.filter leaves no training task: of {len(tasks)}, {low} scored <= {rule.above}, {high}"
            f" scored >= {rule.below} and {unscored} have no score in {rule.scores}"
            f"{' (dropped: unscored is drop)' if rule.unscored == 'drop' else ''}; widen above/below, or"
            " measure the scores with more --samples so that more tasks land in between"
        )
    return kept


class TaskSampler:
    """Draws training tasks epoch by epoch: each epoch visits every task once, in an order fixed by
    ``seed`` and the epoch number. Its state (epoch, position) is two integers, so a resumed run draws
    exactly the tasks the uninterrupted run would have."""

    def __init__(self, tasks: Sequence[Task], seed: int = 0) -> None:
        if not tasks:
            raise ValueError("TaskSampler needs at least one task")
        self.tasks = list(tasks)
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def sample(self, n: int) -> list[Task]:
        """The next ``n`` tasks (distinct when ``n`` <= the number of tasks, crossing into the next epoch
        when the current one runs out)."""
        out: list[Task] = []
        while len(out) < n:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._shuffled(self.epoch)
            task = self.tasks[self._order[self.position]]
            self.position += 1
            if len(out) < len(self.tasks) and any(t.task_id == task.task_id for t in out):
                continue  # an epoch boundary inside one draw: keep this step's tasks distinct
            out.append(task)
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": len(self.tasks)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("size") != len(self.tasks) or state.get("seed") != self.seed:
            raise ValueError(
                f"the checkpoint's data position is for {state.get('size')} tasks with seed"
                f" {state.get('seed')}, but the config gives {len(self.tasks)} tasks with seed {self.seed};"
                " resume with the same task file and train.seed"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._shuffled(self.epoch)
