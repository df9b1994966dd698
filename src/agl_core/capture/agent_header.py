"""The calling agent's name on each model request: the ``x-agl-agent-name`` header the framework adapters
add, so that the gateway knows which agent makes a call from the agent's first call on.

Three pieces, used by ``agl_langchain``, ``agl_openai_agents`` and ``agl_autogen``:

- The agent making the model call now, in a :class:`~contextvars.ContextVar`: an adapter sets it
  (:func:`set_agent` / :func:`reset_agent`, or :func:`agent_scope`) exactly where the framework starts a
  model call, in the thread or task that then sends the HTTP request, and puts the previous value back
  when the call ends. Each asyncio task and each thread sees its own value, so concurrent agents never
  see each other's names.
- The gateways the header may go to (:func:`register_gateway`, :func:`is_gateway_url`): the gateway of
  the runner's rollouts (the runner registers the origin of ``LLM.base_url`` for every rollout it runs)
  and those listed in ``AGL_GATEWAY_URLS`` (comma-separated base URLs, for agents running in production
  against ``agl gateway serve``). An origin is scheme, host and port; nothing else ever gets the header.
- A hook on ``Client.send`` and ``AsyncClient.send`` of ``httpx`` and, where it is installed, of
  ``httpx2`` (its successor, which recent ``openai``, ``anthropic`` and Agents SDK releases use): the HTTP
  clients of every framework's model client. It is installed while at least one adapter is
  instrumented (:func:`install_httpx_hook` / :func:`uninstall_httpx_hook`, reference-counted per
  adapter). It adds ``x-agl-agent-name: <name>`` to a request when an agent is set, the request goes to
  a known gateway, it does not carry the header already, and the gateway would accept the name
  (:func:`~agl_core.urls.check_agent_name`, and ASCII only: HTTP header values are bytes, and the
  gateway reads them as Latin-1). A name the gateway cannot take is not sent; name such an agent with
  ``llm.for_agent(name)``, whose URL percent-encodes it.

``import agl_core.capture.agent_header`` does not import httpx; installing the hook does. The hook sees the
request ``send`` is given; a redirect the gateway answered with would carry the header on (agl's gateway never
redirects).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import os
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from contextvars import ContextVar, Token
from typing import Any, Protocol

from .. import semconv, settings
from ..instrumentation import HookErrors, Instrumentor, Patches

__all__ = [
    "HEADER",
    "agent_scope",
    "current_agent",
    "gateway_origins",
    "httpx_hook_installed",
    "install_httpx_hook",
    "is_gateway_url",
    "register_gateway",
    "reset_agent",
    "set_agent",
    "uninstall_httpx_hook",
    "unregister_gateway",
]

logger = logging.getLogger("agl.adapters")

#: The header naming the calling agent (``x-agl-agent-name``).
HEADER = semconv.HEADER_AGENT_NAME

# --- the calling agent -------------------------------------------------------------------------------
_agent: ContextVar[str | None] = ContextVar("agl_calling_agent", default=None)


def current_agent() -> str | None:
    """The agent whose model call runs in this context, as an adapter set it; ``None`` outside one."""
    return _agent.get()


def set_agent(name: str | None) -> Token[str | None]:
    """Make ``name`` the calling agent of this context; hand the token to :func:`reset_agent` when the
    model call ends."""
    return _agent.set(name)


def reset_agent(token: Token[str | None]) -> None:
    """Put back the calling agent :func:`set_agent` replaced. A token of another context (a call ended
    somewhere else than it started: nothing of it is left here) or one already used is ignored."""
    try:  # not contextlib.suppress: this runs at the end of every model call
        _agent.reset(token)
    except (ValueError, RuntimeError):
        pass


@contextlib.contextmanager
def agent_scope(name: str | None) -> Iterator[None]:
    """``name`` is the calling agent inside the block (the previous one after it). ``None`` changes
    nothing: an enclosing agent, if any, stays the caller."""
    if not name:
        yield
        return
    token = _agent.set(name)
    try:
        yield
    finally:
        reset_agent(token)


# --- the gateways the header may go to ---------------------------------------------------------------
_Origin = tuple[str, str, int]
_DEFAULT_PORTS = {"http": 80, "https": 443}
_registered: set[_Origin] = set()
_registered_lock = threading.Lock()
_env_cache: tuple[str, frozenset[_Origin]] = ("", frozenset())


def _origin(scheme: str, host: str | None, port: int | None) -> _Origin | None:
    scheme = scheme.lower()
    if not host or scheme not in _DEFAULT_PORTS:
        return None
    return scheme, host.lower(), port if port is not None else _DEFAULT_PORTS[scheme]


def _origin_of_url(url: str) -> _Origin | None:
    """``(scheme, host, port)`` of an ``http(s)`` URL; ``None`` for anything else. ``ValueError`` for a
    port that is not a number."""
    parts = urllib.parse.urlsplit(url.strip())
    return _origin(parts.scheme, parts.hostname, parts.port)


def register_gateway(url: str) -> None:
    """Let the adapters send the calling agent's name to the gateway at ``url`` (any URL of it: its
    origin, scheme + host + port, is what counts); registering it again changes nothing. The runner
    calls it with each rollout's ``LLM.base_url``. ``ValueError`` for a URL that is not
    ``http(s)://host[:port]...``."""
    origin = _origin_of_url(url)
    if origin is None:
        raise ValueError(f"not an http(s) URL with a host: {url!r}")
    with _registered_lock:
        _registered.add(origin)


