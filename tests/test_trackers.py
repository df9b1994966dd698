"""Experiment trackers (``logging.trackers``): what each real tracker records, read back with the tool's
own reader (TensorBoard's EventAccumulator, MLflow's client, ``wandb leet inspect`` for W&B's offline
transaction log); the install hint when a package is missing; the config checks; a tracker that fails
mid-run turned off with one warning."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from agl_core.settings import masked_config
from agl_trainer.config import ConfigError, TrainerConfig, config_from_dict
from agl_trainer.reporting.display import Display
from agl_trainer.reporting.results import EvalResult, StepMetrics
from agl_trainer.reporting.trackers import (
    TensorBoardTracker,
    TrackerError,
    Trackers,
    flatten_params,
    open_trackers,
)
from agl_trainer.run.run_context import RunLog

# find_spec, not importorskip: importing mlflow here, before the fixture below disables its telemetry,
# would start it
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mlflow", "wandb", "tensorboard", "sqlalchemy")),
    reason="needs the trackers extra: pip install 'agl[trackers]'",
)

WANDB = Path(sys.executable).with_name("wandb")
STEPS = [(1, 0.25), (2, 0.5), (3, 0.75)]


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    """W&B offline and silent with every directory of its own under tmp_path; MLflow without telemetry;
    the variables the trackers set for themselves restored afterwards."""
    home = tmp_path / "wandb-home"
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(home),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_DISABLE_WEAVE": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_ALLOW_FILE_STORE": "",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # unset, and unset again after the test
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _config(out: Path, **logging: Any) -> TrainerConfig:
    return config_from_dict(
        {"output_dir": str(out), "gateway": {"token": "hunter2-secret"}, "logging": logging}, required=()
    )


def _mlflow_run(uri: str) -> tuple[Any, Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("agl")
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def _wandb_records(out: Path) -> list[dict[str, Any]]:
    """The records of the one offline W&B run under ``out``, as ``wandb leet inspect --json`` reads them
    from its transaction log."""
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    assert list(run_dir.glob("run-*.wandb"))
    text = subprocess.run(
        [str(WANDB), "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    ).stdout
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _wandb_summary(out: Path) -> dict[str, Any]:
    """The state, config and last values of the one offline W&B run under ``out``
    (``wandb leet inspect --summary --json``)."""
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    text = subprocess.run(
        [str(WANDB), "leet", "inspect", "--summary", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    ).stdout
    summary: dict[str, Any] = json.loads(text)
    return summary


def _wandb_history(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [
        (r["history"]["step"]["num"], r["history"]["item"][key])
        for r in records
        if r["type"] == "history" and key in r["history"]["item"]
    ]


def _tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """The same steps and values, to TensorBoard's float32 precision."""
    return [s for s, _ in a] == [s for s, _ in b] and [v for _, v in a] == pytest.approx([v for _, v in b])


def _write_steps(trackers: Trackers) -> None:
    for step, reward in STEPS:
        trackers.add(step, {"train/mean_reward": reward, "train/loss": None, "train/grad_norm": float("nan")})


# -- each tracker, read back with its own reader ------------------------------------------------------


def test_tensorboard_scalars_and_config_read_back(tmp_path):
    out = tmp_path / "run"
    trackers = open_trackers(_config(out, trackers=["tensorboard"]))
    assert trackers.names == ("tensorboard",)
    _write_steps(trackers)
    trackers.close()
    assert _tensorboard_scalars(out / "tensorboard", "train/mean_reward") == STEPS
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert "train/loss" not in acc.Tags()["scalars"]  # None and NaN are left out
    assert "train/grad_norm" not in acc.Tags()["scalars"]


