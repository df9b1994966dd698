"""One rollout for the dashboard: its span tree as a timeline, and its LLM calls as the trainer sees them
(transitions, the reward after credit, the group advantage, and why a call did not train)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .. import semconv
from ..pipeline.credit import assign_rewards
from ..pipeline.report import span_outcomes
from ..pipeline.spantree import GATEWAY, SpanTree, kind_of, tool_name
from ..pipeline.transitions import explain_untrained, spans_to_transitions
from ..plugins import RolloutExplainer, load_rollout_explainer
from ..records import Rollout, RolloutStatus, Span, Transition
from ..store.base import RolloutFilter, Store

__all__ = ["CoreExplainer", "installed_explainer", "rollout_detail", "rollout_row"]

logger = logging.getLogger(__name__)

#: Most spans of one rollout shown; most characters of one attribute value; most tokens decoded per call.
MAX_SPANS = 5_000
MAX_VALUE_CHARS = 4_000
MAX_PROMPT_TOKENS = 4_000
MAX_GROUP = 64
#: Attributes holding token ids or logprobs: shown as a count, the transition view has them.
_BULKY = (semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS, semconv.RESPONSE_LOGPROBS)


class CoreExplainer:
    """What agl_core knows without a trainer: the default credit rules, no advantages, no tokenizer."""

    def explain(
        self, rollouts: Sequence[Rollout], spans: Sequence[Span], config: Mapping[str, Any] | None
    ) -> tuple[Sequence[Transition], dict[tuple[str, int], float], dict[str, str]]:
        result = spans_to_transitions(spans)
        credit = assign_rewards(result, spans)
        trained = [t for t in credit.transitions if t.prompt_ids and t.response_ids]
        return credit.transitions, {}, explain_untrained([r.rollout_id for r in rollouts], result, trained)

    def tokenizer(self, config: Mapping[str, Any] | None) -> Any:
        return None


@functools.cache
def installed_explainer() -> RolloutExplainer:
    """The trainer's explainer when one is installed (entry-point group ``agl.rollout_explainers``;
    ``agl[trainer]`` provides it), else :class:`CoreExplainer`."""
    return load_rollout_explainer() or CoreExplainer()


def _value(value: Any) -> Any:
    if isinstance(value, str):
        return (
            value if len(value) <= MAX_VALUE_CHARS else value[:MAX_VALUE_CHARS] + f"... ({len(value)} chars)"
        )
    if isinstance(value, (list, tuple)):
        if len(value) > 64:
            return f"[{len(value)} values]"
        return [_value(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _value(v) for k, v in list(value.items())[:64]}
    return value


def _attributes(span: Span) -> dict[str, Any]:
    out = {}
    for key, value in span.attributes.items():
        if key in _BULKY and isinstance(value, (list, tuple)):
            out[key] = f"[{len(value)} values]"
        else:
            out[key] = _value(value)
    return out


def rollout_row(rollout: Rollout, seq: int | None = None, spans: int | None = None) -> dict[str, Any]:
    """A rollout as the table lists it."""
    last = rollout.attempts[-1] if rollout.attempts else None
    meta = rollout.metadata or {}
    duration = (
        last.ended_at - last.started_at
        if last is not None and last.ended_at is not None and last.started_at is not None
        else None
    )
    text = repr(rollout.input) if not isinstance(rollout.input, str) else rollout.input
    return {
        "rollout_id": rollout.rollout_id,
        "seq": seq,
        "task_id": rollout.task_id,
        "group_id": rollout.group_id,
        "status": rollout.status.value,
        "reward": rollout.reward if rollout.reward is None or math.isfinite(rollout.reward) else None,
        "step": meta.get("step"),
        "split": meta.get("split"),
        "run": meta.get("run") if isinstance(meta.get("run"), str) else None,
        "created_at": rollout.created_at,
        "attempts": len(rollout.attempts),
        "duration_s": duration,
        "error": (last.error or "").strip().partition("\n")[0][:300]
        if last is not None and last.error
        else None,
        "input": text[:200],
        "spans": spans,
    }


def _decode(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token as the text it adds (tokenizers with byte-level pieces decode one by one)."""
    try:
        return [tokenizer.decode([i]) for i in ids]
    except Exception:
        return [str(i) for i in ids]


def _transition(
    t: Transition,
    advantage: float | None,
    untrained: str | None,
    tokenizer: Any,
) -> dict[str, Any]:
    prompt_ids = list(t.prompt_ids)[-MAX_PROMPT_TOKENS:]
    response_ids = list(t.response_ids)
    logprobs = list(t.response_logprobs) if t.response_logprobs is not None else None
    trained = advantage is not None
    if trained:
        reason = None
    elif not t.prompt_ids or not t.response_ids:
        reason = "the call recorded no prompt or no response tokens"
    else:
        reason = untrained or "not in the update (agent not selected, or the group had no reward variance)"
    out: dict[str, Any] = {
        "call_index": t.call_index,
        "span_id": t.span_id,
        "agent": t.agent_name,
        "policy": t.policy_name,
        "policy_version": t.policy_version,
        "reward": t.reward if math.isfinite(t.reward) else None,
        "advantage": advantage,
        "trained": trained,
        "reason": reason,
        "prompt_tokens": len(t.prompt_ids),
        "response_tokens": len(t.response_ids),
        "prompt_ids_shown": len(prompt_ids),
        "decoded": tokenizer is not None,
    }
    if tokenizer is not None:
        try:
            out["prompt"] = tokenizer.decode(prompt_ids)
        except Exception:
            out["prompt"] = " ".join(map(str, prompt_ids))
        pieces = _decode(tokenizer, response_ids)
    else:
        out["prompt"] = " ".join(map(str, prompt_ids))
        pieces = [f"{i} " for i in response_ids]
    out["response"] = [
        {
            "id": tid,
            "text": pieces[i],
            "logprob": logprobs[i]
            if logprobs is not None and i < len(logprobs) and math.isfinite(logprobs[i])
            else None,
        }
        for i, tid in enumerate(response_ids)
    ]
    return out


