"""Human-readable account of one rollout: its span tree, its transitions, and why any LLM call produced
no transition. Pure: spans in, text out (``agl inspect`` prints it)."""

from __future__ import annotations

from collections.abc import Sequence

from .. import semconv
from ..records import Rollout, Span, Transition
from .spantree import AGENT, GATEWAY, LLM, TOOL, SpanTree, kind_of, own_agent_name, source_of, tool_name
from .transitions import NOT_JOINED, TransitionResult, spans_to_transitions

__all__ = ["count_llm_calls", "format_rollout", "span_outcomes", "unjoined_response_ids"]


def _describe(span: Span, tree: SpanTree, transition_of: dict[str, int], problem_of: dict[str, str]) -> str:
    kind = kind_of(span)
    source = source_of(span)
    tags = [kind] if kind not in ("other",) else []
    if source and source != kind:
        tags.append(source)
    if kind == AGENT and own_agent_name(span):
        tags.append(f"agent={own_agent_name(span)}")
    elif kind in (LLM, TOOL, GATEWAY) and tree.agent_name(span):
        tags.append(f"agent={tree.agent_name(span)}")
    tool = tool_name(span)
    if kind == TOOL and tool and tool not in span.name:
        tags.append(f"tool={tool}")
    if kind == GATEWAY and semconv.PROMPT_TOKEN_IDS in span.attributes:
        attrs = span.attributes
        tags.append(f"{len(attrs[semconv.PROMPT_TOKEN_IDS])}+{len(attrs[semconv.RESPONSE_TOKEN_IDS])} tokens")
    if span.attributes.get(semconv.TOOL_CALL_MALFORMED) is True:
        reasons = span.attributes.get(semconv.TOOL_CALL_MALFORMED_REASONS) or ()
        tags.append("malformed tool call" + (f" ({', '.join(map(str, reasons))})" if reasons else ""))
    if span.name == semconv.SPAN_REWARD:
        reward_name = span.attributes.get(semconv.REWARD_NAME, "episode")
        tags.append(f"{reward_name}={span.attributes.get(semconv.REWARD_VALUE)}")
    if span.is_error:
        tags.append(f"ERROR {span.status_message}".rstrip())
    if span.span_id in transition_of:
        tags.append(f"-> transition {transition_of[span.span_id]}")
    if span.span_id in problem_of:
        tags.append(f"-> no transition: {problem_of[span.span_id]}")
    return span.name + ("  [" + ", ".join(tags) + "]" if tags else "")


def _outcome_lines(rollout: Rollout) -> list[str]:
    """How the rollout ended: its status, and for a failed attempt the stored error and traceback."""
    attempts = rollout.attempts
    lines = [f"status: {rollout.status.value} (task {rollout.task_id}, {len(attempts)} attempt(s))"]
    last = attempts[-1] if attempts else None
    if last is not None and last.error:
        first, _, rest = last.error.strip().partition("\n")
        lines.append(f"error ({last.attempt_id}, {last.status.value}): {first}")
        if rest.strip():
            lines += ["", "stored traceback"] + ["  " + line for line in rest.strip("\n").splitlines()]
    return lines


def count_llm_calls(spans: Sequence[Span]) -> int:
    """How many LLM calls went through the gateway among ``spans`` (its spans that carry token ids)."""
    return sum(1 for s in spans if kind_of(s) == GATEWAY and semconv.PROMPT_TOKEN_IDS in s.attributes)


def _policy(t: Transition) -> str:
    """What served a call: its policy version, after the policy's name when each agent has its own
    (``writer v3``, ``base v3``)."""
    version = "-" if t.policy_version is None else f"v{t.policy_version}"
    return version if t.policy_name is None else f"{t.policy_name[:20]} {version}"


def span_outcomes(result: TransitionResult) -> tuple[dict[str, int], dict[str, str]]:
    """What became of each span: ``{span id: call index}`` for the gateway spans that made a transition
    and the framework spans joined to them, and ``{span id: why it made none}`` for the others."""
    transition_of = {t.span_id: t.call_index for t in result.transitions if t.span_id}
    transition_of.update({f: transition_of[g] for f, g in result.joins.items() if g in transition_of})
    problem_of = {
        p.span_id: p.reason + (f" ({p.detail})" if p.detail else "") for p in result.problems if p.span_id
    }
    return transition_of, problem_of


def unjoined_response_ids(spans: Sequence[Span]) -> list[str]:
    """The response ids of the LLM calls among ``spans`` that no gateway span of theirs records (where to
    look for the gateway's record elsewhere)."""
    result = spans_to_transitions(spans)
    unjoined = {p.span_id for p in result.problems if p.reason == NOT_JOINED}
    return [
        str(s.attributes[semconv.GEN_AI_RESPONSE_ID])
        for s in spans
        if s.span_id in unjoined and isinstance(s.attributes.get(semconv.GEN_AI_RESPONSE_ID), str)
    ]


def format_rollout(
    rollout_id: str,
    spans: Sequence[Span],
    *,
    rollout: Rollout | None = None,
    recorded_in: dict[str, str] | None = None,
) -> str:
    """The report of ``rollout_id`` from its spans (as the store returns them); with its ``rollout``
    record, how it ended (status, error, stored traceback) comes first. ``recorded_in``: response id ->
    the other rollout where the gateway recorded that call (said beside the call's problem)."""
    spans = [s for s in spans if s.rollout_id == rollout_id]
    head = _outcome_lines(rollout) + [""] if rollout is not None else []
    if not spans:
        return "\n".join([*head, f"rollout {rollout_id}: no spans"])
    tree = SpanTree(spans)
    result = spans_to_transitions(spans)
    transition_of, problem_of = span_outcomes(result)
    llm_calls = count_llm_calls(spans)
    lines = head + [
        f"rollout {rollout_id}: {len(spans)} spans, {llm_calls} LLM calls through the gateway, "
        f"{len(result.transitions)} transitions",
        "",
        "span tree",
    ]
    lines += [
        "  " + "  " * depth + _describe(span, tree, transition_of, problem_of) for depth, span in tree.walk()
    ]
    lines += ["", "transitions"]
    if result.transitions:
        lines.append(
            f"  {'#':>3}  {'agent':<20} {'prompt':>7} "
            f"{'response':>9} {'reward':>8} {'policy':>12}  gateway span"
        )
        for t in result.transitions:
            lines.append(
                f"  {t.call_index:>3}  {(t.agent_name or '-'):<20} {len(t.prompt_ids):>7} "
                f"{len(t.response_ids):>9} {t.reward:>8.3g} {_policy(t):>12}  {t.span_id}"
            )
    else:
        lines.append("  none")
    lines += ["", "problems"]
    if not result.problems:
        lines.append("  none")
    for p in result.problems:
        where = f"span {p.span_id} ({tree.by_id[p.span_id].name})" if p.span_id in tree.by_id else "rollout"
        lines.append(f"  {where}: {p.reason}" + (f" ({p.detail})" if p.detail else ""))
        span = tree.by_id.get(p.span_id or "")
        elsewhere = (
            (recorded_in or {}).get(str(span.attributes.get(semconv.GEN_AI_RESPONSE_ID))) if span else None
        )
        if p.reason == NOT_JOINED and elsewhere:
            lines.append(
                f"    it did go through the gateway, which recorded it in rollout {elsewhere} (the agent ran"
                " outside agl's runner, so the gateway could not tell which rollout the call was for):"
                f" agl inspect {elsewhere}"
            )
    return "\n".join(lines)
