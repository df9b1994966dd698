"""What the runner asks of a worker mode's engine (thread, process or async)."""

from __future__ import annotations

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
