"""Publishing a version to a gateway through its admin API (``GET``/``POST /agl/v1/policy``).

A publish is idempotent by construction: the gateway is asked which version it serves first, and only a
gateway serving another one is sent the adapter. A gateway that cannot be reached is ``down`` (asked
again at the next look, so it gets the version when it returns, a restarted one included); one that
answers no (a wrong token, an adapter that does not fit its model) is ``refused`` with its message.
The gateway loads the adapter between two batches, so calls in flight finish on the version they began
with.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import httpx

from ..config import GatewayTargetConfig

__all__ = ["PublishResult", "publish_version", "served_version"]

_TIMEOUT = httpx.Timeout(10.0, read=300.0)  # loading an adapter can take a while on a busy machine


@dataclasses.dataclass(frozen=True)
class PublishResult:
    #: ``ok``, ``down`` or ``refused``.
    state: str
    message: str
    #: The version the gateway serves after it, when it answered.
    serving: int | None = None


def _headers(target: GatewayTargetConfig) -> dict[str, str]:
    if target.admin_token_env is None:
        return {}
    token = os.environ.get(target.admin_token_env)
    if not token:
        return {}
    return {"Authorization": f"Bearer {token}"}


def _policy_url(target: GatewayTargetConfig) -> str:
    return target.url.rstrip("/") + "/agl/v1/policy"


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
        error = body.get("error", body) if isinstance(body, dict) else body
        text = error.get("message", str(error)) if isinstance(error, dict) else str(error)
    except ValueError:
        text = response.text[:500]
    return f"HTTP {response.status_code}: {text}"


def served_version(target: GatewayTargetConfig) -> PublishResult:
    """The version ``target`` serves now (``ok``), or ``down`` with why it could not be asked."""
    try:
        response = httpx.get(_policy_url(target), timeout=_TIMEOUT)
    except httpx.HTTPError as exc:
        return PublishResult("down", f"cannot reach {target.url}: {exc or type(exc).__name__}")
    if response.status_code != 200:
        return PublishResult("down", f"{target.url} answered {_message(response)}")
    version = response.json().get("policy_version")
    return PublishResult("ok", "", version if isinstance(version, int) else None)


def publish_version(
    target: GatewayTargetConfig, version: int, adapter: Path, *, now: PublishResult | None = None
) -> PublishResult:
    """Make ``target`` serve the LoRA adapter in ``adapter`` as ``version``, unless it already does;
    ``now``: its :func:`served_version` answer when the caller has just asked (not asked again)."""
    now = now or served_version(target)
    if now.state != "ok" or now.serving == version:
        return now
    if target.admin_token_env is not None and not _headers(target):
        return PublishResult(
            "refused",
            f"the environment variable {target.admin_token_env} (improve.gateways admin_token_env) is empty;"
            " set it to the gateway's admin token",
        )
    body = {"version": version, "path": str(adapter.resolve()), "kind": "lora"}
    try:
        response = httpx.post(_policy_url(target), json=body, headers=_headers(target), timeout=_TIMEOUT)
    except httpx.HTTPError as exc:
        return PublishResult("down", f"cannot reach {target.url}: {exc or type(exc).__name__}")
    if response.status_code == 200:
        return PublishResult("ok", f"serves v{version}", version)
    if response.status_code in (502, 503, 504):
        return PublishResult("down", f"{target.url} answered {_message(response)}")
    return PublishResult("refused", f"{target.url} refused v{version}: {_message(response)}", now.serving)
