"""The environment variables agl reads, all in one place.

Precedence everywhere: an explicit argument, then the environment, then the default here.

=========================== ==========================================================================
``AGL_STORE_URL``           Base URL of the collector-store (default ``http://127.0.0.1:4318``).
``AGL_STORE_TOKEN``         Bearer token sent to the store, when it requires one; ``agl store serve``
                            requires it when it is not set by ``--token``.
``AGL_DASHBOARD_TOKEN``     The token the dashboard asks of visitors (else the store's token).
``AGL_GATEWAY_ADMIN_TOKEN`` The gateway's admin token (``agl gateway serve --admin-token``).
``AGL_GATEWAY_TOKEN``       The token the trainer's gateway asks of every model request (``gateway.token``);
                            required when ``gateway.host`` is not a loopback address.
``AGL_CACHE_DIR``           Where converted models are cached (default ``~/.cache/agl``).
``AGL_GATEWAY_URLS``        Comma-separated base URLs of agl gateways (``agl gateway serve``) that framework
                            adapters may send the calling agent's name to (``x-agl-agent-name``), besides
                            the gateway of the runner's rollouts (see :mod:`agl_core.capture.agent_header`).
``OTEL_EXPORTER_OTLP_*``    Standard OTLP exporter settings; when set they win over ``AGL_STORE_URL`` for
                            where spans are sent.
=========================== ==========================================================================
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_STORE_URL = "http://127.0.0.1:4318"


def store_url(explicit: str | None = None) -> str:
    return (explicit or os.environ.get("AGL_STORE_URL") or DEFAULT_STORE_URL).rstrip("/")


def store_token(explicit: str | None = None) -> str | None:
    return explicit or os.environ.get("AGL_STORE_TOKEN") or None


def dashboard_token(explicit: str | None = None, store: str | None = None) -> str | None:
    """The token the dashboard asks of visitors: ``explicit``, else ``AGL_DASHBOARD_TOKEN``, else one
    derived from the store's (``store``, else ``AGL_STORE_TOKEN``; :func:`derived_dashboard_token`): a
    store that asks a token gets a dashboard that asks one, and the dashboard's URL, log line and visitors'
    cookies never carry the store's own token, which grants every store endpoint."""
    explicit = explicit or os.environ.get("AGL_DASHBOARD_TOKEN")
    if explicit:
        return explicit
    store = store_token(store)
    return derived_dashboard_token(store) if store else None


def derived_dashboard_token(store_token: str) -> str:
    """The dashboard's own token for a store token: ``agl-dash-`` and 32 hex digits of an HMAC-SHA256 of
    the store token. It opens the dashboard (which reads the store for its visitors) and nothing else;
    the store token cannot be recovered from it."""
    digest = hmac.new(store_token.encode(), b"agl dashboard visitor token", hashlib.sha256).hexdigest()
    return "agl-dash-" + digest[:32]


def gateway_token(explicit: str | None = None) -> str | None:
    """The token the trainer's gateway asks of model requests: ``explicit``, else ``AGL_GATEWAY_TOKEN``."""
    return explicit or os.environ.get("AGL_GATEWAY_TOKEN") or None


def gateway_urls() -> tuple[str, ...]:
    """The base URLs listed in ``AGL_GATEWAY_URLS`` (comma-separated; blanks skipped), as written."""
    raw = os.environ.get("AGL_GATEWAY_URLS") or ""
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def cache_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    if explicit:
        return Path(explicit)
    env = os.environ.get("AGL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "agl"


def otlp_env_configured() -> bool:
    """True when the user set a standard OTLP traces endpoint, which then decides where spans go."""
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def is_loopback(host: str) -> bool:
    """Whether a server listening on ``host`` is reachable from this machine only: ``localhost``,
    127.0.0.0/8 or ``::1``. A wildcard (``0.0.0.0``, ``::``), any other address and any other name count as
    reachable from elsewhere, where a server must ask for a token."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


_URL_PASSWORD = re.compile(r"(://[^/@:\s]*:)[^/@\s]+@")
_QUERY_PASSWORD = re.compile(r"([?&](?:password|passwd|sslpassword)=)[^&\s]*", re.IGNORECASE)


def masked_url(text: str) -> str:
    """``text`` with the password of every URL in it masked: ``postgresql://user:***@host/db`` (and a
    ``?password=`` query parameter). Whatever shows or stores a URL a user gave goes through this."""
    return _QUERY_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))


_SECRET_KEY = re.compile(
    r"(?:^|_)(?:token|secret|password|passwd|api_?key|access_key|private_key|credentials?)$"
)


def masked_config(config: Any) -> Any:
    """``config`` with the values of secret-looking keys (``token``, ``*_token``, ``password``,
    ``*_api_key``, ...) and the passwords in URLs (``scheme://user:***@host``) replaced by ``***``."""
    if isinstance(config, Mapping):
        return {
            k: "***" if v is not None and _SECRET_KEY.search(str(k).lower()) else masked_config(v)
            for k, v in config.items()
        }
    if isinstance(config, list | tuple):
        return [masked_config(v) for v in config]
    if isinstance(config, str):
        return masked_url(config)
    return config
