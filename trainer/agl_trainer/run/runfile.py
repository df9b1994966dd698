"""``output_dir/run.json``: what a run is and how it stands, for the dashboard and for people: its title,
config, steps, status (``running``, ``finished``, ``failed``, ``interrupted``), what a running run is
doing now (``phase``, since ``phase_started_at``), times and process."""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

from agl_core.dashboard import RUN_FILE

__all__ = ["RUN_FILE", "RunFile"]


class RunFile:
    """Written at start (``running``), rewritten when the run ends; used as the exit handler of the run's
    ``ExitStack`` so that an error or Ctrl-C is recorded too."""

    def __init__(self, out: Path, *, title: str, config: dict[str, Any], steps: int, resumed: bool) -> None:
        self.path = out / RUN_FILE
        self.data: dict[str, Any] = {
            "title": title,
            "status": "running",
            "steps": steps,
            "started_at": time.time(),
            "ended_at": None,
            "phase": "starting",
            "phase_started_at": time.time(),
            "resumed": resumed,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "config": config,
        }
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)

    def phase(self, what: str) -> None:
        """What the run is doing from now on (``held-out pass before training``, ``step 3 of 12``...)."""
        self.data.update(phase=what, phase_started_at=time.time())
        self._write()

    def end(self, status: str, error: str | None = None) -> None:
        self.data.update(status=status, ended_at=time.time(), error=error, phase=None)
        self._write()

    def __call__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None:
            self.end("finished")
        elif isinstance(exc, KeyboardInterrupt):
            self.end("interrupted")
        else:
            line = traceback.format_exception_only(type(exc), exc)[-1].strip()
            self.end("failed", line[:2000])
        return False  # never swallow the exception
