"""Credit assignment: how a rollout's episode reward is shared among its LLM calls.

Pure functions over transitions. Every strategy keeps the order of the transitions it is given.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections import defaultdict
from collections.abc import Sequence

from .records import Transition

__all__ = ["STRATEGIES", "assign_credit", "select_agents"]

#: ``episode``: every call gets the episode reward (LightningRL's default).
#: ``last``: the last call of the rollout gets it, earlier calls 0.
#: ``discounted``: call t of T gets ``gamma ** (T - 1 - t) * R``.
STRATEGIES = ("episode", "last", "discounted")


def assign_credit(
    transitions: Sequence[Transition], strategy: str = "episode", *, gamma: float = 1.0
) -> list[Transition]:
    """Rewrite each transition's ``reward`` from its episode reward according to ``strategy``.

    Expects transitions as made by :func:`~agl_core.transitions.spans_to_transitions` (``reward`` holds
    the episode reward, ``call_index`` counts calls within the rollout).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown credit strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if strategy == "episode":
        return list(transitions)
    last_index: dict[str, int] = defaultdict(int)
    for t in transitions:
        last_index[t.rollout_id] = max(last_index[t.rollout_id], t.call_index)
    out = []
    for t in transitions:
        steps_to_end = last_index[t.rollout_id] - t.call_index
        if strategy == "last":
            reward = t.reward if steps_to_end == 0 else 0.0
        else:
            reward = t.reward * gamma**steps_to_end
        out.append(dataclasses.replace(t, reward=reward))
    return out


def select_agents(transitions: Sequence[Transition], patterns: Sequence[str] | None) -> list[Transition]:
    """Keep transitions whose agent name matches any glob in ``patterns`` (all when ``patterns`` is empty)."""
    if not patterns:
        return list(transitions)
    return [t for t in transitions if t.agent_name and any(fnmatch.fnmatchcase(t.agent_name, p) for p in patterns)]
