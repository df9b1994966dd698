"""Serving an ASGI app (the store, the gateway, a test double) with uvicorn.

:class:`BackgroundServer` runs one on a daemon thread of this process (tests, the trainer's embedded
services); :func:`serve_forever` runs one in the foreground (the ``agl ... serve`` commands). Both bind
the socket themselves before uvicorn starts, so a port already in use fails at once with an
:class:`OSError` naming it, and both turn on TCP_NODELAY (small keep-alive responses are not delayed).
The app runs with ``lifespan="off"``: startup/shutdown events are not sent, so an app must not rely on them.

A request HTTP itself forbids (a control character in a header, a malformed request line) never reaches
the app: uvicorn answers it with a 400. Here that 400 is JSON in the shape both OpenAI and Anthropic
clients read (``{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}``), saying
what is wrong, instead of uvicorn's plain "Invalid HTTP request received."
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

__all__ = ["BackgroundServer", "ListenError", "StopSignals", "listen", "port_problem", "serve_forever"]


class ListenError(OSError):
    """An address that cannot be listened on (a port in use, a host not on this machine); the message
    names it."""


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
        raise ListenError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another port"
        ) from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


#: The body of the 400 for a request HTTP forbids.
BAD_HTTP_MESSAGE = (
    "invalid HTTP request: a header name or value holds a character HTTP does not allow (a control"
    " character such as \\x01, DEL or a line break; header values such as x-agl-session-id must be text"
    " without them), or the request line is malformed"
)
_BAD_HTTP_BODY = json.dumps(
    {"type": "error", "error": {"type": "invalid_request_error", "message": BAD_HTTP_MESSAGE, "code": None}}
).encode()


def _json_400_protocol() -> type[Any]:
    """uvicorn's HTTP protocol class with :data:`BAD_HTTP_MESSAGE` as JSON for its protocol-level 400."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class _Json400(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        def send_400_response(self, msg: str) -> None:
            head = (
                b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                b"content-length: " + str(len(_BAD_HTTP_BODY)).encode() + b"\r\nconnection: close\r\n\r\n"
            )
            self.transport.write(head + _BAD_HTTP_BODY)
            self.transport.close()

    return _Json400


def _config(app: Any, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        timeout_keep_alive=30,
        http=_json_400_protocol(),
    )


class BackgroundServer:
    """Serve ``app`` on a daemon thread of this process.

    The socket is bound in the constructor (``port=0`` picks a free port; :attr:`url` and :attr:`port`
    tell which), so ``url`` is known before :meth:`start`; an address in use raises :class:`OSError`
    there. :meth:`start` returns once uvicorn accepts connections (RuntimeError after ``timeout_s``
    seconds); :meth:`stop` asks it to exit, waits up to ``timeout_s`` seconds and closes the socket.
    As a context manager it starts on entry and stops on exit. uvicorn installs no signal handlers:
    the process's own SIGINT / SIGTERM handling is left alone. A stopped server cannot be started again.
    """

    #: ``http://HOST:PORT`` of the bound socket (IPv6 hosts in brackets), without a trailing slash.
    url: str
    #: The bound port (the free one chosen when ``port=0``).
    port: int

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning"
    ) -> None:
        self._sock = _bind(host, port)
        bound_host, bound_port = self._sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.url = f"http://{shown}:{bound_port}"
        self.port = bound_port
        self._server = uvicorn.Server(_config(app, log_level))
        # No signal handlers: uvicorn (>= 0.29) installs them only when it runs on the main thread.
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


class StopSignals:
    """SIGINT and SIGTERM noted instead of acted on, for a server command that cleans up after uvicorn
    stopped: uvicorn handles them while it runs, then re-raises each to the handler it found, which is
    this one. :attr:`exit_code` is then the shell's convention for a process a signal ended (130 for
    SIGINT, 143 for SIGTERM), 0 when none came."""

    def __init__(self) -> None:
        self.received: int | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    @property
    def exit_code(self) -> int:
        return 128 + self.received if self.received is not None else 0


def listen(host: str, port: int) -> socket.socket:
    """A socket bound and listening on ``host:port`` (for :func:`serve_forever`'s ``sock``): a command
    binds before its slow start-up (loading a model), so a port in use is said at once. Raises
    :class:`ListenError` naming the address."""
    return _bind(host, port)


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now (``None``: it can; port 0 always can). The port is let go
    again at once: a check before a slow start, not a reservation."""
    if port == 0:
        return None
    try:
        _bind(host, port).close()
    except ListenError as exc:
        return str(exc)
    return None


def serve_forever(
    app: Any,
    host: str,
    port: int,
    *,
    log_level: str = "info",
    on_bound: Callable[[int], None] | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Serve ``app`` on ``host:port`` (or on ``sock``, from :func:`listen`) in the foreground; returns once
    SIGINT / SIGTERM stopped uvicorn.

    Raises :class:`OSError` naming the address when it cannot be bound. uvicorn installs its own
    handlers for SIGINT / SIGTERM while it runs and re-raises the signal to the handlers it found
    afterwards, so install a handler that returns first if the caller must clean up after it.
    """
    sock = sock if sock is not None else _bind(host, port)
    if on_bound is not None:  # the port chosen, when 0 asked for any
        on_bound(sock.getsockname()[1])
    uvicorn.Server(_config(app, log_level)).run(sockets=[sock])
