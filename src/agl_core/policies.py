"""Which policy serves which agent, when each agent of a multi-agent system trains its own LoRA adapter.

A policy is a name and the agent names it serves, as names or ``fnmatch`` globs (``writer``, ``fix_*``).
:class:`PolicyRouter` answers, for the agent name a call carries, the policy serving it: the one policy
whose patterns match, else the default (``None``: the untrained base model). An agent two policies match
is an error naming both, never a silent pick; :meth:`PolicyRouter.check` finds the overlaps a config
shows before anything runs (a literal name both match, or the same pattern twice).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence

__all__ = [
    "BASE",
    "AmbiguousAgentError",
    "PolicyRouter",
    "check_policy_name",
    "policy_mismatch",
    "trained_policy",
]

#: The name spans and metrics give the base model when it serves an agent no policy trains.
BASE = "base"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_GLOB = re.compile(r"[*?\[]")


def check_policy_name(name: object) -> str:
    """``name`` when it is a valid policy name (1 to 64 letters, digits and ``_ . -``, starting with a
    letter or digit, not ``base``); ``ValueError`` otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"policy name {str(name)[:80]!r}: use 1 to 64 letters, digits and _ . -, starting with a letter"
            " or digit"
        )
    if name == BASE:
        raise ValueError(f"policy name {BASE!r} is reserved for the base model; choose another name")
    return name


class AmbiguousAgentError(ValueError):
    """An agent name matched by the patterns of two policies."""


class PolicyRouter:
    """Maps agent names to policy names; ``policies`` is ``{policy: [agent name or glob, ...]}`` in order.

    ``default`` serves agents no policy names and calls that carry no agent name: a policy's name, or
    ``None`` for the base model."""

    def __init__(self, policies: Mapping[str, Sequence[str]], default: str | None = None) -> None:
        self.policies = {check_policy_name(name): tuple(patterns) for name, patterns in policies.items()}
        for name, patterns in self.policies.items():
            if not patterns or not all(isinstance(p, str) and p for p in patterns):
                raise ValueError(f"policy {name!r}: give the agents it serves (names or globs), none empty")
        if default is not None and default not in self.policies:
            raise ValueError(
                f"the default policy {default!r} is not one of the policies ({', '.join(self.policies)});"
                f" name one of them, or {BASE!r} for the base model"
            )
        self.default = default
        self._cache: dict[str, str | None] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.policies)

    def check(self) -> None:
        """Raise :class:`AmbiguousAgentError` for patterns that certainly overlap: a pattern of one policy
        that another's matches, or the same pattern in two policies."""
        items = list(self.policies.items())
        for i, (a, a_patterns) in enumerate(items):
            for b, b_patterns in items[i + 1 :]:
                for pa in a_patterns:
                    for pb in b_patterns:
                        literal_a, literal_b = not _GLOB.search(pa), not _GLOB.search(pb)
                        if (
                            pa == pb
                            or (literal_a and fnmatch.fnmatchcase(pa, pb))
                            or (literal_b and fnmatch.fnmatchcase(pb, pa))
                        ):
                            shown = pa if pa == pb or literal_a else pb
                            raise AmbiguousAgentError(
                                f"agent {shown!r} is matched by policy {a!r} ({pa!r}) and by policy {b!r}"
                                f" ({pb!r}); an agent belongs to one policy: narrow one of the patterns"
                            )

    def policy_for(self, agent: str | None) -> str | None:
        """The policy serving ``agent`` (``None``: the base model). Raises :class:`AmbiguousAgentError`
        when two policies match it."""
        if agent is None:
            return self.default
        if agent in self._cache:
            return self._cache[agent]
        matched = [
            name
            for name, patterns in self.policies.items()
            if any(fnmatch.fnmatchcase(agent, p) for p in patterns)
        ]
        if len(matched) > 1:
            raise AmbiguousAgentError(
                f"agent {agent!r} is matched by policies {matched[0]!r} and {matched[1]!r}; an agent belongs"
                " to one policy: narrow their agents patterns"
            )
        found = matched[0] if matched else self.default
        if len(self._cache) < 10_000:
            self._cache[agent] = found
        return found


def trained_policy(router: PolicyRouter, agent: str | None, served_by: str | None) -> str | None:
    """The policy whose adapter a call trains (``None``: none, the base model is never trained).

    The policy the gateway recorded as serving the call (``agl.policy.name``) decides when recorded:
    ``base`` trains nothing, and neither does a policy this run does not have. Only calls recorded
    without one (a gateway that serves one policy, older spans) fall back to the agent's policy by name."""
    if served_by is None:
        return router.policy_for(agent)
    if served_by == BASE or served_by not in router.policies:
        return None
    return served_by


def policy_mismatch(router: PolicyRouter, agent: str | None, served_by: str | None) -> str | None:
    """A sentence for a call whose recorded serving policy is not its agent's (``None`` when they agree
    or nothing was recorded): what happened and what to change."""
    if served_by is None:
        return None
    own = router.policy_for(agent) or BASE
    if own == served_by:
        return None
    shown = repr(agent) if agent else "without a name"
    return (
        f"calls of agent {shown} were served by {served_by!r}, but the config gives that agent policy"
        f" {own!r}: they train {'nothing' if served_by == BASE else repr(served_by)}, never {own!r}. The"
        " gateway picks the policy from the agent name it sees in the request: call it through"
        " llm.for_agent(NAME) (its base_url names the agent) or send the x-agl-agent-name header"
    )