@pytest.mark.parametrize("store", ["sqlite", "file"])
def test_mlflow_metrics_params_and_artifact_read_back(tmp_path, store):
    out = tmp_path / "run"
    uri = f"sqlite:///{tmp_path / 'db' / 'mlflow.db'}" if store == "sqlite" else f"file:{tmp_path / 'mlruns'}"
    trackers = open_trackers(_config(out, tensorboard=False, trackers=["mlflow"], mlflow_tracking_uri=uri))
    assert trackers.names == ("mlflow",)
    assert f"mlflow ui --backend-store-uri {uri}" in trackers.hints()[0]
    _write_steps(trackers)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reward_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    trackers.log_artifact(out / "reward_curve.png")
    trackers.close()

    client, run = _mlflow_run(uri)
    history = client.get_metric_history(run.info.run_id, "train/mean_reward")
    assert [(m.step, m.value) for m in history] == STEPS
    assert "train/loss" not in run.data.metrics
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run"
    params = run.data.params
    assert params["train.steps"] == "4"
    assert params["logging.trackers"] == '["mlflow"]'
    assert params["gateway.token"] == "***"  # secrets never leave the machine in the config
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["reward_curve.png"]
    if store == "sqlite":  # artifacts beside the database, not in the working directory
        assert list((tmp_path / "db" / "mlartifacts").rglob("reward_curve.png"))


