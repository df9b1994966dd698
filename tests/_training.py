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
