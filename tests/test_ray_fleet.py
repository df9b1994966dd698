"""``agl run --ray``: the runner's workers as actors on a local Ray cluster, serving a training run.

The trainer (``runner.workers: 0``) queues rollouts in the store; ``agl run --ray local --actors 2`` starts
a Ray cluster on this machine and two runner actors, which take them. One actor's process is SIGKILLed
while it runs a rollout: Ray starts the actor again, the store reclaims the attempt when its lease runs
out, and the run trains every step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from agl_core.records import RolloutStatus
from agl_core.runner._ray import split_workers
from agl_core.store import SqliteStore, StoreClient
from agl_core.store.service import StoreService
from agl_trainer import Trainer

from ._training import cli_env, marking_agent, metrics_rows

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent

AGENT = marking_agent(1.0)


def test_workers_are_spread_evenly_over_the_actors():
    assert split_workers(5, 2) == [3, 2]
    assert split_workers(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="--actors must be between 1 and --workers"):
        split_workers(2, 3)


def _agl_run(store_url: str, path: Path, *flags: str) -> list[str]:
    """``agl run`` of the test's agent (in ``path``) for the store at ``store_url``, then ``flags``."""
    agent = ["run", "ray_agent:solve", "--store", store_url, "--path", str(path)]
    return [sys.executable, "-m", "agl_core.cli", *agent, *flags]


def test_ray_actors_serve_a_training_run_and_one_killed_is_replaced(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "ray_agent.py").write_text(AGENT)
    store = SqliteStore(str(tmp_path / "store.sqlite"))
    service = StoreService(store, parse_workers=0, maintenance_interval_s=0.5)  # as agl store serve runs it
    url = service.start_http_background("127.0.0.1", 0)
    service.start_maintenance()
    log = (tmp_path / "agl-run.log").open("w")
    fleet = subprocess.Popen(
        _agl_run(url, tmp_path, *"--ray local --workers 4 --actors 2 --lease 3 --report-every 0".split()),
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(AGL_TEST_MARKS=str(marks)),
    )
    killed: list[int] = []
    step_1_done = threading.Event()

    def kill_an_actor() -> None:
        """Once step 1 is over, SIGKILL the process of an actor running a rollout of step 2."""
        step_1_done.wait(600)
        deadline = time.monotonic() + 120
        while not killed and time.monotonic() < deadline:
            running = [m.name.split("-")[0] for m in marks.iterdir()]
            if running:
                killed.append(int(running[0]))
                os.kill(killed[0], signal.SIGKILL)
            time.sleep(0.02)

    def echo(line: str) -> None:
        if line.startswith("step 1/"):
            step_1_done.set()

    killer = threading.Thread(target=kill_an_actor, daemon=True)
    killer.start()
    try:
        (tmp_path / "tasks.jsonl").write_text(
            "".join(json.dumps({"id": f"t{i}", "q": f"count to {i}"}) + "\n" for i in range(8))
        )
        config = {
            "agent": "ray_agent:solve",
            "tasks": {"train": str(tmp_path / "tasks.jsonl")},
            "output_dir": str(tmp_path / "run"),
            "model": {"source": "tiny", "lora": {"r": 4, "alpha": 8}},
            "store": {"url": url},
            "gateway": {"default_max_tokens": 4},
            "runner": {"workers": 0, "max_attempts": 3, "step_timeout_s": 300},
            "train": {"steps": 3, "tasks_per_step": 2, "rollouts_per_task": 2},
            "logging": {"plot": False, "tensorboard": False, "progress": "plain"},
        }
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))  # the agent module beside it
        Trainer(str(tmp_path / "config.yaml"), echo=echo).fit()
    finally:
        step_1_done.set()
        killer.join(130)
        fleet.send_signal(signal.SIGTERM)
        try:
            fleet.wait(90)
        finally:
            if fleet.poll() is None:
                fleet.kill()
                fleet.wait(30)
            log.close()
    output = (tmp_path / "agl-run.log").read_text()
    assert "4 worker(s) in 2 Ray actor(s) at local (2, 2 each)" in output, output[-3000:]
    assert fleet.returncode == 0, output[-3000:]
    assert killed, "no actor process ran a rollout of step 2"
    rows = [r for r in metrics_rows(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollouts"] == 4 and r["rollouts_failed"] == 0 for r in rows), rows
    client = StoreClient(url)
    try:
        rollouts = client.get_rollouts([rid for r in rows for rid in r["rollout_ids"]])
    finally:
        client.close()
        service.close()
        store.close()
    runners = {a.worker_id.rsplit("-", 1)[0] for r in rollouts for a in r.attempts if a.worker_id}
    assert len(runners) >= 2  # both actors ran rollouts (a restarted actor is a runner of its own)
    retried = [r for r in rollouts if len(r.attempts) > 1]
    assert retried and all(r.status == RolloutStatus.SUCCEEDED for r in retried)


def test_ray_flags_that_do_not_fit_are_refused_before_ray_starts(tmp_path):
    (tmp_path / "ray_agent.py").write_text(AGENT)
    store = SqliteStore(str(tmp_path / "store.sqlite"))
    service = StoreService(store, parse_workers=0)
    url = service.start_http_background("127.0.0.1", 0)
    try:
        runs = {
            flags: subprocess.run(
                _agl_run(url, tmp_path, *flags), capture_output=True, text=True, timeout=120, env=cli_env()
            )
            for flags in (
                ("--workers", "2", "--actors", "3", "--ray", "local"),
                ("--workers", "2", "--actors", "2"),
                ("--workers", "2", "--ray", "local", "--actor-cpus", "-1"),
            )
        }
    finally:
        service.close()
        store.close()
    too_many, without_ray, negative = runs.values()
    assert too_many.returncode == 2 and "--actors (3) may not exceed --workers (2)" in too_many.stderr
    assert without_ray.returncode == 2 and "--actors applies with --ray" in without_ray.stderr
    assert negative.returncode == 2 and "--actor-cpus" in negative.stderr