def unregister_gateway(url: str) -> None:
    """Forget the gateway :func:`register_gateway` registered at ``url``'s origin (``AGL_GATEWAY_URLS``
    still counts). Unknown URLs are ignored."""
    try:
        origin = _origin_of_url(url)
    except ValueError:
        return
    if origin is not None:
        with _registered_lock:
            _registered.discard(origin)


def _env_origins() -> frozenset[_Origin]:
    global _env_cache
    raw = os.environ.get("AGL_GATEWAY_URLS") or ""
    cached_raw, cached = _env_cache
    if raw == cached_raw:
        return cached
    origins = set()
    for url in settings.gateway_urls():
        try:
            origin = _origin_of_url(url)
        except ValueError:
            origin = None
        if origin is None:
            logger.warning("agl: AGL_GATEWAY_URLS: %r is not an http(s) URL with a host; skipped", url)
        else:
            origins.add(origin)
    found = frozenset(origins)
    _env_cache = (raw, found)
    return found


def gateway_origins() -> frozenset[tuple[str, str, int]]:
    """The ``(scheme, host, port)`` of every gateway the header may go to now: registered, or listed in
    ``AGL_GATEWAY_URLS``."""
    with _registered_lock:
        registered = frozenset(_registered)
    return registered | _env_origins()


class _URL(Protocol):
    """What the hook reads of an ``httpx.URL`` / ``httpx2.URL``."""

    @property
    def scheme(self) -> str: ...

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int | None: ...


def is_gateway_url(url: str | _URL) -> bool:
    """Whether ``url`` (a string, or an ``httpx`` / ``httpx2`` URL) is on a known gateway's origin (see
    :func:`gateway_origins`)."""
    if isinstance(url, str):
        try:
            origin = _origin_of_url(url)
        except ValueError:
            return False
    else:
        origin = _origin(url.scheme, url.host, url.port)
    return origin is not None and (origin in _registered or origin in _env_origins())


# --- the httpx hook ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def _sendable(name: str) -> bool:
    """Whether the gateway takes ``name`` in the header: a valid agent name, in ASCII."""
    # here, not at import: process-mode workers import this module and start without the gateway package
    from ..urls import check_agent_name

    try:
        check_agent_name(name)
    except ValueError:
        return False
    return name.isascii()


def _label(request: Any) -> None:
    # Runs on every request the process sends: cheapest checks first (no known gateway is the common
    # case outside a runner), the request's URL and headers are read last.
    name = _agent.get()
    if not name or not (_registered or _env_origins()):
        return
    if not _sendable(name) or not is_gateway_url(request.url) or HEADER in request.headers:
        return
    request.headers[HEADER] = name


@dataclasses.dataclass
class _Hook:
    patches: Patches
    hook_errors: HookErrors
    #: False once uninstalled where the wrappers could not be taken out (see :func:`uninstall_httpx_hook`).
    active: bool = True

    def label(self, request: Any) -> None:
        if self.active:
            try:
                _label(request)
            except Exception:  # never break the request
                self.hook_errors.report("send")

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def send(client: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            self.label(request)
            # bound the way attribute access would bind it (another wrapper may need the instance)
            return original.__get__(client, type(client))(request, *args, **kwargs)

        return send

    def wrap_async(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        async def send(client: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            self.label(request)
            return await original.__get__(client, type(client))(request, *args, **kwargs)

        return send


#: The HTTP client packages whose ``Client`` / ``AsyncClient`` get the hook, each where it is installed.
_CLIENT_PACKAGES = ("httpx", "httpx2")


def _install() -> _Hook:
    hook = _Hook(Patches(), HookErrors("httpx"))
    try:
        for name in _CLIENT_PACKAGES:
            try:
                package = importlib.import_module(name)
            except ImportError:
                continue
            hook.patches.replace(package.Client, "send", hook.wrap(vars(package.Client)["send"]))
            hook.patches.replace(
                package.AsyncClient, "send", hook.wrap_async(vars(package.AsyncClient)["send"])
            )
    except BaseException:
        hook.patches.restore()
        raise
    return hook


def _uninstall(hook: _Hook) -> None:
    hook.active = False
    if not hook.patches.restore():
        logger.info("agl: httpx's send was wrapped again after agl; agl's wrapper stays, switched off")


_hook: Instrumentor[_Hook] = Instrumentor(_uninstall)
_users: set[str] = set()
_users_lock = threading.Lock()


def install_httpx_hook(user: str) -> None:
    """Install the header hook on httpx / httpx2 (once per process) for ``user`` (an adapter's name); it stays
    while any user holds it. Cheap when ``user`` holds it already."""
    if user in _users and _hook.is_instrumented():
        return
    with _users_lock:
        _hook.instrument(_install)
        _users.add(user)


def uninstall_httpx_hook(user: str) -> None:
    """``user`` no longer needs the hook; the last user out takes it off httpx (the exact originals go
    back; where something wrapped ``send`` after agl, agl's wrapper stays there, switched off)."""
    with _users_lock:
        _users.discard(user)
        if not _users:
            _hook.uninstrument()


def httpx_hook_installed() -> bool:
    """Whether the header hook is on httpx (and httpx2) now."""
    return _hook.is_instrumented()
