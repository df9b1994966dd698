"""Ctrl-C and SIGTERM during ``agl train`` and ``agl eval``: raised as ``KeyboardInterrupt`` in the main
thread (:class:`Terminated` for SIGTERM) and noted, so a command tells a signal from an error whatever
exception it surfaced as, and ends the way the shell expects (130, 143)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

__all__ = ["Terminated", "received", "stop_on_signals"]


#: The signals received during the current ``run_train`` or ``agl eval`` (SIGINT, SIGTERM).
received: list[int] = []


@contextlib.contextmanager
def stop_on_signals() -> Iterator[list[int]]:
    """SIGINT and SIGTERM raise ``KeyboardInterrupt`` (:class:`Terminated` for SIGTERM) in the main thread
    while inside, and are noted in :data:`received` (yielded), so a command can tell a signal from an
    error whatever exception it surfaced as; the previous handlers come back after."""
    received.clear()
    previous = (
        {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)} if _main_thread() else {}
    )
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C is, so a terminated run ends the same clean way."""


def _stop(signum: int, frame: object) -> None:
    received.append(signum)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