def _nest_gateway_spans(spans: Sequence[Span], joins: Mapping[str, str]) -> list[Span]:
    """``spans`` with each gateway span that is not already under the framework LLM span it was joined to
    (``joins``: framework span id -> gateway span id) placed under it: the gateway's record of a call is
    a trace of its own, or sits beside the call, unless the client propagated its context."""
    gateway_to_call = {g: f for f, g in joins.items()}
    present = {s.span_id for s in spans}
    out = []
    for span in spans:
        call = gateway_to_call.get(span.span_id)
        if call is not None and call in present and span.parent_span_id != call:
            span = dataclasses.replace(span, parent_span_id=call)
        out.append(span)
    return out


def _timeline(
    spans: Sequence[Span],
    joined: Mapping[str, int],
    problems: Mapping[str, str],
    joins: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    spans = _nest_gateway_spans(spans, joins or {})
    tree = SpanTree(spans)
    origin = min(s.start_ns for s in spans)
    rows = []
    for depth, span in tree.walk():
        kind = kind_of(span)
        reward = None
        if span.name == semconv.SPAN_REWARD:
            value = span.attributes.get(semconv.REWARD_VALUE)
            reward = {
                "name": span.attributes.get(semconv.REWARD_NAME, "episode"),
                "value": value if isinstance(value, (int, float)) and math.isfinite(value) else None,
            }
        rows.append(
            {
                "span_id": span.span_id,
                "parent_span_id": span.parent_span_id,
                "attempt_id": span.attempt_id,
                "depth": depth,
                "name": span.name,
                "kind": "reward" if reward is not None else kind,
                "agent": tree.agent_name(span),
                "tool": tool_name(span),
                "start_ms": (span.start_ns - origin) / 1e6,
                "duration_ms": max(0, span.end_ns - span.start_ns) / 1e6,
                "error": span.is_error,
                "status_message": span.status_message[:MAX_VALUE_CHARS],
                "reward": reward,
                "tokens": (
                    [
                        len(span.attributes[semconv.PROMPT_TOKEN_IDS]),
                        len(span.attributes.get(semconv.RESPONSE_TOKEN_IDS) or ()),
                    ]
                    if kind == GATEWAY and semconv.PROMPT_TOKEN_IDS in span.attributes
                    else None
                ),
                "transition": joined.get(span.span_id),
                "problem": problems.get(span.span_id),
                "attributes": _attributes(span),
            }
        )
    return rows


def rollout_detail(
    store: Store,
    rollout_id: str,
    *,
    config: Mapping[str, Any] | None = None,
    tokenizer: Any = None,
    explainer: RolloutExplainer | None = None,
) -> dict[str, Any]:
    """Everything the rollout page shows (raises the store's NotFoundError for an unknown id)."""
    (rollout,) = store.get_rollouts([rollout_id])
    group = [rollout]
    if rollout.group_id:
        page = store.list_rollouts(RolloutFilter(group_id=rollout.group_id), limit=MAX_GROUP)
        group = [rollout] + [r for r in page.rollouts if r.rollout_id != rollout_id]
    spans = store.query_spans(rollout_ids=[r.rollout_id for r in group], limit=MAX_SPANS * len(group))
    own = [s for s in spans if s.rollout_id == rollout_id][:MAX_SPANS]
    last_attempt = rollout.attempts[-1].attempt_id if rollout.attempts else None
    # the trainer trains on the last attempt's spans (and spans with no attempt: imported, late rewards)
    current = [s for s in spans if s.attempt_id in (None, last_attempt) or s.rollout_id != rollout_id]
    explain = explainer or installed_explainer()
    try:
        transitions, advantages, untrained = explain.explain(group, current, config)
    except Exception as exc:  # a damaged trace must not take the page down
        logger.warning("agl dashboard: could not explain rollout %s: %s", rollout_id, exc)
        transitions, advantages, untrained = [], {}, {rollout_id: f"could not build transitions: {exc}"}
    result = spans_to_transitions(own)
    joined, problems = span_outcomes(result)
    mine = [t for t in transitions if t.rollout_id == rollout_id]
    reason = untrained.get(rollout_id)
    if reason is None and rollout.status != RolloutStatus.SUCCEEDED and not mine:
        reason = (
            f"the rollout {rollout.status.value.replace('_', ' ')}: a step trains on succeeded rollouts (and"
            " on timed-out ones when algorithm.rewards.timeout_episode_reward gives them a reward)"
        )
    return {
        "rollout": {
            **rollout_row(rollout, spans=len(own)),
            "input": rollout.input
            if len(repr(rollout.input)) <= MAX_VALUE_CHARS
            else _value(repr(rollout.input)),
            "metadata": _value(dict(rollout.metadata or {})),
            "attempts": [
                {
                    "attempt_id": a.attempt_id,
                    "number": a.number,
                    "status": a.status.value,
                    "worker_id": a.worker_id,
                    "started_at": a.started_at,
                    "ended_at": a.ended_at,
                    "error": _value(a.error) if a.error else None,
                }
                for a in rollout.attempts
            ],
        },
        "group": [rollout_row(r) for r in group[1:]],
        "spans": _timeline(own, joined, problems, result.joins) if own else [],
        "transitions": [
            _transition(t, advantages.get((t.rollout_id, t.call_index)), reason, tokenizer) for t in mine
        ],
        "untrained": reason,
        "problems": [{"reason": p.reason, "detail": p.detail, "span_id": p.span_id} for p in result.problems],
    }