def test_wandb_offline_run_read_back(tmp_path):
    out = tmp_path / "run"
    trackers = open_trackers(_config(out, tensorboard=False, trackers=["wandb"]))
    assert trackers.names == ("wandb",)
    assert "wandb sync " in trackers.hints()[0]
    _write_steps(trackers)
    (out / "reward_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    trackers.log_artifact(out / "reward_curve.png")
    trackers.close()

    records = _wandb_records(out)
    assert _wandb_history(records, "train/mean_reward") == STEPS
    assert not _wandb_history(records, "train/loss")
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["project"] == "agl"
    (artifact,) = [r["artifact"] for r in records if r["type"] == "artifact"]
    assert artifact["name"].startswith("reward-curve-") and artifact["type"] == "plot"
    summary = _wandb_summary(out)
    assert summary["state"] == "finished" and summary["exit_code"] == 0
    assert summary["config"]["train"]["steps"] == 4
    assert summary["config"]["gateway"]["token"] == "***"
    assert summary["summary"]["train/mean_reward"] == 0.75


def test_run_log_sends_the_same_scalars_to_every_tracker(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    config = _config(out, trackers=["tensorboard", "mlflow", "wandb"], progress="plain")
    lines: list[str] = []
    display = Display("plain", 2, echo=lines.append)
    with ExitStack() as stack:
        log = RunLog(config, display, stack, title="t")
        log.record_eval(EvalResult(0, 0.1, 0.05, 3, 0, {"a": 0.1}), "before training")
        for step, reward in [(1, 0.2), (2, 0.4)]:
            log.record_step(_metrics(step, reward))
            log.redraw()
        assert "tensorboard" in log.trackers
    assert any(line.startswith("mlflow: run ") for line in lines)
    assert any(line.startswith("wandb: offline run in ") for line in lines)
    assert not any(line.startswith("warning") for line in lines), lines

    expected = {"train/mean_reward": [(1, 0.2), (2, 0.4)], "val/mean_reward": [(0, 0.1)]}
    client, run = _mlflow_run(f"sqlite:///{out / 'mlflow.db'}")
    records = _wandb_records(out)
    for name in [*expected, "train/loss", "train/grad_norm", "train/tokens_per_s", "val/se"]:
        tensorboard = _tensorboard_scalars(out / "tensorboard", name)
        mlflow = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        wandb = _wandb_history(records, name)
        assert tensorboard and _same(tensorboard, mlflow) and _same(tensorboard, wandb), name
        if name in expected:
            assert _same(tensorboard, expected[name])
    for name in ["train/rollouts_failed", "train/policy_version"]:
        assert _tensorboard_scalars(out / "tensorboard", name) == _wandb_history(records, name), name
    # every series the dashboard plots reaches the trackers too
    for name, values in {
        "train/kl": [(1, 0.01), (2, 0.02)],
        "train/approx_kl": [(1, 0.002), (2, 0.002)],
        "train/generation_tokens_per_s": [(1, 80.0), (2, 80.0)],
        "train/rollouts": [(1, 4.0), (2, 4.0)],
        "memory/peak_rss_mb": [(1, 901.0), (2, 902.0)],
        "time/update_s": [(1, 0.5), (2, 1.0)],
        "time/rollouts_s": [(1, 2.5), (2, 2.5)],
        "agent/solver/calls": [(1, 4.0), (2, 4.0)],
        "agent/solver/trained": [(1, 3.0), (2, 3.0)],
    }.items():
        assert _same(_tensorboard_scalars(out / "tensorboard", name), values), name
        assert _same(_wandb_history(records, name), values), name
    # the reward curve, kept once, at the end
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["reward_curve.png"]
    assert len([r for r in records if r["type"] == "artifact"]) == 1


def _metrics(step: int, reward: float) -> StepMetrics:
    return StepMetrics(
        step=step,
        policy_version=step,
        rollouts=4,
        rollouts_failed=0,
        rollouts_late=0,
        transitions=8,
        trained_transitions=8,
        mean_reward=reward,
        loss=-0.01 * step,
        grad_norm=0.5,
        tokens=100,
        tokens_per_s=50.0,
        groups_skipped=0,
        problems={},
        untrained={},
        reward_events={},
        agents={"solver": {"calls": 4, "trained": 3}},
        tasks=["a"],
        redrawn_tasks=0,
        seconds=1.0,
        phases={"rollouts": 2.5, "update": 0.5 * step},
        generation_tokens_per_s=80.0,
        peak_rss_mb=900.0 + step,
        kl=0.01 * step,
        approx_kl=0.002,
    )


def test_run_log_marks_the_runs_failed_when_training_raises(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    config = _config(out, tensorboard=False, trackers=["mlflow", "wandb"])
    with pytest.raises(RuntimeError, match="boom"), ExitStack() as stack:
        log = RunLog(config, Display("plain", 1, echo=lambda _: None), stack, title="t")
        log.record_step(_metrics(1, 0.5))
        raise RuntimeError("boom")
    _, run = _mlflow_run(f"sqlite:///{out / 'mlflow.db'}")
    assert run.info.status == "FAILED"
    summary = _wandb_summary(out)
    assert summary["exit_code"] == 1 and summary["summary"]["train/mean_reward"] == 0.5


# -- no network ---------------------------------------------------------------------------------------


def _no_network_available() -> bool:
    unshare = shutil.which("unshare")
    return unshare is None or subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode != 0


@pytest.mark.skipif(_no_network_available(), reason="needs unshare -rn (a user namespace without network)")
def test_offline_trackers_need_no_network(tmp_path):
    # In a network namespace with nothing but a loopback that is down, offline W&B and a local MLflow store
    # must start, record and finish, without waiting on a connection that cannot succeed; and with the
    # vendors' own reporting switched off by the trackers, not by this test's environment.
    out = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import os
        from agl_trainer.config import config_from_dict
        from agl_trainer.reporting.trackers import open_trackers
        logging = {{"tensorboard": False, "trackers": ["mlflow", "wandb"]}}
        config = config_from_dict({{"output_dir": {str(out)!r}, "logging": logging}}, required=())
        trackers = open_trackers(config, warn=print)
        for step in (1, 2):
            trackers.add(step, {{"train/mean_reward": step / 4}})
        trackers.close()
        names = ["MLFLOW_DISABLE_TELEMETRY", "WANDB_ERROR_REPORTING", "WANDB_DISABLE_WEAVE"]
        print("ok", trackers.names, [os.environ.get(n) for n in names])
        """
    )
    own = ("MLFLOW_DISABLE_TELEMETRY", "WANDB_ERROR_REPORTING", "WANDB_DISABLE_WEAVE", "WANDB_MODE")
    env = {k: v for k, v in os.environ.items() if k not in own}
    done = subprocess.run(
        ["unshare", "-rn", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok () ['true', 'false', 'true']"), done.stdout
    assert _wandb_history(_wandb_records(out), "train/mean_reward") == [(1, 0.25), (2, 0.5)]
    client, run = _mlflow_run(f"sqlite:///{out / 'mlflow.db'}")
    assert [m.value for m in client.get_metric_history(run.info.run_id, "train/mean_reward")] == [0.25, 0.5]


# -- a missing package: the error at start names the tracker and the install command ---------------


@pytest.mark.parametrize(
    "trackers, hidden, named, install",
    [
        (["wandb"], ["wandb"], "wandb", "pip install wandb"),
        (["mlflow"], ["mlflow"], "mlflow", "pip install mlflow-skinny"),
        (["mlflow"], ["sqlalchemy"], "mlflow", "pip install sqlalchemy alembic"),
        (["mlflow", "wandb"], ["wandb"], "wandb", "pip install wandb"),
        (
            ["tensorboard", "mlflow"],
            ["tensorboard", "torch.utils.tensorboard"],
            "tensorboard",
            "pip install 'tensorboard<2.20'",
        ),
    ],
)
def test_a_missing_package_is_named_with_its_install_command(
    tmp_path, monkeypatch, trackers, hidden, named, install
):
    for name in hidden:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    out = tmp_path / "run"
    with pytest.raises(TrackerError) as info:
        open_trackers(_config(out, trackers=trackers))
    assert f"logging.trackers lists {named} but" in str(info.value)
    assert install in str(info.value)
    assert not (out / "mlflow.db").exists()  # nothing started before the error
    assert not (out / "wandb").exists()


def test_tensorboard_auto_without_the_package_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert open_trackers(_config(tmp_path / "run")).names == ()
    with pytest.raises(TrackerError, match=r"logging.tensorboard is true .* set logging.tensorboard: auto"):
        open_trackers(_config(tmp_path / "run", tensorboard=True))


# -- config checks -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "logging, message",
    [
        ({"trackers": ["mlflow", "wandb", "mlflow"]}, "logging.trackers lists mlflow more than once"),
        ({"trackers": "wandb"}, "logging.trackers is a list: write trackers: [wandb]"),
        ({"trackers": ["neptune"]}, "'logging.trackers.0'"),
        (
            {"tensorboard": False, "trackers": ["tensorboard"]},
            "logging.tensorboard is false but logging.trackers lists tensorboard",
        ),
        ({"mlflow_experiment": "x"}, "logging.mlflow_experiment applies when logging.trackers lists mlflow"),
        ({"trackers": ["mlflow"], "wandb_mode": "online"}, "logging.wandb_mode applies when"),
        ({"trackers": ["mlflow"], "mlflow_tracking_uri": "postgresql://db/x"}, "use sqlite:///PATH.db"),
        ({"trackers": ["mlflow"], "mlflow_tracking_uri": "sqlite://"}, "is not one agl records to"),
        ({"trackers": ["mlflow"], "mlflow_tracking_uri": "runs/mlruns"}, "file:PATH (a local directory)"),
        ({"trackers": ["mlflow"], "mlflow_experiment": " agl"}, "without leading or trailing spaces"),
        ({"trackers": ["wandb"], "wandb_project": "team/agl"}, "W&B project names"),
        ({"trackers": ["wandb"], "wandb_mode": "cloud"}, "'logging.wandb_mode'"),
        ({"trakcers": ["wandb"]}, "did you mean 'logging.trackers'"),
    ],
)
def test_bad_tracker_settings_are_named(tmp_path, logging, message):
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, **logging)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "logging",
    [
        {},
        {"tensorboard": True, "trackers": ["tensorboard"]},
        {"trackers": ["mlflow"], "mlflow_tracking_uri": "https://mlflow.example.org:5000"},
        {"trackers": ["mlflow"], "mlflow_tracking_uri": "file:./mlruns", "mlflow_experiment": "x y"},
        {"trackers": ["wandb", "mlflow"], "wandb_mode": "online", "wandb_project": "my-project"},
    ],
)
def test_good_tracker_settings_pass(tmp_path, logging):
    assert _config(tmp_path, **logging).logging.trackers == logging.get("trackers", [])


# -- a tracker failing mid-run --------------------------------------------------------------------------


class _DiskFull:
    """A tracker whose writes fail as on a full disk."""

    name = "full"
    hint = "full: nowhere"

    def __init__(self) -> None:
        self.closed: list[bool] = []

    def log_config(self, config: Any) -> None:
        pass

    def log_scalars(self, step: int, values: Any) -> None:
        raise OSError(28, "No space left on device")

    def log_artifact(self, path: Path) -> None:
        raise OSError(28, "No space left on device")

    def close(self, *, failed: bool = False) -> None:
        self.closed.append(failed)


def test_a_tracker_failing_mid_run_is_turned_off_with_one_warning(tmp_path):
    warnings: list[str] = []
    tensorboard = TensorBoardTracker(tmp_path / "tb")
    full = _DiskFull()
    trackers = Trackers([full, tensorboard], warn=warnings.append)
    _write_steps(trackers)
    trackers.log_artifact(tmp_path / "curve.png")
    trackers.close()
    assert len(warnings) == 1
    assert "the full tracker failed to record scalars (OSError" in warnings[0]
    assert "training goes on" in warnings[0]
    assert full.closed == [True]
    assert _tensorboard_scalars(tmp_path / "tb", "train/mean_reward") == STEPS  # the others go on


def test_mlflow_losing_its_store_mid_run_is_turned_off(tmp_path):
    uri = f"file:{tmp_path / 'mlruns'}"
    warnings: list[str] = []
    trackers = open_trackers(
        _config(tmp_path / "run", trackers=["mlflow", "tensorboard"], mlflow_tracking_uri=uri),
        warn=warnings.append,
    )
    trackers.add(1, {"train/mean_reward": 0.25})
    shutil.rmtree(tmp_path / "mlruns")  # the store is gone (a disk unmounted, a directory cleaned)
    for step, reward in STEPS[1:]:
        trackers.add(step, {"train/mean_reward": reward})
    trackers.close()
    assert len(warnings) == 1 and "the mlflow tracker failed to record scalars" in warnings[0], warnings
    assert trackers.names == ()
    assert _tensorboard_scalars(tmp_path / "run" / "tensorboard", "train/mean_reward") == STEPS


def test_tracker_packages_are_imported_only_when_a_tracker_starts():
    code = (
        "import sys, agl_trainer.run.loop, agl_trainer.reporting.trackers; "
        "print(sorted({'mlflow', 'wandb', 'tensorboard', 'sqlalchemy'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# -- pure helpers ---------------------------------------------------------------------------------------


def test_config_secrets_are_masked():
    config = {
        "gateway": {"token": "abcdefgh", "host": "127.0.0.1"},
        "logging": {"dashboard_token": "t0k3n", "dashboard_port": 1},
        "store": {"url": "http://user:pa55@store:8000/x"},
        "serving": {"vllm": {"launch": {"env": {"HF_TOKEN": "hf_x", "CUDA_VISIBLE_DEVICES": "1"}}}},
        "algorithm": {"micro_batch_tokens": 512, "max_tokens": 9},
        "none": {"api_key": None},
    }
    assert masked_config(config) == {
        "gateway": {"token": "***", "host": "127.0.0.1"},
        "logging": {"dashboard_token": "***", "dashboard_port": 1},
        "store": {"url": "http://user:***@store:8000/x"},
        "serving": {"vllm": {"launch": {"env": {"HF_TOKEN": "***", "CUDA_VISIBLE_DEVICES": "1"}}}},
        "algorithm": {"micro_batch_tokens": 512, "max_tokens": 9},
        "none": {"api_key": None},
    }


def test_params_are_flat_dotted_strings():
    assert flatten_params(
        {"train": {"steps": 4, "mode": "sync"}, "policies": [], "verl": {}, "x": {"+a b": None, "ok": True}}
    ) == {
        "train.steps": "4",
        "train.mode": "sync",
        "policies": "[]",
        "verl": "{}",
        "x._a b": "null",
        "x.ok": "true",
    }
