"""What the runner asks of a worker mode's engine (thread, process or async)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Protocol


class Engine(Protocol):
    """The workers of one runner in one mode. Built over the runner's ``RunState``, whose ``stopping`` and
    ``halt`` events tell the workers to take no more rollouts and to end the running ones now."""

    def start(self) -> None:
        """Start the workers; each takes rollouts from the store until ``stopping`` is set."""

    def join(self, deadline: float) -> bool:
        """Wait until every worker has ended, or until ``deadline`` (a ``time.monotonic()`` value); True
        when all have ended."""

    def close(self) -> None:
        """Release what the workers held (worker processes, the I/O pool) once they have ended or been
        given up on."""

    def kill(self) -> None:
        """End everything at once, reporting nothing more to the store (what cannot be stopped, such as a
        thread, is left to the process's exit)."""


class SlotThreads:
    """The worker slots of the thread and process engines: one daemon thread per worker, each running
    ``slot(worker_id)`` (ids ``worker-<run prefix>-<i>``), started together and joined to one deadline."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []

    def start(self, workers: int, slot: Callable[[str], None]) -> None:
        prefix = uuid.uuid4().hex[:6]
        for i in range(workers):
            worker_id = f"worker-{prefix}-{i}"
            thread = threading.Thread(target=slot, args=(worker_id,), name=f"agl-{worker_id}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def join(self, deadline: float) -> bool:
        """Wait for every slot until ``deadline`` (``time.monotonic()``); True when all have ended."""
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)
