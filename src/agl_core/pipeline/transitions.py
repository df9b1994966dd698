"""Spans to MDP transitions: one transition per LLM call, with the exact tokens the gateway recorded.

Pure functions over :class:`~agl_core.records.Span` records: no I/O, no framework.

Two kinds of LLM span meet here. *Gateway spans* carry the token ids and logprobs; each successful one
is exactly one transition. *Framework spans* (LangChain, the Agents SDK, AutoGen, OpenInference) carry the
structure: which agent made the call, under which step. A framework span is joined to the gateway span of
the same call, in this order of preference:

1. by the completion id (``gen_ai.response.id``) both record;
2. by parentage, when trace context was propagated on the HTTP request (the gateway span is its child);
3. by order, for framework spans that carry no completion id: within a rollout, the k-th such call of a
   source is the k-th gateway call that source did not join otherwise, provided both sides have the same
   number of calls and every pair agrees on its token counts where the framework reports them.

Joins are made per source (``agl.source``; OpenInference spans form their own source), so when an agl
adapter and an OpenInference instrumentor both describe a call, both join the same gateway span and it
still yields one transition (the agl adapter's span names the agent). A framework LLM call that cannot
be joined is reported with the reason, never trained on with guessed tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from .. import semconv
from ..records import Span, Transition
from .spantree import LLM, SpanTree, is_gateway_llm, is_timeout_error, kind_of, source_of, usage

__all__ = ["Problem", "TransitionResult", "episode_rewards", "explain_untrained", "spans_to_transitions"]


@dataclasses.dataclass(frozen=True)
class Problem:
    """Why a rollout, or one of its LLM calls, produced no transition."""

    rollout_id: str
    reason: str
    span_id: str | None = None
    #: Specifics for a person (counts, token numbers); ``reason`` is the stable part to group by.
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class TransitionResult:
    transitions: tuple[Transition, ...]
    problems: tuple[Problem, ...]
    #: ``{framework LLM span id: gateway span id}`` of every join made (from every source).
    joins: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: Rollouts that timed out without an episode reward and were given ``timeout_reward`` instead.
    timeout_rewarded: tuple[str, ...] = ()

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
COUNT_MISMATCH = (
    "LLM call carries no completion id or trace context, and the rollout's framework and gateway calls differ"
    " in number, so it cannot be matched by order"
)
USAGE_MISMATCH = "LLM call matched a gateway call by order, but their token counts disagree"


#: Reasons :func:`explain_untrained` adds for rollouts whose calls were made but not trained on.
FILTERED_AGENT = "every LLM call of the rollout was by an agent not selected for training (algorithm.agents)"
NO_TOKENS = "the rollout's LLM calls recorded no prompt or no response tokens"


def explain_untrained(
    rollout_ids: Iterable[str], result: TransitionResult, trained: Iterable[Transition]
) -> dict[str, str]:
    """Why each of ``rollout_ids`` that has no transition in ``trained`` contributed nothing.

    ``result`` is what :func:`spans_to_transitions` made of the rollouts' spans and ``trained`` what was
    left after agent selection and filtering. The reason is the rollout's own problem (no reward, no LLM
    call) when it has one, then "agents filtered out" when it had transitions that were dropped, then
    the first problem of its calls (not joined to the gateway, failed call, ...).
    """
    kept = {t.rollout_id for t in trained}
    made: dict[str, list[Transition]] = defaultdict(list)
    for t in result.transitions:
        made[t.rollout_id].append(t)
    rollout_level: dict[str, str] = {}
    call_level: dict[str, str] = {}
    for p in result.problems:
        target = rollout_level if p.span_id is None else call_level
        target.setdefault(p.rollout_id, p.reason)
    out: dict[str, str] = {}
    for rid in rollout_ids:
        if rid in kept:
            continue
        if rid in rollout_level:
            out[rid] = rollout_level[rid]
        elif made[rid] and all(t.prompt_ids and t.response_ids for t in made[rid]):
            out[rid] = FILTERED_AGENT
        elif made[rid]:
            out[rid] = NO_TOKENS
        else:
            out[rid] = call_level.get(rid, NO_LLM_CALL)
    return out


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


def spans_to_transitions(spans: Iterable[Span], *, timeout_reward: float | None = None) -> TransitionResult:
    """Turn the spans of any number of rollouts into transitions (episode reward on every call).

    Transitions of a rollout are ordered by the start time of their LLM call; ``call_index`` counts from
    0 within the rollout. Credit assignment other than "episode reward to every call" is applied
    afterwards (:mod:`agl_core.pipeline.credit`).

    A rollout without an episode reward yields no transitions (:data:`NO_REWARD`), except that one which
    timed out (it holds a timeout ``agl.error`` span, :func:`~agl_core.pipeline.spantree.is_timeout_error`)
    gets ``timeout_reward`` as its episode reward when that is given; such rollouts are listed in
    ``timeout_rewarded``.
    """
    if timeout_reward is not None and not math.isfinite(timeout_reward):
        raise ValueError(f"timeout_reward must be a finite number, got {timeout_reward!r}")
    by_rollout: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        if span.rollout_id is not None:
            by_rollout[span.rollout_id].append(span)
    rewards = episode_rewards(s for group in by_rollout.values() for s in group)
    transitions: list[Transition] = []
    problems: list[Problem] = []
    joins: dict[str, str] = {}
    timeout_rewarded: list[str] = []
    for rollout_id, group in by_rollout.items():
        group.sort(key=lambda s: (s.start_ns, s.seq or 0))
        reward = rewards.get(rollout_id)
        if reward is None and timeout_reward is not None and any(map(is_timeout_error, group)):
            reward = float(timeout_reward)
            timeout_rewarded.append(rollout_id)
        made, found = _rollout_transitions(rollout_id, group, reward, joins)
        transitions.extend(made)
        problems.extend(found)
        if not made and timeout_rewarded and timeout_rewarded[-1] == rollout_id:
            timeout_rewarded.pop()
    return TransitionResult(tuple(transitions), tuple(problems), joins, tuple(timeout_rewarded))


def _join_source(
    rollout_id: str, calls: Sequence[Span], gateway: Sequence[Span]
) -> tuple[dict[str, Span], list[Problem]]:
    """Join one source's framework LLM spans to gateway spans: ``{gateway span id: framework span}``."""
    joined: dict[str, Span] = {}
    by_response_id = {
        s.attributes[semconv.GEN_AI_RESPONSE_ID]: s
        for s in calls
        if semconv.GEN_AI_RESPONSE_ID in s.attributes
    }
    by_span_id = {s.span_id: s for s in calls}
    for g in gateway:
        partner = by_response_id.get(g.attributes.get(semconv.GEN_AI_RESPONSE_ID))
        if partner is None and g.parent_span_id is not None:
            partner = by_span_id.get(g.parent_span_id)
        if partner is not None:
            joined[g.span_id] = partner
    done = {p.span_id for p in joined.values()}
    problems: list[Problem] = []
    pending: list[Span] = []
    for call in calls:
        if call.span_id in done or call.is_error:
            continue
        if semconv.GEN_AI_RESPONSE_ID in call.attributes:
            # It told us which completion it got, and the gateway served no such completion.
            problems.append(Problem(rollout_id, NOT_JOINED, call.span_id))
        else:
            pending.append(call)
    if not pending:
        return joined, problems
    free = [g for g in gateway if g.span_id not in joined]
    if len(free) != len(pending):
        detail = f"{len(pending)} unmatched framework calls, {len(free)} unmatched gateway calls"
        problems.extend(Problem(rollout_id, COUNT_MISMATCH, c.span_id, detail) for c in pending)
        return joined, problems
    for call, g in zip(pending, free, strict=True):
        mismatch = [
            f"{what} {mine} vs {theirs} at the gateway"
            for what, mine, theirs in zip(
                ("input tokens", "output tokens"), usage(call), usage(g), strict=True
            )
            if mine is not None and theirs is not None and mine != theirs
        ]
        if mismatch:
            problems.append(Problem(rollout_id, USAGE_MISMATCH, call.span_id, "; ".join(mismatch)))
        else:
            joined[g.span_id] = call
    return joined, problems


