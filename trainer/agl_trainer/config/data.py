"""``tasks`` and ``traces``: what a run trains on, tasks to run or stored rollouts."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import pydantic

from .base import _FiniteFloat, _Strict


class TracesFilterConfig(_Strict):
    """Which stored rollouts a ``traces`` run trains on: every condition given must hold."""

    #: Rollouts whose earliest span started at or after this time (ISO 8601; without a zone: UTC).
    since: datetime | None = None
    #: Rollouts whose earliest span started before this time (ISO 8601; without a zone: UTC).
    until: datetime | None = None
    #: Rollouts with an LLM call by an agent matching one of these names or globs; only those agents'
    #: calls are trained (as ``algorithm.agents``). Empty: all.
    agents: list[str] = []
    #: Only rollouts whose episode reward is at least this (implies ``has_reward: true``).
    reward_min: _FiniteFloat | None = None
    #: ``true``: only rollouts with an episode reward; ``false``: only rollouts without one.
    has_reward: bool | None = None
    #: Only rollouts whose record's metadata ``source`` is this (``import`` for ``agl import``).
    source: str | None = None
    #: Only these rollouts. Empty: all.
    rollout_ids: list[str] = []

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> TracesFilterConfig:
        if self.since is not None and self.until is not None and _utc(self.since) >= _utc(self.until):
            raise ValueError("traces.filter.since must be before traces.filter.until")
        if self.reward_min is not None and self.has_reward is False:
            raise ValueError(
                "traces.filter.reward_min keeps rewarded rollouts only; has_reward: false contradicts it"
            )
        return self


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


class TracesConfig(_Strict):
    """Train on rollouts already in a store instead of running the agent (see docs/traces.md)."""

    #: The store holding the traces: a SQLite file (relative to the config file), ``postgresql://...``, or
    #: a running store's ``http(s)://`` URL.
    store: str = pydantic.Field(min_length=1)
    #: Which rollouts to train on.
    filter: TracesFilterConfig = TracesFilterConfig()
    #: Examples per step: LLM calls with ``algorithm.name: sft``, task groups with the RL algorithms.
    batch_size: int = pydantic.Field(8, ge=1)
    #: Passes over the selected data; when set, the number of steps follows from it and ``train.steps``
    #: may not be set. Unset: ``train.steps`` steps, the data reshuffled at each new pass.
    epochs: int | None = pydantic.Field(None, ge=1, le=1000)
    #: Off-policy RL trains only on calls served by this policy (``model.served_name``, or one of its
    #: versions ``<served_name>-...``) or its base model (``model.source``); other names the same weights
    #: were served under (a production gateway's model name, say) are listed here.
    models: list[str] = []
    #: Off-policy RL: what a rollout's reward is compared with. ``task``: the other rollouts of its task
    #: id (a group, as in GRPO; a task seen once trains nothing). ``agent``: every selected rollout of the
    #: same agents (a per-agent mean over the selection), for production sessions where no task repeats.
    baseline: Literal["task", "agent"] = "task"


class TaskFilterConfig(_Strict):
    """Train only on the tasks whose measured score lies strictly between ``above`` and ``below``: with the
    defaults, the tasks the starting policy solves sometimes but not always (a pass@k filter: a task every
    rollout solves, or none does, gives its group no advantage). The scores are measured before training,
    with the policy the run starts from, e.g. ``agl eval CONFIG --tasks train.jsonl --split train
    --samples 8 --checkpoint WARM_START --output scores.jsonl``.
    """

    #: Per-task scores: a JSONL file with ``task_id`` and ``score`` on each line (``agl eval --output``
    #: writes it), relative to the config file.
    scores: Path
    #: Keep a task only if its score is above this (exclusive).
    above: _FiniteFloat = 0.0
    #: Keep a task only if its score is below this (exclusive).
    below: _FiniteFloat = 1.0
    #: Training tasks the file has no score for: ``drop`` them or ``keep`` them.
    unscored: Literal["drop", "keep"] = "drop"

    @pydantic.model_validator(mode="after")
    def _bounds_in_order(self) -> TaskFilterConfig:
        if self.above >= self.below:
            raise ValueError(
                f"tasks.filter bounds out of order: above ({self.above}) must be below below ({self.below});"
                " a task is kept when above < score < below"
            )
        return self


class TasksConfig(_Strict):
    #: Training tasks: a JSONL file (one JSON object per line) or a Parquet file (one task per row);
    #: an ``id`` field, when present, is the task id.
    train: Path
    #: Held-out tasks in the same formats, never trained on: the validation split.
    val: Path | None = None
    #: Instead of ``val``: hold out this fraction of ``train`` (chosen once by ``split_seed``).
    val_fraction: float | None = pydantic.Field(None, gt=0.0, lt=1.0)
    split_seed: int = 0
    #: Train only on the tasks whose measured score lies in a range (see :class:`TaskFilterConfig`);
    #: validation tasks are never filtered.
    filter: TaskFilterConfig | None = None

    @pydantic.model_validator(mode="after")
    def _one_val_source(self) -> TasksConfig:
        if self.val is not None and self.val_fraction is not None:
            raise ValueError("give either 'val' (a file) or 'val_fraction', not both")
        return self
