"""Experiment trackers: the run's scalars, its config and its reward curve sent to TensorBoard, MLflow and
Weights & Biases (``logging.trackers``).

Each tracker is a :class:`Tracker`; :class:`Trackers` fans every call out to the ones that are on. A
tracker starts with the run (:func:`open_trackers`): a missing package or a bad store is an error then,
before any rollout, naming the tracker and the install command. A tracker that fails later (a full disk,
a server gone) is turned off with one warning and the run trains on.

Nothing is sent anywhere the config does not name: MLflow records to ``logging.mlflow_tracking_uri``
(default: a SQLite file in ``output_dir``), W&B runs ``offline`` unless ``logging.wandb_mode`` is
``online``. Both packages also report their own usage or errors to their vendors by default, and wandb
starts Weave's LLM-call tracing when weave is imported; before importing them this module sets
``MLFLOW_DISABLE_TELEMETRY=true``, ``WANDB_ERROR_REPORTING=false`` and ``WANDB_DISABLE_WEAVE=true``
unless the environment already sets them. Secrets in the config (tokens, passwords, keys, credentials in
URLs) are masked before it is logged.

mlflow, wandb and tensorboard are imported only when a tracker that uses them starts.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from agl_core.settings import masked_config

if TYPE_CHECKING:
    from ..config import LoggingConfig, TrainerConfig

__all__ = [
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "TrackerError",
    "Trackers",
    "WandbTracker",
    "flatten_params",
    "open_trackers",
    "tensorboard_tracker",
]

logger = logging.getLogger(__name__)

#: What installs each tracker's packages (tensorboard: 2.20+ needs protobuf 6, which autogen-core refuses).
INSTALL = {
    "tensorboard": "pip install 'tensorboard<2.20'",
    "mlflow": "pip install mlflow-skinny",
    "mlflow-sqlite": "pip install sqlalchemy alembic",
    "wandb": "pip install wandb",
}


class TrackerError(RuntimeError):
    """A tracker cannot start: its package is missing, or its store or service refused the run."""


class Tracker(Protocol):
    """Where a run's numbers go. ``name`` is the ``logging.trackers`` entry; ``hint`` one line saying where
    the run is and how to open it. Any method may raise: :class:`Trackers` turns the tracker off."""

    name: str
    hint: str

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the run's config (a JSON-able mapping, secrets masked), once, at start."""

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Record ``values`` (finite floats by name, such as ``train/mean_reward``) at training ``step``;
        steps never decrease, and a step may get several calls."""

    def log_artifact(self, path: Path) -> None:
        """Keep the file at ``path`` (the reward-curve PNG) with the run."""

    def close(self, *, failed: bool = False) -> None:
        """End the run, marked failed when ``failed``; called once."""


def _require(module: str, tracker: str, install: str, *, why: str = "") -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TrackerError(
            f"logging.trackers lists {tracker} but {module} is not installed{why}: {install}"
            " (or pip install 'agl[trackers]' for every tracker)"
        ) from None


class TensorBoardTracker:
    """Scalars in TensorBoard event files under ``log_dir`` (``tensorboard --logdir LOG_DIR``); the config
    as a text entry. The reward curve stays a PNG in ``output_dir`` (TensorBoard keeps no files)."""

    name = "tensorboard"

    def __init__(
        self,
        log_dir: Path,
        *,
        required_by: str = "logging.trackers lists tensorboard",
        otherwise: str = "remove it from logging.trackers",
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TrackerError(
                f"{required_by} but tensorboard is not installed: {INSTALL['tensorboard']} (or {otherwise})"
            ) from None
        self.log_dir = log_dir
        self.hint = f"tensorboard: tensorboard --logdir {log_dir}"
        self._writer = SummaryWriter(str(log_dir))

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)
        self._writer.flush()

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def log_artifact(self, path: Path) -> None:
        pass

    def close(self, *, failed: bool = False) -> None:
        self._writer.close()


class MLflowTracker:
    """A run in an MLflow experiment: scalars as metrics by step, the config as params (dotted keys,
    values cut to MLflow's length limit), the reward curve as an artifact.

    ``tracking_uri``: ``sqlite:///PATH.db`` (needs sqlalchemy and alembic; new experiments keep their
    artifacts in ``mlartifacts/`` beside the database), ``file:PATH`` (MLflow's directory store, which
    MLflow 3 accepts only with ``MLFLOW_ALLOW_FILE_STORE=true``: set here, since the config named it) or
    ``http(s)://`` (an MLflow server).
    """

    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str = "agl", *, run_name: str | None = None) -> None:
        # MLflow starts reporting usage to its vendor on import unless told not to.
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        if tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        artifact_location = None
        if tracking_uri.startswith("sqlite:"):
            for module in ("sqlalchemy", "alembic"):
                _require(module, "mlflow", INSTALL["mlflow-sqlite"], why=f" (needed for {tracking_uri})")
            db = Path(tracking_uri.removeprefix("sqlite:///").partition("?")[0]).absolute()
            db.parent.mkdir(parents=True, exist_ok=True)
            # else MLflow puts a new experiment's artifacts in ./mlruns of whatever the working directory is
            artifact_location = (db.parent / "mlartifacts").as_uri()
        _require("mlflow", "mlflow", INSTALL["mlflow"])
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        try:
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

            self._max_value = int(MAX_PARAM_VAL_LENGTH)
        except ImportError:  # not public API; 500 is the smallest limit MLflow has had
            self._max_value = 500
        self._metric, self._param = Metric, Param
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is not None and found.lifecycle_stage == "deleted":
            raise TrackerError(
                f"the MLflow experiment {experiment!r} at {tracking_uri} is deleted: restore it (mlflow"
                " experiments restore) or set logging.mlflow_experiment to another name"
            )
        self.experiment_id = (
            found.experiment_id
            if found is not None
            else self.client.create_experiment(experiment, artifact_location=artifact_location)
        )
        self.run_id: str = self.client.create_run(self.experiment_id, run_name=run_name).info.run_id
        if tracking_uri.startswith(("http:", "https:")):
            self.hint = (
                f"mlflow: {tracking_uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
            )
        else:
            env = "MLFLOW_ALLOW_FILE_STORE=true " if tracking_uri.startswith("file:") else ""
            self.hint = (
                f"mlflow: run {self.run_id} in experiment {experiment!r}; browse with:"
                f" {env}mlflow ui --backend-store-uri {tracking_uri}"
            )

    def log_config(self, config: Mapping[str, Any]) -> None:
        params = [self._param(k, v[: self._max_value]) for k, v in flatten_params(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(_mlflow_key(k), v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self, *, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class WandbTracker:
    """A Weights & Biases run: scalars with ``run.log`` at their step, the config as ``run.config``, the
    reward curve as an artifact (``reward-curve-RUN_ID``, type ``plot``).

    ``offline`` writes ``directory/wandb/offline-run-*`` and touches no network (``wandb sync DIR``
    uploads it later); ``online`` needs ``wandb login`` or ``WANDB_API_KEY``. W&B does not capture the
    console or print banners; the run is its own (``reinit="create_new"``), beside any the program has.
    """

    name = "wandb"

    def __init__(
        self, project: str = "agl", mode: str = "offline", *, directory: Path, run_name: str | None = None
    ) -> None:
        # W&B's service reports its own errors to its vendor unless told not to; and with an LLM client
        # imported (the agents' openai) wandb.init advertises Weave, or starts it when imported, which
        # would send the LLM calls to W&B as well.
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
        wandb = _require("wandb", "wandb", INSTALL["wandb"])
        directory.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self.run: Any = wandb.init(
            project=project,
            mode=mode,
            dir=str(directory),
            name=run_name,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )
        if mode == "offline":
            where = self.run.settings.sync_dir
            self.hint = f"wandb: offline run in {where}; upload it with: wandb sync {where}"
        else:
            self.hint = f"wandb: {self.run.url}"

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def log_artifact(self, path: Path) -> None:
        artifact = self._wandb.Artifact(f"reward-curve-{self.run.id}", type="plot")
        artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def close(self, *, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Trackers:
    """The trackers that are on, as one: each call goes to each of them. A tracker that raises is turned
    off with one warning (through ``warn``; default: this module's logger) and the call returns normally,
    so training never stops for a tracker."""

    def __init__(
        self, trackers: Iterable[Tracker] = (), *, warn: Callable[[str], None] | None = None
    ) -> None:
        self._trackers = list(trackers)
        self._warn = warn or logger.warning

    @property
    def names(self) -> tuple[str, ...]:
        """The trackers still on, in order."""
        return tuple(t.name for t in self._trackers)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[Tracker]:
        return iter(list(self._trackers))

    def hints(self) -> list[str]:
        """A line per tracker: where its run is and how to open it."""
        return [t.hint for t in self._trackers]

    def add(self, step: int, values: Mapping[str, float | None]) -> None:
        """Send ``values`` at ``step``; ``None`` and non-finite values are left out."""
        finite = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}
        if finite:
            self._each("record scalars", lambda t: t.log_scalars(step, finite))

    def log_config(self, config: Mapping[str, Any]) -> None:
        masked = masked_config(config)
        self._each("record the config", lambda t: t.log_config(masked))

    def log_artifact(self, path: Path) -> None:
        self._each(f"keep {path.name}", lambda t: t.log_artifact(path))

    def close(self, *, failed: bool = False) -> None:
        """End every tracker's run; safe to call again."""
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            try:
                tracker.close(failed=failed)
            except Exception as exc:
                self._warn(
                    f"the {tracker.name} tracker failed to close its run ({type(exc).__name__}: {exc})"
                )

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self._trackers):
            try:
                call(tracker)
            except Exception as exc:
                self._trackers.remove(tracker)
                self._warn(
                    f"the {tracker.name} tracker failed to {what} ({type(exc).__name__}: {exc}); it is off"
                    " for the rest of the run, training goes on"
                )
                try:
                    tracker.close(failed=True)
                except Exception:
                    pass  # it already failed; one warning is enough


