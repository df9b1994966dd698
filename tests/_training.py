"""Shared pieces of the tests that run ``agl train`` as a user does: the CLI in a subprocess, then its
``metrics.jsonl``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def train_cli(config: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``agl train CONFIG ARGS...`` to completion; fails the test with the output's tail if it exits non-zero."""
    done = subprocess.run(
        [sys.executable, "-m", "agl_core.cli", "train", str(config), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def metrics_rows(out: Path, kind: str | None = None) -> list[dict]:
    """The rows of ``OUT/metrics.jsonl`` in order, only those of ``kind`` ("train", "val") if given."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if kind is None or r["kind"] == kind]
