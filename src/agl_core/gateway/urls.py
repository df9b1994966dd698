"""The gateway's URL contract: the paths it serves the OpenAI API under, and the rollout-scoped base URL
an agent is handed. Plain strings, no web framework: the runner builds these URLs without the gateway's
app."""

from __future__ import annotations

__all__ = ["API_PREFIXES", "rollout_base_url"]

_ROLLOUT = "/rollouts/{rollout_id}"
_ATTEMPT = _ROLLOUT + "/attempts/{attempt_id}"

#: Path prefixes (Starlette path templates) under which the gateway serves ``/v1/...``: unscoped, scoped to
#: a rollout, and scoped to one attempt of a rollout.
API_PREFIXES = ("", _ROLLOUT, _ATTEMPT)


def rollout_base_url(gateway_url: str, rollout_id: str, attempt_id: str | None = None) -> str:
    """The OpenAI ``base_url`` that attributes every call made through it to the given rollout (and to
    ``attempt_id`` when given): ``{gateway_url}/rollouts/{rollout_id}[/attempts/{attempt_id}]/v1``."""
    prefix = _ATTEMPT if attempt_id else _ROLLOUT
    return gateway_url.rstrip("/") + prefix.format(rollout_id=rollout_id, attempt_id=attempt_id) + "/v1"
