"""The ``improve`` section: what ``agl improve`` watches, when it trains a round, how a candidate is
gated, where a promoted version is published, and when a live version is rolled back (docs/improve.md)."""

from __future__ import annotations

from typing import Literal

import pydantic

from .base import _FiniteFloat, _Strict

__all__ = ["GateConfig", "GatewayTargetConfig", "ImproveConfig", "RollbackConfig"]

_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class GateConfig(_Strict):
    """The held-out gate: the candidate and the serving version are scored on the same held-out tasks
    (``tasks.val``, at most ``validation.max_tasks``) with the ``agl eval`` scorer, and the paired change
    (candidate minus serving, with its standard error) decides."""

    #: Refuse a candidate worse than the serving version by more than this many paired standard errors.
    max_drop_se: _FiniteFloat = pydantic.Field(1.0, ge=0.0)
    #: Also refuse one that is not better by at least this many paired standard errors (unset: a
    #: candidate that is not worse beyond ``max_drop_se`` is promoted).
    min_gain_se: _FiniteFloat | None = pydantic.Field(None, ge=0.0)
    #: Evidence of no loss: refuse a candidate unless the one-sided 95% lower bound of its change
    #: (``change - 1.645 SE``) is above ``-max_loss`` (in the score's units). A tie with any noise, or a
    #: gate too small to tell, is refused; ``null`` turns it off (only ``max_drop_se`` then guards).
    max_loss: _FiniteFloat | None = pydantic.Field(0.05, ge=0.0)


class GatewayTargetConfig(_Strict):
    """A gateway a promoted version is published to (``POST /agl/v1/policy``)."""

    #: The gateway's root URL (``http://host:port``).
    url: str = pydantic.Field(pattern=r"^https?://[^\s/]+(/[^\s]*)?$")
    #: The environment variable holding its admin token. Required for a gateway that is not on loopback.
    admin_token_env: str | None = pydantic.Field(None, pattern=_ENV_NAME)
    #: A name for status lines and the lineage (default: the URL).
    name: str | None = pydantic.Field(None, min_length=1, max_length=64)

    @property
    def label(self) -> str:
        return self.name or self.url.rstrip("/")

    @property
    def address(self) -> str:
        """The gateway as a connection sees it, for telling two spellings of one URL apart: scheme and host
        in lower case, the port explicit, ``localhost`` as ``127.0.0.1``, no trailing ``/``."""
        import httpx

        parsed = httpx.URL(self.url)
        host = "127.0.0.1" if parsed.host == "localhost" else parsed.host
        host = f"[{host}]" if ":" in host else host
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        return f"{parsed.scheme}://{host}:{port}{parsed.path.rstrip('/')}"

    @pydantic.model_validator(mode="after")
    def _token_off_loopback(self) -> GatewayTargetConfig:
        import httpx

        # the host as the HTTP client that publishes will connect to it (not as a regex reads the text)
        try:
            parsed = httpx.URL(self.url)
        except httpx.InvalidURL as exc:
            raise ValueError(f"gateway url {self.url!r} is not a valid URL: {exc}") from None
        if parsed.userinfo:
            raise ValueError(
                f"gateway url {self.url!r} holds user info before an '@' (it would connect to"
                f" {parsed.host}); give http://host:port, and the admin token with admin_token_env"
            )
        if self.admin_token_env is None and parsed.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(
                f"gateway {self.url} is not on loopback: name the environment variable holding its admin"
                " token (admin_token_env: AGL_GATEWAY_ADMIN_TOKEN), the token it was started with"
                " (agl gateway serve --admin-token)"
            )
        return self


class RollbackConfig(_Strict):
    """Automatic rollback on the live reward: the late rewards of the sessions each version served."""

    #: Roll back a promoted version whose live reward falls below its predecessor's.
    auto: bool = True
    #: ... over at least this many rewarded sessions it served.
    min_sessions: int = pydantic.Field(20, ge=2)
    #: ... by more than this many standard errors of the difference of the two means.
    k_se: _FiniteFloat = pydantic.Field(2.0, gt=0.0)
    #: Live rewards outside [low, high] (and NaN or infinities) are left out of the comparison, and
    #: counted in the status: one absurd value must not decide a rollback.
    reward_range: tuple[_FiniteFloat, _FiniteFloat] = (-1e6, 1e6)

    @pydantic.model_validator(mode="after")
    def _range_valid(self) -> RollbackConfig:
        from agl_core.pipeline.rewards import RewardRange

        try:  # the rules every reward range follows (agl store serve --reward-range too)
            RewardRange(*self.reward_range)
        except ValueError as exc:
            raise ValueError(f"rollback.reward_range {list(self.reward_range)}: {exc}") from None
        return self


class ImproveConfig(_Strict):
    """``agl improve``: a long-running service training rounds from the rollouts ``traces`` selects."""

    #: The name of this service's lineage in the store (resource ``agl.improve.<name>``).
    name: str = pydantic.Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    #: A round starts when at least this many rollouts matching ``traces.filter`` (with a reward) arrived
    #: that no earlier round trained on ...
    min_new_rollouts: int = pydantic.Field(32, ge=1)
    #: ... or, when set, also every this many seconds if at least one new rollout arrived.
    every_s: _FiniteFloat | None = pydantic.Field(None, gt=0.0)
    #: Seconds between looks at the store (and at the gateways).
    poll_s: _FiniteFloat = pydantic.Field(10.0, gt=0.0, le=3600.0)
    #: Stop after this many rounds (unset: run until stopped).
    rounds: int | None = pydantic.Field(None, ge=1)
    #: What a round trains on: ``new``, the rollouts no round trained on; ``all``, every rollout the
    #: filter matches so far (each round starts from the serving version either way).
    data: Literal["new", "all"] = "new"
    #: The held-out gate, or ``none`` (said explicitly) to promote every candidate unchecked. Required.
    gate: GateConfig | Literal["none"] | None = None
    #: Where promoted versions are published. Empty: versions are trained, gated and recorded only.
    gateways: list[GatewayTargetConfig] = []
    rollback: RollbackConfig = RollbackConfig()
    #: Stop when no round could start for this many seconds (unset: wait for data forever).
    idle_exit_s: _FiniteFloat | None = pydantic.Field(None, gt=0.0)

    @pydantic.model_validator(mode="after")
    def _targets_distinct(self) -> ImproveConfig:
        if self.gate is None:
            raise ValueError(
                "improve.gate is required: a held-out gate (gate: {max_drop_se: 1.0}) that every candidate"
                " must pass before it is served, or gate: none to promote every candidate unchecked"
            )
        labels = [g.label for g in self.gateways]
        repeated = sorted({x for x in labels if labels.count(x) > 1})
        if repeated:
            raise ValueError(f"improve.gateways names {repeated[0]!r} twice; give each gateway once")
        seen: dict[str, str] = {}
        for g in self.gateways:
            if g.address in seen:
                raise ValueError(
                    f"improve.gateways lists the gateway {g.address} twice (as {seen[g.address]!r} and"
                    f" {g.url!r}); give each gateway once"
                )
            seen[g.address] = g.url
        return self
