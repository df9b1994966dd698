"""Agents the runner tests run in worker processes (and through ``agl run``): module-level, so a spawned
process can import them by name.

Each does what its task says: ``{"pid_file": path}`` appends the process id to ``path`` first;
``{"sleep": s}`` sleeps; ``{"wait_for": path}`` (sync agent) waits up to a minute for ``path`` to exist;
``{"hang": true}`` sleeps for ten minutes; ``{"exit": code}`` ends the process
with ``os._exit``; ``{"segfault": true}`` crashes it in native code; ``{"raise": message}`` raises
``ValueError(message)``; then it returns ``task["reward"]`` (default ``None``).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any


def _prepare(task: dict[str, Any]) -> None:
    if task.get("pid_file"):
        with open(task["pid_file"], "a") as f:
            f.write(f"{os.getpid()}\n")


def scripted(task: dict[str, Any], llm: Any) -> Any:
    _prepare(task)
    time.sleep(task.get("sleep", 0))
    if task.get("wait_for"):
        deadline = time.monotonic() + 60
        while not os.path.exists(task["wait_for"]) and time.monotonic() < deadline:
            time.sleep(0.02)
    if task.get("hang"):
        time.sleep(600)
    if "exit" in task:
        os._exit(task["exit"])
    if task.get("segfault"):
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV
    if task.get("raise"):
        raise ValueError(task["raise"])
    return task.get("reward")


async def scripted_async(task: dict[str, Any], llm: Any) -> Any:
    _prepare(task)
    await asyncio.sleep(task.get("sleep", 0))
    if task.get("hang"):
        await asyncio.sleep(600)
    if task.get("raise"):
        raise ValueError(task["raise"])
    return task.get("reward")


def split_reward(task: dict[str, Any], llm: Any) -> float:
    """Reports the split the runner told it about: 1.0 when evaluating ("val"), 0.5 for "train", else 0."""
    if llm.evaluating:
        return 1.0 if llm.split == "val" else -1.0
    return {"train": 0.5, None: 0.0}.get(llm.split, -1.0)