def _rollout_transitions(
    rollout_id: str, spans: Sequence[Span], reward: float | None, joins: dict[str, str]
) -> tuple[list[Transition], list[Problem]]:
    tree = SpanTree(spans)
    gateway = [s for s in tree.spans if is_gateway_llm(s)]
    by_source: dict[str, list[Span]] = defaultdict(list)
    for span in tree.spans:
        if kind_of(span) == LLM:
            by_source[source_of(span)].append(span)
    problems: list[Problem] = []
    task_id = next(
        (str(s.attributes[semconv.TASK_ID]) for s in spans if semconv.TASK_ID in s.attributes), None
    )
    attempt_id = next((s.attempt_id for s in spans if s.attempt_id), None)

    # An agl adapter's span is the preferred partner of a gateway call; OpenInference's comes next.
    partners: dict[str, Span] = {}
    for source in sorted(by_source, key=lambda name: (name == semconv.SOURCE_OPENINFERENCE, name)):
        joined, found = _join_source(rollout_id, by_source[source], gateway)
        problems.extend(found)
        for gateway_id, framework_span in joined.items():
            partners.setdefault(gateway_id, framework_span)
            joins[framework_span.span_id] = gateway_id

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
        partner = partners.get(g.span_id)
        logprobs = g.attributes.get(semconv.RESPONSE_LOGPROBS)
        version = g.attributes.get(semconv.POLICY_VERSION)
        policy_name = g.attributes.get(semconv.POLICY_NAME)
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
                agent_name=tree.agent_name(partner if partner is not None else g),
                policy_version=int(version) if isinstance(version, int) else None,
                span_id=g.span_id,
                policy_name=policy_name if isinstance(policy_name, str) else None,
            )
        )
    return transitions, problems
