"""``train``, ``validation``, ``checkpoint`` and ``logging``: the steps of a run and what it shows and
keeps."""

from __future__ import annotations

import re
from typing import Any, Literal

import pydantic

from .base import _Strict


class ValidationConfig(_Strict):
    #: Also evaluate on the validation split every N training steps (0: only before and after training).
    every_steps: int = pydantic.Field(0, ge=0)
    #: Evaluate before the first step and after the last: the run's before/after held-out score.
    before: bool = True
    after: bool = True
    #: Rollouts per validation task; a task's score is their mean.
    rollouts_per_task: int = pydantic.Field(1, ge=1, le=64)
    #: Evaluate on the first N validation tasks only (the same ones every time); null: all of them.
    max_tasks: int | None = pydantic.Field(None, ge=1)


class CheckpointConfig(_Strict):
    #: Save a checkpoint (adapter or weights, optimizer, step, RNG, data position) every N steps, and
    #: always after the last step; 0 saves only after the last step.
    every_steps: int = pydantic.Field(1, ge=0)
    #: How many of the newest checkpoints to keep.
    keep: int = pydantic.Field(2, ge=1)


class LoggingConfig(_Strict):
    #: ``rich``: a live progress display; ``plain``: one line per step; ``auto``: rich on a terminal.
    progress: Literal["auto", "rich", "plain"] = "auto"
    #: Write TensorBoard scalars under ``output_dir/tensorboard``: ``auto`` does when tensorboard is
    #: installed, ``true`` requires it, ``false`` never does. ``tensorboard`` in ``trackers`` is the same
    #: as ``true`` (required); with ``false`` it is refused as a contradiction. Left at ``auto`` with
    #: other trackers listed, TensorBoard still writes when installed, as without them.
    tensorboard: Literal["auto", True, False] = "auto"
    #: Experiment trackers that receive the same scalars, the config (once, at start) and the reward
    #: curve (at the end): ``tensorboard``, ``mlflow`` (``pip install mlflow-skinny sqlalchemy alembic``),
    #: ``wandb`` (``pip install wandb``); or ``pip install 'agl[trackers]'``. A tracker whose package is
    #: missing stops the run at start; one that fails mid-run is turned off with a warning.
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = []
    #: Where MLflow records the run: ``sqlite:///PATH.db`` (a local database), ``file:PATH`` (MLflow's
    #: older directory store) or ``http(s)://HOST[:PORT]`` (an MLflow server: nothing is sent anywhere
    #: unless named here). Relative paths are relative to the working directory. Default:
    #: ``sqlite:///OUTPUT_DIR/mlflow.db``.
    mlflow_tracking_uri: str | None = None
    #: The MLflow experiment the run is recorded under (created when missing).
    mlflow_experiment: str = "agl"
    #: The Weights & Biases project of the run.
    wandb_project: str = "agl"
    #: ``offline`` (default) writes the run under ``output_dir/wandb`` and needs no network or account
    #: (upload it later with ``wandb sync``); ``online`` streams it to W&B (needs ``wandb login``).
    wandb_mode: Literal["offline", "online"] = "offline"
    #: Redraw ``output_dir/reward_curve.png`` (train and validation reward by step) after every step.
    plot: bool = True
    #: Serve the web dashboard (``agl dashboard``) over this run and its store while it trains; the URL is
    #: printed at start.
    dashboard: bool = False
    #: Where the dashboard listens. A host other than localhost needs ``dashboard_token`` (or
    #: ``AGL_DASHBOARD_TOKEN``); port 0 picks a free one.
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = pydantic.Field(8765, ge=0, le=65535)
    dashboard_token: str | None = None

    @pydantic.field_validator("trackers", mode="before")
    @classmethod
    def _trackers_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            raise ValueError(f"logging.trackers is a list: write trackers: [{value}]")
        if isinstance(value, list):
            repeated = sorted({t for t in value if isinstance(t, str) and value.count(t) > 1})
            if repeated:
                raise ValueError(
                    f"logging.trackers lists {', '.join(repeated)} more than once; list each tracker once"
                )
        return value

    @pydantic.field_validator("mlflow_tracking_uri")
    @classmethod
    def _mlflow_uri(cls, value: str | None) -> str | None:
        if value is None:
            return None
        scheme, _, rest = value.partition(":")
        ok = (
            (scheme == "sqlite" and rest.startswith("///") and len(rest) > 3)
            or (scheme == "file" and bool(rest.strip("/")))
            or (scheme in ("http", "https") and bool(re.fullmatch(r"//[^/\s]+(/\S*)?", rest)))
        )
        if not ok:
            raise ValueError(
                f"logging.mlflow_tracking_uri {value!r} is not one agl records to: use sqlite:///PATH.db"
                " (a local database file), file:PATH (a local directory) or http(s)://HOST[:PORT] (an"
                " MLflow server); leave it out for sqlite:///OUTPUT_DIR/mlflow.db"
            )
        return value

    @pydantic.field_validator("mlflow_experiment", "wandb_project")
    @classmethod
    def _tracker_names(cls, value: str, info: pydantic.ValidationInfo) -> str:
        key = f"logging.{info.field_name}"
        if not value.strip() or value != value.strip():
            raise ValueError(f"{key} {value!r}: give a name without leading or trailing spaces")
        if info.field_name == "wandb_project" and (len(value) > 128 or set(value) & set("/\\#?%:")):
            raise ValueError(
                f"{key} {value!r}: W&B project names have at most 128 characters and none of / \\ # ? % :"
            )
        if len(value) > 500:
            raise ValueError(f"{key}: at most 500 characters (got {len(value)})")
        return value

    @pydantic.model_validator(mode="after")
    def _trackers_fit(self) -> LoggingConfig:
        if self.tensorboard is False and "tensorboard" in self.trackers:
            raise ValueError(
                "logging.tensorboard is false but logging.trackers lists tensorboard: remove tensorboard"
                " from logging.trackers to write no TensorBoard scalars, or remove tensorboard: false"
            )
        for tracker, keys in (
            ("mlflow", ("mlflow_tracking_uri", "mlflow_experiment")),
            ("wandb", ("wandb_project", "wandb_mode")),
        ):
            moot = [k for k in keys if k in self.model_fields_set]
            if moot and tracker not in self.trackers:
                raise ValueError(
                    f"logging.{moot[0]} applies when logging.trackers lists {tracker}: add {tracker} to"
                    f" logging.trackers, or remove logging.{moot[0]}"
                )
        return self


