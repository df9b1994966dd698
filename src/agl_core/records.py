"""Immutable records that flow between the parts of agl.

These are plain frozen dataclasses: no I/O, no framework. Input from HTTP or YAML is validated at the
boundary (pydantic) and then turned into one of these.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from . import semconv

__all__ = [
    "Attempt",
    "Resource",
    "Rollout",
    "RolloutStatus",
    "Span",
    "Task",
    "Transition",
]


class RolloutStatus(str, enum.Enum):
    """Life cycle of a rollout (and of each of its attempts)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self not in (RolloutStatus.QUEUED, RolloutStatus.RUNNING)


@dataclasses.dataclass(frozen=True)
class Span:
    """One finished span as the store keeps it.

    ``trace_id`` and ``span_id`` are lower-case hex (32 and 16 characters); times are Unix nanoseconds.
    ``seq`` is the store-assigned, strictly increasing sequence number (``None`` before storing).
    """

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    status_code: str = "UNSET"
    status_message: str = ""
    events: tuple[Mapping[str, Any], ...] = ()
    resource: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    seq: int | None = None

    @property
    def rollout_id(self) -> str | None:
        value = self.attributes.get(semconv.ROLLOUT_ID)
        return str(value) if value is not None else None

    @property
    def attempt_id(self) -> str | None:
        value = self.attributes.get(semconv.ATTEMPT_ID)
        return str(value) if value is not None else None

    @property
    def is_error(self) -> bool:
        return self.status_code == "ERROR"


@dataclasses.dataclass(frozen=True)
class Task:
    """One item of a task dataset: what the agent is asked to do."""

    task_id: str
    input: Any
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One try at running a rollout. A rollout is retried by starting a new attempt."""

    attempt_id: str
    rollout_id: str
    number: int
    status: RolloutStatus
    worker_id: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One run of the agent on one task, as queued in the store.

    ``group_id`` ties together the rollouts of the same task within a training step: advantages are
    computed within a group.
    """

    rollout_id: str
    task_id: str
    input: Any
    status: RolloutStatus
    group_id: str | None = None
    created_at: float = 0.0
    reward: float | None = None
    attempts: tuple[Attempt, ...] = ()
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Transition:
    """One LLM call turned into an MDP transition.

    ``prompt_ids`` are what the model saw and ``response_ids`` what it produced, exactly as the serving
    side tokenised them. ``response_logprobs`` has one entry per response token (behaviour policy), or
    is ``None`` when the backend did not report them. ``reward`` is this call's share of the episode
    reward after credit assignment.
    """

    rollout_id: str
    attempt_id: str | None
    task_id: str | None
    call_index: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...] | None
    reward: float
    agent_name: str | None = None
    policy_version: int | None = None
    span_id: str | None = None
    #: The policy (LoRA adapter) that served the call when each agent has its own (``base``: the base
    #: model); ``None`` when one policy serves every agent.
    policy_name: str | None = None

    def __post_init__(self) -> None:
        if self.response_logprobs is not None and len(self.response_logprobs) != len(self.response_ids):
            raise ValueError(
                f"transition {self.rollout_id}#{self.call_index}: {len(self.response_logprobs)} logprobs "
                f"for {len(self.response_ids)} response tokens"
            )


@dataclasses.dataclass(frozen=True)
class Resource:
    """A versioned, named value the runners read (model endpoint, policy version, prompt template)."""

    name: str
    version: int
    value: Any
