"""Spans to MDP transitions: one transition per LLM call, with the exact tokens the gateway recorded.

Pure functions over :class:`~agl_core.records.Span` records: no I/O, no framework.

Two kinds of LLM span meet here. *Gateway spans* carry the token ids and logprobs. *Framework spans*
(LangChain, the Agents SDK, AutoGen, OpenInference) carry the structure: which agent made the call, under
which step. A framework span is joined to the gateway span of the same call by the completion id
(``gen_ai.response.id``) or, when trace context was propagated, by being its parent. A framework LLM call
with no gateway span is reported, never trained on with guessed tokens.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from . import semconv
from .records import Span, Transition

__all__ = ["Problem", "TransitionResult", "spans_to_transitions", "episode_rewards"]


@dataclasses.dataclass(frozen=True)
class Problem:
    """Why a rollout, or one of its LLM calls, produced no transition."""

    rollout_id: str
    reason: str
    span_id: str | None = None


@dataclasses.dataclass(frozen=True)
class TransitionResult:
    transitions: tuple[Transition, ...]
    problems: tuple[Problem, ...]

    def reasons(self) -> dict[str, int]:
        """How many problems of each reason."""
        counts: dict[str, int] = defaultdict(int)
        for p in self.problems:
            counts[p.reason] += 1
        return dict(counts)


# Problem reasons, stable strings a user can grep for.
NO_REWARD = "rollout has no episode reward"
NO_LLM_CALL = "rollout made no LLM call through the gateway"
NOT_JOINED = "LLM call has no gateway span with token ids (called the model without the gateway?)"
NOT_TRAINABLE = "LLM call was served by a backend that is not trained"
CALL_FAILED = "LLM call failed"


def _is_gateway_llm(span: Span) -> bool:
    return semconv.RESPONSE_TOKEN_IDS in span.attributes and semconv.PROMPT_TOKEN_IDS in span.attributes


def _is_framework_llm(span: Span) -> bool:
    if span.attributes.get(semconv.SOURCE) == semconv.SOURCE_GATEWAY:
        return False
    op = span.attributes.get(semconv.GEN_AI_OPERATION_NAME)
    kind = span.attributes.get(semconv.OPENINFERENCE_SPAN_KIND)
    return op in (semconv.OP_CHAT, semconv.OP_TEXT_COMPLETION) or kind == semconv.OPENINFERENCE_KIND_LLM


def episode_rewards(spans: Iterable[Span]) -> dict[str, float]:
    """The episode reward of each rollout: its last ``agl.reward`` span named ``episode``."""
    latest: dict[str, tuple[int, int, float]] = {}
    for span in spans:
        if span.name != semconv.SPAN_REWARD or span.rollout_id is None:
            continue
        if span.attributes.get(semconv.REWARD_NAME, "episode") != "episode":
            continue
        value = span.attributes.get(semconv.REWARD_VALUE)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        key = (span.end_ns, span.seq or 0, float(value))
        if span.rollout_id not in latest or key[:2] >= latest[span.rollout_id][:2]:
            latest[span.rollout_id] = key
    return {rid: v[2] for rid, v in latest.items()}


def _agent_name(span: Span, by_id: Mapping[str, Span]) -> str | None:
    """The nearest ``gen_ai.agent.name`` on the span or its ancestors."""
    seen = 0
    current: Span | None = span
    while current is not None and seen < 256:
        name = current.attributes.get(semconv.GEN_AI_AGENT_NAME)
        if isinstance(name, str) and name:
            return name
        current = by_id.get(current.parent_span_id) if current.parent_span_id else None
        seen += 1
    return None


def spans_to_transitions(spans: Iterable[Span]) -> TransitionResult:
    """Turn the spans of any number of rollouts into transitions (episode reward on every call).

    Transitions of a rollout are ordered by the start time of their LLM call; ``call_index`` counts from
    0 within the rollout. Credit assignment other than "episode reward to every call" is applied
    afterwards (:mod:`agl_core.credit`).
    """
    by_rollout: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        if span.rollout_id is not None:
            by_rollout[span.rollout_id].append(span)
    rewards = episode_rewards(s for group in by_rollout.values() for s in group)
    transitions: list[Transition] = []
    problems: list[Problem] = []
    for rollout_id, group in by_rollout.items():
        group.sort(key=lambda s: (s.start_ns, s.seq or 0))
        made, found = _rollout_transitions(rollout_id, group, rewards.get(rollout_id))
        transitions.extend(made)
        problems.extend(found)
    return TransitionResult(tuple(transitions), tuple(problems))


def _rollout_transitions(
    rollout_id: str, spans: Sequence[Span], reward: float | None
) -> tuple[list[Transition], list[Problem]]:
    by_id = {s.span_id: s for s in spans}
    gateway = [s for s in spans if _is_gateway_llm(s)]
    framework = [s for s in spans if _is_framework_llm(s) and not _is_gateway_llm(s)]
    problems: list[Problem] = []
    task_id = next((str(s.attributes[semconv.TASK_ID]) for s in spans if semconv.TASK_ID in s.attributes), None)
    attempt_id = next((s.attempt_id for s in spans if s.attempt_id), None)

    # Join framework spans to gateway spans: by completion id, else by parentage.
    by_response_id = {s.attributes.get(semconv.GEN_AI_RESPONSE_ID): s for s in framework}
    joined: dict[str, Span] = {}
    for g in gateway:
        partner = by_response_id.get(g.attributes.get(semconv.GEN_AI_RESPONSE_ID))
        if partner is None and g.parent_span_id in by_id and by_id[g.parent_span_id] in framework:
            partner = by_id[g.parent_span_id]
        if partner is not None:
            joined[g.span_id] = partner
    joined_ids = {p.span_id for p in joined.values()}
    for f in framework:
        if f.span_id not in joined_ids and not f.is_error:
            problems.append(Problem(rollout_id, NOT_JOINED, f.span_id))

    if not gateway:
        problems.append(Problem(rollout_id, NO_LLM_CALL))
        return [], problems
    if reward is None:
        problems.append(Problem(rollout_id, NO_REWARD))
        return [], problems

    transitions: list[Transition] = []
    for g in gateway:
        if g.is_error:
            problems.append(Problem(rollout_id, CALL_FAILED, g.span_id))
            continue
        if g.attributes.get(semconv.TRAINABLE) is False:
            problems.append(Problem(rollout_id, NOT_TRAINABLE, g.span_id))
            continue
        partner = joined.get(g.span_id)
        logprobs = g.attributes.get(semconv.RESPONSE_LOGPROBS)
        version = g.attributes.get(semconv.POLICY_VERSION)
        transitions.append(
            Transition(
                rollout_id=rollout_id,
                attempt_id=g.attempt_id or attempt_id,
                task_id=task_id,
                call_index=len(transitions),
                prompt_ids=tuple(int(t) for t in g.attributes[semconv.PROMPT_TOKEN_IDS]),
                response_ids=tuple(int(t) for t in g.attributes[semconv.RESPONSE_TOKEN_IDS]),
                response_logprobs=tuple(float(x) for x in logprobs) if logprobs is not None else None,
                reward=reward,
                agent_name=_agent_name(partner, by_id) if partner is not None else _agent_name(g, by_id),
                policy_version=int(version) if isinstance(version, int) else None,
                span_id=g.span_id,
            )
        )
    return transitions, problems
