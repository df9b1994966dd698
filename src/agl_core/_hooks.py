"""What every framework adapter shares: its hooks never break the agent.

A hook that fails logs the failure once (per hook and adapter object) and returns ``None``; the agent
runs on, untraced at that point. Only agl's own work is guarded this way: an exception raised by the
agent's code always reaches the agent unchanged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["HookErrors"]

logger = logging.getLogger("agl.adapters")


class HookErrors:
    """Collects the failures of one adapter's hooks; logs the first failure of each hook."""

    def __init__(self, framework: str) -> None:
        self.framework = framework
        self.failed: set[str] = set()
        self._lock = threading.Lock()

    def report(self, hook: str) -> None:
        """Call from an ``except`` block: logs the current exception if ``hook`` has not failed before."""
        with self._lock:
            first = hook not in self.failed
            self.failed.add(hook)
        if first:
            logger.exception(
                "agl: %s hook %s failed; the agent continues untraced there", self.framework, hook
            )

    def call(self, hook: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, or ``None`` (reported) if it raises."""
        try:
            return fn(*args, **kwargs)
        except Exception:
            self.report(hook)
            return None
