"""Prompt policies: a versioned system instruction and few-shot demonstration turns per agent that the
gateway applies to that agent's chat calls, so an agent improves without a change to its code or weights.

The agent sends its own messages; the gateway replaces (or prepends to) the system instruction and inserts
the demonstrations after it, before the conversation, then renders the prompt from the result: the token
ids a span records (and a trainer trains on) are those of the prompt the model saw. Published, replaced
and withdrawn through ``/agl/v1/prompt`` with the admin token, like policy versions; every call records
which prompt version served it (``agl.prompt.version``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "MAX_DEMONSTRATION_TURNS",
    "MAX_PROMPT_BYTES",
    "PromptPolicies",
    "PromptPolicy",
    "parse_prompt_policy",
]

#: The most demonstration messages one prompt policy holds (user / assistant turns).
MAX_DEMONSTRATION_TURNS = 64
#: The most text (system instruction and demonstrations together) one prompt policy holds, in UTF-8 bytes.
MAX_PROMPT_BYTES = 256_000
_MODES = ("replace", "prepend")


@dataclasses.dataclass(frozen=True)
class PromptPolicy:
    """One published prompt: for ``agent`` (``None``: every agent that has none of its own)."""

    version: int
    agent: str | None
    #: The system instruction; ``None`` leaves the agent's own as it is.
    system: str | None
    #: ``replace``: the agent's system message is replaced; ``prepend``: ``system`` goes before it.
    mode: str
    #: User / assistant turns, alternating, starting with a user turn, inserted before the conversation.
    demonstrations: tuple[tuple[str, str], ...]

    def apply(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` as the model sees them under this prompt."""
        out = [dict(m) for m in messages]
        leading = 0
        while leading < len(out) and out[leading].get("role") in ("system", "developer"):
            leading += 1
        if self.system is not None:
            own = out[0] if leading else None
            if own is None:
                out.insert(0, {"role": "system", "content": self.system})
                leading = 1
            elif self.mode == "replace":
                out[0] = {**own, "content": self.system}
            else:
                text = own.get("content")
                joined = self.system if not isinstance(text, str) or not text else f"{self.system}\n\n{text}"
                out[0] = {**own, "content": joined}
        shots = [{"role": role, "content": content} for role, content in self.demonstrations]
        return out[:leading] + shots + out[leading:]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "agent": self.agent,
            "system": self.system,
            "mode": self.mode,
            "demonstrations": [{"role": r, "content": c} for r, c in self.demonstrations],
        }


def parse_prompt_policy(body: object) -> PromptPolicy:
    """A prompt policy from a publish's JSON body; ``ValueError`` saying what is wrong and the shape
    expected."""
    if not isinstance(body, dict):
        raise ValueError(f"the body is a JSON {type(body).__name__}, not an object")
    unknown = sorted(set(body) - {"version", "agent", "system", "mode", "demonstrations"})
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}")
    version = body.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an integer of 0 or more, got {str(version)[:40]!r}")
    agent = body.get("agent")
    if agent is not None and (not isinstance(agent, str) or not agent or len(agent) > 128):
        raise ValueError("agent must be an agent's name (1 to 128 characters), or null for every agent")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError("system must be a string (the system instruction), or null to keep the agent's")
    mode = body.get("mode", "replace")
    if mode not in _MODES:
        raise ValueError(f"mode must be 'replace' or 'prepend', got {str(mode)[:40]!r}")
    raw = body.get("demonstrations", [])
    if not isinstance(raw, list):
        raise ValueError("demonstrations must be a list of {role, content} turns")
    if len(raw) > MAX_DEMONSTRATION_TURNS:
        raise ValueError(f"{len(raw)} demonstration turns, more than {MAX_DEMONSTRATION_TURNS}")
    turns: list[tuple[str, str]] = []
    for i, turn in enumerate(raw):
        wanted = "user" if i % 2 == 0 else "assistant"
        if (
            not isinstance(turn, dict)
            or turn.get("role") != wanted
            or not isinstance(turn.get("content"), str)
        ):
            raise ValueError(
                f"demonstrations[{i}] must be {{'role': '{wanted}', 'content': str}}: turns alternate user,"
                " assistant, starting with user"
            )
        turns.append((wanted, turn["content"]))
    if len(turns) % 2:
        raise ValueError("demonstrations must end with an assistant turn (each user turn answered)")
    size = len((system or "").encode()) + sum(len(c.encode()) for _, c in turns)
    if size > MAX_PROMPT_BYTES:
        raise ValueError(f"the prompt holds {size:,} bytes of text, more than {MAX_PROMPT_BYTES:,}")
    if system is None and not turns:
        raise ValueError("a prompt policy needs a system instruction, demonstrations, or both")
    return PromptPolicy(version, agent, system, mode, tuple(turns))


class PromptPolicies:
    """The prompt policies a gateway applies: one per agent, and one for every other agent."""

    def __init__(self) -> None:
        self._by_agent: dict[str | None, PromptPolicy] = {}
        #: Publishes and withdrawals taken so far (``/metrics``).
        self.changes = 0

    def publish(self, policy: PromptPolicy) -> PromptPolicy | None:
        """Serve ``policy`` from the next call on; the one it replaces, if any."""
        previous = self._by_agent.get(policy.agent)
        self._by_agent[policy.agent] = policy
        self.changes += 1
        return previous

    def withdraw(self, agent: str | None) -> PromptPolicy | None:
        """Stop applying ``agent``'s prompt (``None``: the one for every agent); the one withdrawn."""
        removed = self._by_agent.pop(agent, None)
        if removed is not None:
            self.changes += 1
        return removed

    def for_agent(self, agent: str | None) -> PromptPolicy | None:
        """The prompt a call of ``agent`` gets: its own, else the one for every agent, else none."""
        if agent is not None and agent in self._by_agent:
            return self._by_agent[agent]
        return self._by_agent.get(None)

    def to_json(self) -> list[dict[str, Any]]:
        return [p.to_json() for _, p in sorted(self._by_agent.items(), key=lambda kv: kv[0] or "")]

    def metric_rows(self) -> list[tuple[str, str, str, float]]:
        """``/metrics`` rows: prompt policies applied now, and publishes and withdrawals so far."""
        return [
            ("agl_gateway_prompts", "gauge", "Prompt policies the gateway applies now.", len(self._by_agent)),
            (
                "agl_gateway_prompt_changes_total",
                "counter",
                "Prompt policies published or withdrawn.",
                self.changes,
            ),
        ]
