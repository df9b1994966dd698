"""The runner's value types: what an agent is given, what a runner counts, and the runner's constants."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

#: Name of the store resource holding the gateway endpoint: ``{"base_url": str, "model": str}``.
LLM_RESOURCE = "llm"

#: The runner's worker modes; ``auto`` resolves to ``async`` or ``thread`` (see :func:`resolve_mode`).
MODES = ("auto", "thread", "process", "async")


class RolloutTimeout(TimeoutError):
    """A rollout ran longer than the runner's ``rollout_timeout_s``.

    Its attempt ends as ``timed_out`` (retried while the rollout has attempts left), and the runner writes
    an ``agl.error`` span with ``error.type == "RolloutTimeout"`` for it.
    """


@dataclasses.dataclass(frozen=True)
class LLM:
    """Where the agent sends its LLM calls during a rollout.

    ``split`` is the rollout's ``metadata["split"]`` when it has one: the trainer marks training rollouts
    ``"train"`` and validation rollouts ``"val"``, so an agent can sample during training and decode
    greedily when it is being scored (``temperature=0 if llm.split == "val" else 0.7``).

    An agent made of several agents without a framework names each one's calls with :meth:`for_agent`.
    """

    base_url: str
    model: str
    api_key: str = "agl"
    policy_version: int | None = None
    split: str | None = None

    @property
    def evaluating(self) -> bool:
        """True for validation rollouts (``split == "val"``)."""
        return self.split == "val"

    def for_agent(self, name: str) -> LLM:
        """A copy whose ``base_url`` also names the calling agent:
        ``{gateway}/rollouts/{rid}/attempts/{aid}/agents/{name}/v1``. The gateway records every call made
        through it with ``gen_ai.agent.name = name``, which is what agent selection (``algorithm.agents``)
        and ``agl inspect`` read. Called on a copy that names an agent already, it names ``name`` instead.

        ``name``: non-empty, at most 128 characters, no ``/``, ``\\``, control characters or surrounding
        whitespace; other characters are percent-encoded. :class:`ValueError` otherwise, or when
        ``base_url`` is not a gateway base URL (ending in ``/v1``).
        """
        from ..urls import agent_base_url  # not at import: worker processes start without it

        return dataclasses.replace(self, base_url=agent_base_url(self.base_url, name))

    @property
    def anthropic_base_url(self) -> str:
        """``base_url`` without its trailing ``/v1``: the ``base_url`` of the Anthropic SDK, which appends
        ``/v1/messages`` itself (``anthropic.Anthropic(base_url=llm.anthropic_base_url, ...)``)."""
        from ..urls import without_api_version

        return without_api_version(self.base_url)


@dataclasses.dataclass(frozen=True)
class RunnerCounts:
    """What a runner has done since it started. ``dropped``: results not recorded because the rollout was
    cancelled or taken back by the store while the agent ran; ``running``: attempts in progress now."""

    succeeded: int = 0
    failed: int = 0
    timed_out: int = 0
    dropped: int = 0
    running: int = 0

    def summary(self) -> str:
        return (
            f"{self.succeeded} done, {self.failed} failed, {self.timed_out} timed out"
            + (f", {self.dropped} dropped" if self.dropped else "")
            + f", {self.running} running"
        )


#: An agent: ``agent(task_input, llm)`` returning a reward, ``None``, or (``async def``) a coroutine of one.
AgentFn = Callable[[Any, LLM], Any]
