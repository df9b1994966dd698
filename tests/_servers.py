"""Servers the tests start as processes of their own (``agl store serve``, ``agl gateway serve``)."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:  # type: ignore[type-arg]
    """Wait until ``url`` answers 200; fail when ``proc`` exits first or ``timeout_s`` pass."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, f"{url}: the server exited ({proc.returncode}) before it answered"
        assert time.monotonic() < deadline, f"{url} did not answer within {timeout_s:.0f} s"
        time.sleep(0.1)