class TrainConfig(_Strict):
    steps: int = pydantic.Field(4, ge=1)
    tasks_per_step: int = pydantic.Field(4, ge=1)
    rollouts_per_task: int = pydantic.Field(4, ge=1)
    seed: int = 0
    #: torch threads on CPU; 1 is fastest on small shared machines.
    threads: int = pydantic.Field(1, ge=1, le=256)
    #: Dynamic sampling (as in DAPO): a task whose rollouts all score the same gives no gradient, so when
    #: fewer than ``tasks_per_step`` groups differ, draw that many more tasks and roll them out, up to this
    #: many extra rounds per step. Each round costs a batch of rollouts; 0 turns it off.
    resample_rounds: int = pydantic.Field(0, ge=0, le=16)
    #: ``sync``: each step rolls out its groups, then updates while no rollout runs. ``async``: rollouts
    #: keep running during the update; a step trains on the first ``tasks_per_step`` groups to finish whose
    #: calls are at most ``max_staleness`` policy versions old (``agl_trainer.run.pipeline``).
    mode: Literal["sync", "async"] = "sync"
    #: With ``mode: async``: how many policy versions a trained call may be behind the policy being
    #: updated; groups with an older call are dropped (counted in the metrics) and replaced. The pipeline
    #: keeps ``(max_staleness + 1) x tasks_per_step`` groups in flight.
    max_staleness: int = pydantic.Field(1, ge=0, le=64)

    @pydantic.model_validator(mode="after")
    def _async_fits(self) -> TrainConfig:
        if self.mode == "async" and self.resample_rounds:
            raise ValueError(
                "train.resample_rounds redraws tasks within a synchronous step and does not apply with"
                " train.mode async: set resample_rounds to 0, or train.mode to sync"
            )
        if "max_staleness" in self.model_fields_set and self.mode != "async":
            raise ValueError("train.max_staleness applies with train.mode: async; set the mode, or remove it")
        return self

    @pydantic.model_validator(mode="after")
    def _resampling_needs_groups(self) -> TrainConfig:
        if self.resample_rounds and self.rollouts_per_task < 2:
            raise ValueError(
                "train.resample_rounds redraws tasks whose rollouts all scored the same, which a single"
                " rollout always does; set train.rollouts_per_task to 2 or more, or resample_rounds to 0"
            )
        return self
