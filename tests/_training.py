"""Shared pieces of the tests that run ``agl train`` as a user does: the CLI in a subprocess, then its
``metrics.jsonl``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

#: How long a training run may print nothing before it counts as hung. A step of the examples' reduced
#: runs prints within about two minutes on a quiet 2-core machine and within six on a busy one; this is
#: several times that, so a slow machine never fails a run that is still making progress.
STALL_S = 1200.0


def _drain(stream: object, sink: list[str], last_output: list[float]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        sink.append(line)
        last_output[0] = time.monotonic()


def train_cli(
    config: Path, *args: str, timeout: float = 300, stall_s: float = STALL_S, returncode: int = 0
) -> subprocess.CompletedProcess[str]:
    """``agl train CONFIG ARGS...`` to completion; fails the test with the output's tail if it exits with
    another status than ``returncode``.

    A hang detector rather than a time limit: the run is killed, and the test fails, when it prints
    nothing for ``max(timeout, stall_s)`` seconds (a run that keeps printing progress on a busy machine
    goes on), or when it runs past four times that in all.
    """
    quiet_limit = max(timeout, stall_s)
    proc = subprocess.Popen(
        [sys.executable, "-m", "agl_core.cli", "train", str(config), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    out: list[str] = []
    err: list[str] = []
    last_output = [time.monotonic()]
    readers = [
        threading.Thread(target=_drain, args=(proc.stdout, out, last_output), daemon=True),
        threading.Thread(target=_drain, args=(proc.stderr, err, last_output), daemon=True),
    ]
    for reader in readers:
        reader.start()
    started = time.monotonic()
    why = ""
    while proc.poll() is None:
        now = time.monotonic()
        if now - last_output[0] > quiet_limit:
            why = f"agl train printed nothing for {quiet_limit:.0f} s; killed as hung"
        elif now - started > 4 * quiet_limit:
            why = f"agl train ran past {4 * quiet_limit:.0f} s; killed"
        if why:
            proc.kill()
            break
        time.sleep(0.5)
    proc.wait()
    for reader in readers:
        reader.join(timeout=10)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, "".join(out), "".join(err))
    assert not why, why + "\n" + done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == returncode, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def metrics_rows(out: Path, kind: str | None = None) -> list[dict]:
    """The rows of ``OUT/metrics.jsonl`` in order, only those of ``kind`` ("train", "val") if given."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if kind is None or r["kind"] == kind]


class Turns:
    """Rewards that depend only on how often a task was run: its 1st, 3rd ... rollout scores 1, the others
    0. Every training group then holds a 1 and a 0 (so the step trains), and a validation task scores 1
    before training and 0 after it, whatever the order the workers run them in."""

    def __init__(self) -> None:
        self._seen: Counter[str] = Counter()
        self._lock = threading.Lock()

    def reward(self, task: dict[str, Any]) -> float:
        with self._lock:
            self._seen[task["id"]] += 1
            return float(self._seen[task["id"]] % 2)


#: A one-step training job on the tiny random model with a LoRA adapter, runners in threads: the base of the
#: in-process ``Trainer`` tests (each adds its output_dir and what it tests).
TINY_JOB: dict[str, Any] = {
    "model": {"source": "tiny", "lora": {"r": 4, "alpha": 8}},
    "gateway": {"default_max_tokens": 3},
    "train": {"steps": 1, "tasks_per_step": 2, "rollouts_per_task": 2},
    "logging": {"plot": False, "tensorboard": False, "progress": "plain"},
    "runner": {"workers": 4, "mode": "thread"},
}

_ROOT = Path(__file__).resolve().parent.parent


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of an ``agl`` subprocess run from this source tree, with ``extra`` variables."""
    return {**os.environ, "PYTHONPATH": f"{_ROOT / 'src'}:{_ROOT / 'trainer'}", **extra}


def marking_agent(pause_s: float) -> str:
    """The source of an agent module for runners in other processes: one chat call, a ``pause_s`` tool
    call, a reward from the reply's length. While a rollout runs, a file ``<pid>-<task>-<ns>`` exists in
    ``$AGL_TEST_MARKS``, so a test can kill the process of a runner in the middle of one."""
    return f"""
import os, time
from pathlib import Path

import openai


def solve(task, llm):
    mark = Path(os.environ["AGL_TEST_MARKS"]) / f"{{os.getpid()}}-{{task['id']}}-{{time.monotonic_ns()}}"
    mark.touch()
    try:
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
        reply = client.chat.completions.create(
            model=llm.model, messages=[{{"role": "user", "content": task["q"]}}], max_tokens=4
        )
        time.sleep({pause_s})
        return float(len(reply.choices[0].message.content or "") % 2)
    finally:
        mark.unlink()
"""


def served_by(store_file: Path) -> Counter[tuple[str | None, str]]:
    """The gateway calls in a run's store by (the agent that made it, the policy that served it)."""
    from agl_core import semconv
    from agl_core.store import SqliteStore

    store = SqliteStore(str(store_file))
    try:
        spans = [s for s in store.query_spans(limit=100_000) if semconv.POLICY_NAME in s.attributes]
    finally:
        store.close()
    return Counter(
        (
            str(s.attributes[semconv.GEN_AI_AGENT_NAME])
            if semconv.GEN_AI_AGENT_NAME in s.attributes
            else None,
            str(s.attributes[semconv.POLICY_NAME]),
        )
        for s in spans
    )
