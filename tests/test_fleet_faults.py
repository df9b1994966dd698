"""Faults of a running training job: a worker that claims a rollout and never sends a heartbeat, and the
store (``agl store serve``) killed and started again in the middle of a step. Each time the step goes on,
every rollout it trains on succeeded, and nothing the store acknowledged is lost.

(The gateway runs inside the trainer's process, so restarting it is restarting the trainer:
``tests/test_checkpoint.py`` SIGKILLs ``agl train`` and resumes it.)
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import openai

from agl_core.records import RolloutStatus
from agl_core.store import SqliteStore, StoreClient, StoreError
from agl_trainer import Trainer

from ._training import TINY_JOB, cli_env, metrics_rows

ROOT = Path(__file__).resolve().parent.parent
CONFIG: dict[str, Any] = {
    **TINY_JOB,
    "train": {"steps": 3, "tasks_per_step": 2, "rollouts_per_task": 2},
    "runner": {"workers": 2, "mode": "thread", "max_attempts": 3, "step_timeout_s": 300},
}
TASKS = [{"id": f"t{i}", "q": f"say {i}"} for i in range(8)]


def _agent(pause_s: float) -> Any:
    def solve(task: dict[str, Any], llm: Any) -> float:
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
        reply = client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=3
        )
        time.sleep(pause_s)
        return float(len(reply.choices[0].message.content or "") % 2)

    return solve


def test_a_worker_that_never_heartbeats_loses_its_rollout_to_another(tmp_path):
    stolen: list[str] = []
    store_url: list[str] = []
    started = threading.Event()

    def ghost() -> None:
        """Claims one training rollout with a 1 s lease, then is never heard of again."""
        started.wait(300)
        client = StoreClient(store_url[0])
        try:
            deadline = time.monotonic() + 120
            while not stolen and time.monotonic() < deadline:
                claimed = client.dequeue_rollout("ghost-worker", lease_s=1.0)
                if claimed is not None:
                    stolen.append(claimed[0].rollout_id)
                time.sleep(0.01)
        finally:
            client.close()

    def echo(line: str) -> None:
        found = re.match(r"store: (http://\S+)", line)
        if found:
            store_url.append(found.group(1))
            started.set()

    thread = threading.Thread(target=ghost, daemon=True)
    thread.start()
    out = tmp_path / "run"
    result = Trainer({**CONFIG, "output_dir": str(out)}, echo=echo).fit(_agent(0.3), TASKS)
    thread.join(30)
    assert stolen, "the ghost worker claimed nothing"
    assert [m.step for m in result.history] == [1, 2, 3]
    assert all(m.rollouts == 4 and m.rollouts_failed == 0 for m in result.history)
    store = SqliteStore(str(out / "store.sqlite"))
    try:
        (rollout,) = store.get_rollouts(stolen)
    finally:
        store.close()
    # the store took the attempt back when its lease ran out, and a runner of the job ran it again
    assert rollout.status == RolloutStatus.SUCCEEDED
    assert (
        rollout.attempts[0].worker_id == "ghost-worker"
        and rollout.attempts[0].status != RolloutStatus.SUCCEEDED
    )
    assert rollout.attempts[-1].worker_id != "ghost-worker"
    assert any(rollout.rollout_id in m.rollout_ids for m in result.history)


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(db: Path, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agl_core.cli", "store", "serve", "--db", str(db), "--http-port", str(port),
         "--no-grpc"],
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = StoreClient(f"http://127.0.0.1:{port}", timeout_s=2.0)
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                client.get_resource("llm")
                return proc
            except StoreError:
                assert proc.poll() is None and time.monotonic() < deadline, "the store did not start"
                time.sleep(0.1)
    finally:
        client.close()


def test_the_store_killed_and_restarted_mid_step_loses_no_step(tmp_path):
    db, port = tmp_path / "store.sqlite", _port()
    url = f"http://127.0.0.1:{port}"
    servers = [_serve(db, port)]
    restarted = threading.Event()
    lines: list[str] = []

    def restart() -> None:
        """SIGKILL the store during step 2's rollouts, and start it again on the same file 2 s later."""
        servers[0].send_signal(signal.SIGKILL)
        servers[0].wait(30)
        time.sleep(2.0)
        servers.append(_serve(db, port))
        restarted.set()

    def echo(line: str) -> None:
        lines.append(line)
        if line.startswith("step 1/"):
            threading.Timer(0.5, restart).start()

    try:
        result = Trainer(
            {**CONFIG, "output_dir": str(tmp_path / "run"), "store": {"url": url}}, echo=echo
        ).fit(_agent(1.0), TASKS)
    finally:
        restarted.wait(60)
        for server in servers:
            server.terminate()
            server.wait(30)
    assert restarted.is_set()
    assert [m.step for m in result.history] == [1, 2, 3]
    assert all(m.rollouts + m.rollouts_failed + m.rollouts_late == 4 for m in result.history)
    assert any("the store is unreachable" in line for line in lines)
    rows = [r for r in metrics_rows(tmp_path / "run") if r["kind"] == "train"]
    # every rollout a step trained on is in the store, succeeded, with its spans (durable: SQLite file)
    store = SqliteStore(str(db))
    try:
        for row in rows:
            states = store.get_rollouts(row["rollout_ids"])
            trained = [r.rollout_id for r in states if r.status == RolloutStatus.SUCCEEDED]
            assert len(trained) == row["rollouts"]
            spans = store.query_spans(rollout_ids=trained, limit=100_000)
            assert {s.rollout_id for s in spans} == set(trained)
    finally:
        store.close()
    assert json.loads(json.dumps(rows))  # metrics.jsonl is whole
