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
import json
import os
from pathlib import Path

import httpx

from ..config import GatewayTargetConfig

__all__ = ["PublishResult", "publish_version", "served_version", "settled"]

_TIMEOUT = httpx.Timeout(10.0, read=300.0)  # loading an adapter can take a while on a busy machine
#: Asking which version a gateway serves is quick for a gateway that works: one that does not answer in
#: this long is recorded as down (and asked again at the next look), and the other gateways are served on.
_ASK_TIMEOUT = httpx.Timeout(5.0)
#: The most of a gateway's answer that is read.
_MAX_ANSWER = 65_536


@dataclasses.dataclass(frozen=True)
class PublishResult:
    #: ``ok``, ``down`` or ``refused``.
    state: str
    message: str
    #: The version the gateway serves after it, when it answered.
    serving: int | None = None
    #: The ``agl improve`` service whose versions the gateway serves (``None``: none published to it).
    owner: str | None = None


def _headers(target: GatewayTargetConfig) -> dict[str, str]:
    if target.admin_token_env is None:
        return {}
    token = os.environ.get(target.admin_token_env)
    if not token:
        return {}
    return {"Authorization": f"Bearer {token}"}


def _policy_url(target: GatewayTargetConfig) -> str:
    return target.url.rstrip("/") + "/agl/v1/policy"


def _json(response: httpx.Response) -> object:
    """The answer's JSON, or ``None`` when it is not JSON (not UTF-8, nested too deeply, too long)."""
    if len(response.content) > _MAX_ANSWER:
        return None
    try:
        return json.loads(response.content.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None


def _message(response: httpx.Response) -> str:
    body = _json(response)
    if body is None:
        text = response.content[:300].decode("utf-8", "replace")
    else:
        error = body.get("error", body) if isinstance(body, dict) else body
        text = str(error.get("message", error) if isinstance(error, dict) else error)[:500]
    return f"HTTP {response.status_code}: {text}"


def served_version(target: GatewayTargetConfig) -> PublishResult:
    """The version ``target`` serves now (``ok``), or ``down`` with why it could not be asked: it could not
    be reached in :data:`_ASK_TIMEOUT`, or it answered something other than agl's policy document."""
    try:
        response = httpx.get(_policy_url(target), timeout=_ASK_TIMEOUT)
    except httpx.HTTPError as exc:
        return PublishResult("down", f"cannot reach {target.url}: {exc or type(exc).__name__}")
    if response.status_code != 200:
        return PublishResult("down", f"{target.url} answered {_message(response)}")
    body = _json(response)
    version = body.get("policy_version", False) if isinstance(body, dict) else False
    # null: a gateway whose backend has no versions (it refuses a publish, with its reason)
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
        shown = response.content[:120].decode("utf-8", "replace")
        return PublishResult(
            "down",
            f"{target.url} answered GET /agl/v1/policy with {shown!r}, not agl's policy document"
            ' ({"policy_version": N, ...}); is it an agl gateway?',
        )
    owner = body.get("owner") if isinstance(body, dict) else None
    return PublishResult("ok", "", version, owner if isinstance(owner, str) else None)


def settled(
    target: GatewayTargetConfig, now: PublishResult, version: int, owner: str | None
) -> PublishResult | None:
    """What to record for ``target`` without publishing to it, given its :func:`served_version` answer
    ``now``: that answer when it is down or already serves ``version`` of ``owner``; ``refused`` when
    another service drives it (a gateway takes versions from one service); ``None`` when a publish is due."""
    if now.state != "ok" or (now.serving == version and now.owner in (None, owner)):
        return now
    if owner is not None and now.owner not in (None, owner):  # unnamed publishes: the gateway decides
        return PublishResult(
            "refused",
            f"{target.label} takes its versions from the agl improve service {now.owner!r} (it serves"
            f" their v{now.serving}); one service drives a gateway: remove it from improve.gateways, or"
            " restart it to hand it over",
            now.serving,
            now.owner,
        )
    return None


def publish_version(
    target: GatewayTargetConfig,
    version: int,
    adapter: Path,
    *,
    owner: str | None = None,
    now: PublishResult | None = None,
) -> PublishResult:
    """Make ``target`` serve the LoRA adapter in ``adapter`` as ``version`` of the service ``owner`` (the
    gateway's claim: it takes versions from one service only), unless it already does; ``now``: its
    :func:`served_version` answer when the caller has just asked (not asked again)."""
    now = now or served_version(target)
    done = settled(target, now, version, owner)
    if done is not None:
        return done
    if target.admin_token_env is not None and not _headers(target):
        return PublishResult(
            "refused",
            f"the environment variable {target.admin_token_env} (improve.gateways admin_token_env) is empty;"
            " set it to the gateway's admin token",
        )
    body: dict[str, object] = {"version": version, "path": str(adapter.resolve()), "kind": "lora"}
    if owner is not None:
        body["owner"] = owner
    try:
        response = httpx.post(_policy_url(target), json=body, headers=_headers(target), timeout=_TIMEOUT)
    except httpx.HTTPError as exc:
        return PublishResult("down", f"cannot reach {target.url}: {exc or type(exc).__name__}")
    if response.status_code == 200:
        return PublishResult("ok", f"serves v{version}", version, owner)
    if response.status_code in (502, 503, 504):
        return PublishResult("down", f"{target.url} answered {_message(response)}")
    return PublishResult("refused", f"{target.url} refused v{version}: {_message(response)}", now.serving)