def tensorboard_tracker(log_dir: Path, mode: Any, *, listed: bool = False) -> TensorBoardTracker | None:
    """The TensorBoard tracker ``logging.tensorboard`` (``mode``) and ``logging.trackers`` (``listed``)
    ask for: required when ``mode`` is ``True`` or it is listed, when installed with ``auto``, never with
    ``False``."""
    if mode is False:
        return None
    if listed:
        return TensorBoardTracker(log_dir)
    if mode is True:
        return TensorBoardTracker(
            log_dir, required_by="logging.tensorboard is true", otherwise="set logging.tensorboard: auto"
        )
    try:
        return TensorBoardTracker(log_dir)
    except TrackerError:
        return None  # auto: no tensorboard, no scalars


def open_trackers(config: TrainerConfig, *, warn: Callable[[str], None] | None = None) -> Trackers:
    """Start the trackers ``config.logging`` asks for, each with a run named after ``output_dir``, and
    log the config to them. Raises :class:`TrackerError` (nothing left started) when one cannot start."""
    settings = config.logging
    _check_installed(settings)
    out = config.output_dir
    run_name = out.absolute().name
    started: list[Tracker] = []
    try:
        tensorboard = tensorboard_tracker(
            out / "tensorboard", settings.tensorboard, listed="tensorboard" in settings.trackers
        )
        if tensorboard is not None:
            started.append(tensorboard)
        for name in settings.trackers:
            try:
                if name == "mlflow":
                    uri = settings.mlflow_tracking_uri or f"sqlite:///{(out / 'mlflow.db').absolute()}"
                    started.append(MLflowTracker(uri, settings.mlflow_experiment, run_name=run_name))
                elif name == "wandb":
                    started.append(
                        WandbTracker(
                            settings.wandb_project, settings.wandb_mode, directory=out, run_name=run_name
                        )
                    )
            except TrackerError:
                raise
            except Exception as exc:
                raise TrackerError(
                    f"logging.trackers: {name} could not start ({type(exc).__name__}: {exc})"
                ) from exc
        masked = masked_config(config.model_dump(mode="json"))
        for tracker in started:
            try:
                tracker.log_config(masked)
            except Exception as exc:
                raise TrackerError(
                    f"logging.trackers: {tracker.name} could not record the config ({type(exc).__name__}:"
                    f" {exc})"
                ) from exc
    except BaseException:
        Trackers(started, warn=lambda _: None).close(failed=True)
        raise
    return Trackers(started, warn=warn)


def _check_installed(settings: LoggingConfig) -> None:
    """Every listed tracker's packages import, before any tracker starts a run."""
    if "mlflow" in settings.trackers:
        uri = settings.mlflow_tracking_uri or "sqlite:"
        if uri.startswith("sqlite:"):
            for module in ("sqlalchemy", "alembic"):
                _require(module, "mlflow", INSTALL["mlflow-sqlite"], why=" (MLflow's SQLite store needs it)")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # before the first import of mlflow
        _require("mlflow", "mlflow", INSTALL["mlflow"])
    if "wandb" in settings.trackers:
        _require("wandb", "wandb", INSTALL["wandb"])


def flatten_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: ``{"train.steps": "4", ...}``. Strings stay as they are, other
    values are JSON (``true``, ``null``, ``[1, 2]``); an empty mapping is ``{}``; characters MLflow
    refuses in a key become ``_``."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = _mlflow_key(f"{prefix}{key}")
        if isinstance(value, Mapping) and value:
            out.update(flatten_params(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def _mlflow_key(key: str) -> str:
    return re.sub(r"[^/\w.\- ]", "_", key)[:250]
