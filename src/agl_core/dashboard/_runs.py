"""Training runs as the dashboard sees them: the directories ``agl train`` writes (``run.json``,
``metrics.jsonl``), read without trusting them (a run may be writing a line as it is read)."""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["RUN_FILE", "METRICS_FILE", "find_runs", "read_info", "read_run", "run_summary"]

#: What ``agl train`` writes at start and updates at the end: title, config, steps, status, times, pid.
RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
#: Lists in a step's metrics line that only the rollout table needs; left out of the curves.
_HEAVY_KEYS = ("rollout_ids", "tasks")
#: A metrics file larger than this is read from its tail only (the newest steps).
MAX_METRICS_BYTES = 64 * 1024 * 1024


def _is_run(path: Path) -> bool:
    return (path / RUN_FILE).is_file() or (path / METRICS_FILE).is_file()


def find_runs(paths: Iterable[Path]) -> dict[str, Path]:
    """Each path is a run directory, or a directory whose subdirectories are runs. Names are the
    directories' names (with their parent's when two share one)."""
    found: list[Path] = []
    for path in paths:
        path = Path(path)
        if _is_run(path):
            found.append(path)
        elif path.is_dir():
            found.extend(sorted(child for child in path.iterdir() if child.is_dir() and _is_run(child)))
    names: dict[str, Path] = {}
    for path in found:
        name = path.name
        if name in names and names[name].resolve() != path.resolve():
            name = f"{path.parent.name}/{path.name}"
        names[name] = path
    return names


def read_info(path: Path) -> dict[str, Any]:
    """The run's ``run.json`` (title, config, steps, status, times, pid); empty when missing or damaged."""
    try:
        data = json.loads((path / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _split(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The metrics lines of training steps, and those of held-out evaluations."""
    return [r for r in rows if r.get("kind") != "val"], [r for r in rows if r.get("kind") == "val"]


def _metric_lines(path: Path) -> list[dict[str, Any]]:
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - MAX_METRICS_BYTES))
            raw = fh.read()
    except OSError:
        return []
    lines = raw.split(b"\n")
    if size > MAX_METRICS_BYTES:
        lines = lines[1:]  # the first is cut
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line being written, or damaged
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def _process_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _status(info: dict[str, Any]) -> str:
    status = info.get("status")
    if not isinstance(status, str):
        return "unknown"
    if (
        status == "running"
        and info.get("host") == socket.gethostname()
        and not _process_alive(info.get("pid"))
    ):
        return "stopped"  # killed without a word (SIGKILL, power loss)
    return status


def _eta_s(train: Sequence[dict[str, Any]], total: Any, status: str) -> float | None:
    if status != "running" or not isinstance(total, int) or not train:
        return None
    seconds = [r["seconds"] for r in train if isinstance(r.get("seconds"), (int, float))]
    if not seconds:
        return None
    left = total - max(r["step"] for r in train)
    return max(0.0, float(left * statistics.median(seconds[-5:])))


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity; a figure that is not finite is shown as missing."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def held_out(val: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The first and the last held-out evaluation, per task: before, after, and the change."""
    if len(val) < 1:
        return None
    first, last = val[0], val[-1]
    before = first.get("task_scores") or {}
    after = last.get("task_scores") or {} if last is not first else {}
    tasks = []
    for task in sorted(set(before) | set(after)):
        b, a = before.get(task), after.get(task)
        change = a - b if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None
        tasks.append({"task": task, "before": b, "after": a, "change": change})
    tasks.sort(key=lambda t: -abs(t["change"] or 0.0))
    return {
        "before": {k: first.get(k) for k in ("step", "mean", "se", "n")},
        "after": {k: last.get(k) for k in ("step", "mean", "se", "n")} if last is not first else None,
        "tasks": tasks,
        "changed": sum(1 for t in tasks if t["change"]),
    }


def read_run(name: str, path: Path) -> dict[str, Any]:
    """A run's info, its per-step curves and its held-out results."""
    info = read_info(path)
    steps, val = _split(_metric_lines(path / METRICS_FILE))
    train = [{k: v for k, v in r.items() if k not in _HEAVY_KEYS} for r in steps]
    out: dict[str, Any] = _finite(
        {
            **run_summary(name, path, info=info, train=train, val=val),
            "config": info.get("config"),
            "train": train,
            "val": [{k: v for k, v in r.items() if k != "task_scores"} for r in val],
            "held_out": held_out(val),
        }
    )
    return out


def run_summary(
    name: str,
    path: Path,
    *,
    info: dict[str, Any] | None = None,
    train: Sequence[dict[str, Any]] | None = None,
    val: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """What the runs table shows of one run."""
    if info is None:
        info = read_info(path)
    if train is None or val is None:
        train, val = _split(_metric_lines(path / METRICS_FILE))
    status = _status(info)
    total = info.get("steps")
    last = train[-1] if train else {}
    updated: Any
    try:
        updated = (path / METRICS_FILE).stat().st_mtime
    except OSError:
        updated = info.get("started_at")
    summary: dict[str, Any] = _finite(
        {
            "name": name,
            # what its rollouts carry as metadata["run"] (the output folder's name; ``name`` may also
            # hold the parent's), for links to the rollouts of this run alone
            "rollouts_run": path.name,
            "path": str(path),
            "title": info.get("title") or name,
            "status": status,
            "error": info.get("error"),
            "step": max((r["step"] for r in train), default=0),
            "steps": total if isinstance(total, int) else None,
            "started_at": info.get("started_at"),
            "ended_at": info.get("ended_at"),
            "updated_at": updated,
            "eta_s": _eta_s(train, total, status),
            "phase": info.get("phase") if status == "running" else None,
            "phase_started_at": info.get("phase_started_at") if status == "running" else None,
            "mean_reward": last.get("mean_reward"),
            "val_first": val[0].get("mean") if val else None,
            "val_last": val[-1].get("mean") if len(val) > 1 else None,
            "now": time.time(),
        }
    )
    return summary
