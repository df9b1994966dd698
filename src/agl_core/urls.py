"""The gateway's URL contract: the paths it serves the OpenAI API under, the rollout-scoped base URL an
agent is handed, and the agent-scoped form of it that names the calling agent. Plain strings, no web
framework: the runner builds these URLs without the gateway's app."""

from __future__ import annotations

import urllib.parse

__all__ = [
    "AGENT_NAME_MAX_LENGTH",
    "API_PREFIXES",
    "agent_base_url",
    "agent_name_of",
    "check_agent_name",
    "rollout_base_url",
    "without_api_version",
]


_ROLLOUT = "/rollouts/{rollout_id}"
_ATTEMPT = _ROLLOUT + "/attempts/{attempt_id}"
_AGENT = "/agents/{agent_name}"
_SCOPES = ("", _ROLLOUT, _ATTEMPT)

#: Path prefixes (Starlette path templates) under which the gateway serves ``/v1/...``: unscoped, scoped to
#: a rollout, and scoped to one attempt of a rollout; then each of those naming the calling agent too
#: (``.../agents/{agent_name}``).
API_PREFIXES = (*_SCOPES, *(scope + _AGENT for scope in _SCOPES))

#: Longest agent name, in characters, that an agent-scoped URL or the agent-name header may carry.
AGENT_NAME_MAX_LENGTH = 128
_API_VERSION = "/v1"


def rollout_base_url(gateway_url: str, rollout_id: str, attempt_id: str | None = None) -> str:
    """The OpenAI ``base_url`` that attributes every call made through it to the given rollout (and to
    ``attempt_id`` when given): ``{gateway_url}/rollouts/{rollout_id}[/attempts/{attempt_id}]/v1``."""
    prefix = _ATTEMPT if attempt_id else _ROLLOUT
    return gateway_url.rstrip("/") + prefix.format(rollout_id=rollout_id, attempt_id=attempt_id) + "/v1"


def check_agent_name(name: object) -> str:
    """``name`` when it can name an agent in a URL path segment, else :class:`ValueError` saying why.

    A name is a non-empty string of at most :data:`AGENT_NAME_MAX_LENGTH` characters, without leading or
    trailing whitespace, control characters, ``/`` or ``\\`` (servers decode an escaped slash before
    routing, so it could not stay inside one segment), and other than ``.`` and ``..``. Any other character
    is allowed; :func:`agent_base_url` percent-encodes it.
    """
    if not isinstance(name, str):
        raise ValueError(f"agent name must be a string, got {type(name).__name__}")
    problem = None
    if not name:
        problem = "it is empty"
    elif len(name) > AGENT_NAME_MAX_LENGTH:
        problem = f"it is {len(name)} characters long, more than {AGENT_NAME_MAX_LENGTH}"
    elif name != name.strip():
        problem = "it starts or ends with whitespace"
    elif name in (".", ".."):
        problem = "'.' and '..' are path steps, not names"
    elif "/" in name or "\\" in name:
        slash = "/" if "/" in name else "\\"
        problem = f"it contains {slash!r}, which cannot be inside one URL path segment"
    elif any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in name):
        problem = "it contains a control character"
    if problem is not None:
        raise ValueError(f"invalid agent name {name[:AGENT_NAME_MAX_LENGTH]!r}: {problem}")
    return name


def agent_base_url(base_url: str, agent_name: str) -> str:
    """``base_url`` (a gateway base URL ending in ``/v1``, such as :func:`rollout_base_url`'s) with the
    agent named: ``{prefix}/agents/{agent_name}/v1``, the name percent-encoded. A ``base_url`` that names
    an agent already names ``agent_name`` instead. :class:`ValueError` for a name :func:`check_agent_name`
    rejects, or a ``base_url`` that does not end in ``/v1``."""
    check_agent_name(agent_name)
    trimmed = base_url.rstrip("/")
    if not trimmed.endswith(_API_VERSION):
        raise ValueError(
            f"cannot name an agent in base_url {base_url!r}: a gateway base URL ends in {_API_VERSION!r}"
        )
    prefix = trimmed[: -len(_API_VERSION)]
    head, _, _ = prefix.rpartition("/")
    if head.endswith("/agents"):
        prefix = head[: -len("/agents")]
    return f"{prefix}/agents/{urllib.parse.quote(agent_name, safe='')}{_API_VERSION}"


def without_api_version(base_url: str) -> str:
    """``base_url`` without its trailing ``/v1`` (as it is when it has none): the base URL of SDKs that add
    ``/v1/...`` themselves (the Anthropic SDK appends ``/v1/messages``)."""
    trimmed = base_url.rstrip("/")
    return trimmed[: -len(_API_VERSION)] if trimmed.endswith(_API_VERSION) else trimmed


def agent_name_of(path_name: str | None, header_name: str | None) -> str | None:
    """The agent a gateway request names: its URL's ``agents/{agent_name}`` segment, else the
    ``x-agl-agent-name`` header; ``None`` when neither does. Raises ``ValueError`` (naming where the name
    came from) for a name :func:`check_agent_name` rejects: the gateway answers 400 rather than record a
    call without the agent it was meant for."""
    for name, where in ((path_name, "the URL's agents/{name} segment"), (header_name, "x-agl-agent-name")):
        if not name:
            continue
        try:
            return check_agent_name(name)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return None
