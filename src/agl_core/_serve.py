"""Running an ASGI app with uvicorn, in the foreground or on a background thread."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

__all__ = ["BackgroundServer", "serve_forever"]


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted connections only then. Without it every
    # keep-alive response waits ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another port") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _config(app: Any, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off", timeout_keep_alive=30)


class BackgroundServer:
    """Serve ``app`` on a daemon thread. ``port=0`` picks a free port; ``url`` tells which."""

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning"
    ) -> None:
        self._sock = _bind(host, port)
        bound_host, bound_port = self._sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.url = f"http://{shown}:{bound_port}"
        self.port = bound_port
        self._server = uvicorn.Server(_config(app, log_level))
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._sock]},
            name=f"agl-server-{bound_port}",
            daemon=True,
        )

    def start(self, timeout_s: float = 15.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server at {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_forever(app: Any, host: str, port: int, *, log_level: str = "info") -> None:
    """Serve ``app`` in the foreground until SIGINT / SIGTERM."""
    sock = _bind(host, port)
    uvicorn.Server(_config(app, log_level)).run(sockets=[sock])
