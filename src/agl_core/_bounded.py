"""Reading lines of untrusted files without ever holding one longer than a bound."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["bounded_lines"]


def bounded_lines(stream: Any, limit: int, start: int = 1) -> Iterator[tuple[int, Any]]:
    """``(line number, line)`` of ``stream`` (text or binary, anything with ``readline(size)``), numbered
    from ``start``; ``None`` for a line longer than ``limit``, whose rest is read through in pieces of at
    most ``limit``, never held."""
    number = start - 1
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        number += 1
        if len(line) > limit:
            newline = "\n" if isinstance(line, str) else b"\n"
            while not line.endswith(newline):
                line = stream.readline(limit)
                if not line:
                    break
            yield number, None
            continue
        yield number, line
