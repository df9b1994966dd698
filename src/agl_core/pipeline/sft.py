"""Spans to supervised fine-tuning examples: one per LLM call, with the exact tokens where the gateway
recorded them and the recorded messages where it did not.

Pure functions over :class:`~agl_core.records.Span` records: no tokenizer, no torch. An example without
token ids carries the call's messages (OpenAI chat format), its response message and its tools; the
trainer renders them with the policy's chat template and counts the example as re-tokenised.

Which record of a call is used, per rollout:

1. Every successful gateway call with token ids from a trainable backend is an *exact* example (the
   transition :func:`~agl_core.pipeline.transitions.spans_to_transitions` makes of it).
2. A gateway call without usable token ids (an API model behind the gateway, a production gateway that
   records messages only) is an example from the messages the gateway recorded.
3. When a rollout has no gateway call at all (an imported trace of an API model), its framework LLM spans
   (GenAI ``gen_ai.input.messages`` / ``gen_ai.output.messages``, OpenInference ``llm.input_messages.*`` /
   ``llm.output_messages.*``) are examples from their messages. When several sources describe the calls
   (an agl adapter and an OpenInference instrumentor), the first source in the order of
   ``spans_to_transitions`` (agl adapters before OpenInference) is used and the others are not counted.
   Where a rollout has gateway calls, a framework span not joined to one keeps the reason
   ``spans_to_transitions`` gives: it may describe one of them, so it is not used a second time.

A call that cannot be used is reported with a reason (:data:`NO_MESSAGES`, :data:`NO_RESPONSE`,
:data:`CALL_FAILED`, ...), never guessed at. Rewards are not required: the rollout's episode reward, when
it has one, is on each example for the selection (rejection sampling keeps the well-rewarded rollouts).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .. import semconv
from ..records import Span, Transition
from .spantree import GATEWAY, LLM, SpanTree, is_gateway_llm, kind_of, source_of
from .transitions import (
    CALL_FAILED,
    NO_LLM_CALL,
    NOT_TRAINABLE,
    Problem,
    _rollout_transitions,
    episode_rewards,
)

__all__ = [
    "AGENT_NOT_SELECTED",
    "NO_MESSAGES",
    "PROMPT_CUT",
    "NO_RESPONSE",
    "SftExample",
    "SftResult",
    "call_messages",
    "spans_to_sft_examples",
]

# Reasons, stable strings to group by.
NO_MESSAGES = "LLM call recorded no input messages (message content was not captured)"
NO_RESPONSE = "LLM call recorded no response (empty or missing output message)"
AGENT_NOT_SELECTED = "LLM call by an agent not selected for training"
PROMPT_CUT = (
    "LLM call whose input messages or tools the gateway recorded cut short (over its"
    " --max-recorded-prompt-bytes): no whole prompt to train on"
)


@dataclasses.dataclass(frozen=True)
class SftExample:
    """One LLM call to fine-tune on: the exact tokens (``transition``), or the recorded messages."""

    rollout_id: str
    #: Position of the call in its rollout, counting from 0 over the calls used.
    call_index: int
    span_id: str
    task_id: str | None
    agent_name: str | None
    #: The rollout's episode reward; ``None`` when it has none.
    reward: float | None
    #: The gateway's exact token ids (and logprobs); ``None`` when the example must be re-tokenised.
    transition: Transition | None = None
    #: The input messages, OpenAI chat format (``role``, ``content`` text, ``tool_calls``, ``tool_call_id``).
    messages: tuple[Mapping[str, Any], ...] = ()
    #: The assistant's response message, same format.
    response: Mapping[str, Any] | None = None
    #: Tool definitions offered to the model (OpenAI format), when recorded.
    tools: tuple[Mapping[str, Any], ...] | None = None

    @property
    def exact(self) -> bool:
        """Whether the example has the token ids the model saw and produced."""
        return self.transition is not None


@dataclasses.dataclass(frozen=True)
class SftResult:
    examples: tuple[SftExample, ...]
    problems: tuple[Problem, ...]

    def reasons(self) -> dict[str, int]:
        """How many calls or rollouts could not be used, by reason."""
        counts: dict[str, int] = defaultdict(int)
        for p in self.problems:
            counts[p.reason] += 1
        return dict(counts)


# --- messages -------------------------------------------------------------------------------------------
def _text(content: Any) -> str | None:
    """Text of a message's content: a string, or a list of text parts (OpenAI or GenAI shape)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping):
                value = part.get("text", part.get("content"))
                if isinstance(value, str):
                    texts.append(value)
        return "".join(texts)
    return json.dumps(content, ensure_ascii=False)


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value if value is not None else {})


def _tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    fn = fn if isinstance(fn, Mapping) else call
    out: dict[str, Any] = {
        "type": "function",
        "function": {"name": str(fn.get("name") or ""), "arguments": _arguments(fn.get("arguments"))},
    }
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _chat_message(raw: Any) -> dict[str, Any] | None:
    """One message in OpenAI chat format, from the OpenAI shape or the GenAI conventions' ``parts``."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("role"), str):
        return None
    role = str(raw["role"])
    parts = raw.get("parts")
    if isinstance(parts, list):  # GenAI semantic conventions: typed parts
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        tool_call_id = None
        for part in parts:
            if not isinstance(part, Mapping):
                continue
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("content"), str):
                texts.append(part["content"])
            elif kind == "tool_call":
                calls.append(_tool_call(part))
            elif kind == "tool_call_response":
                tool_call_id = part.get("id")
                response = part.get("response")
                texts.append(response if isinstance(response, str) else json.dumps(response))
        message: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        if isinstance(tool_call_id, str):
            message["tool_call_id"] = tool_call_id
        return message
    message = {"role": role, "content": _text(raw.get("content")) or ""}
    calls_raw = raw.get("tool_calls")
    if isinstance(calls_raw, list) and calls_raw:
        message["tool_calls"] = [_tool_call(c) for c in calls_raw if isinstance(c, Mapping)]
    for key in ("tool_call_id", "name"):
        if isinstance(raw.get(key), str):
            message[key] = raw[key]
    return message


def _json_list(value: Any) -> list[Any] | None:
    if not isinstance(value, str):
        return None
    try:
        data = json.loads(value)
    except ValueError:
        return None
    return data if isinstance(data, list) else None


def _unflatten(attributes: Mapping[str, Any], prefix: str) -> list[Any]:
    """OpenInference's flattened list ``prefix.N.a.b...`` as a list of nested dicts, by index."""
    items: dict[int, dict[str, Any]] = {}
    for key, value in attributes.items():
        if not key.startswith(prefix + "."):
            continue
        index, _, rest = key[len(prefix) + 1 :].partition(".")
        if not index.isdigit() or not rest:
            continue
        node = items.setdefault(int(index), {})
        parts = rest.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                break
            node = child
        else:
            node[parts[-1]] = value
    return [items[i] for i in sorted(items)]


def _indexed(node: Any) -> list[Any]:
    """``{"0": a, "1": b}`` (an unflattened list) as ``[a, b]``."""
    if not isinstance(node, Mapping):
        return []
    return [node[k] for k in sorted((k for k in node if str(k).isdigit()), key=int)]


def _oi_message(item: Mapping[str, Any]) -> dict[str, Any] | None:
    m = item.get("message")
    if not isinstance(m, Mapping):
        return None
    content = m.get("content")
    if content is None and isinstance(m.get("contents"), Mapping):
        content = "".join(
            str(c.get("message_content", {}).get("text", ""))
            for c in _indexed(m["contents"])
            if isinstance(c, Mapping) and isinstance(c.get("message_content"), Mapping)
        )
    raw: dict[str, Any] = {"role": m.get("role"), "content": content}
    calls = []
    for c in _indexed(m.get("tool_calls")):
        call = c.get("tool_call") if isinstance(c, Mapping) else None
        if isinstance(call, Mapping):
            calls.append(call)
    if calls:
        raw["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if key in m:
            raw[key] = m[key]
    return _chat_message(raw)


def call_messages(
    span: Span,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, list[dict[str, Any]] | None]:
    """``(input messages, response message, tools)`` an LLM span recorded, OpenAI chat format; empty /
    ``None`` where it recorded nothing readable. GenAI JSON attributes are read first, then
    OpenInference's flattened ones."""
    attrs = span.attributes
    inputs = _json_list(attrs.get(semconv.GEN_AI_INPUT_MESSAGES))
    outputs = _json_list(attrs.get(semconv.GEN_AI_OUTPUT_MESSAGES))
    messages = [m for m in map(_chat_message, inputs or []) if m is not None]
    responses = [m for m in map(_chat_message, outputs or []) if m is not None]
    if not messages:
        messages = [m for m in map(_oi_message, _unflatten(attrs, semconv.OI_INPUT_MESSAGES)) if m]
    if not responses:
        responses = [m for m in map(_oi_message, _unflatten(attrs, semconv.OI_OUTPUT_MESSAGES)) if m]
    tools_raw = _json_list(attrs.get(semconv.GEN_AI_TOOL_DEFINITIONS))
    if tools_raw is None:
        schemas = [t.get("tool", {}).get("json_schema") for t in _unflatten(attrs, semconv.OI_TOOLS)]
        tools_raw = [json.loads(s) for s in schemas if isinstance(s, str) and s.startswith("{")]
    tools = [dict(t) for t in tools_raw if isinstance(t, Mapping)] or None
    response = responses[0] if responses else None
    if response is not None and not response.get("content") and not response.get("tool_calls"):
        response = None
    return messages, response, tools


# --- spans to examples ----------------------------------------------------------------------------------
def _is_gateway_call(span: Span) -> bool:
    return kind_of(span) == GATEWAY and span.attributes.get(semconv.GEN_AI_OPERATION_NAME) in (
        semconv.OP_CHAT,
        semconv.OP_TEXT_COMPLETION,
    )


def spans_to_sft_examples(spans: Iterable[Span], *, agents: Sequence[str] = ()) -> SftResult:
    """The fine-tuning examples of the rollouts in ``spans`` (see the module docstring).

    ``agents``: globs of agent names whose calls are kept (all when empty); the others are reported as
    :data:`AGENT_NOT_SELECTED`. Examples come per rollout, in the order of their calls.
    """
    by_rollout: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        if span.rollout_id is not None:
            by_rollout[span.rollout_id].append(span)
    rewards = episode_rewards(s for group in by_rollout.values() for s in group)
    examples: list[SftExample] = []
    problems: list[Problem] = []
    for rollout_id, group in by_rollout.items():
        made, found = _rollout_examples(rollout_id, group, rewards.get(rollout_id))
        for example in made:
            if agents and not (
                example.agent_name and any(fnmatch.fnmatchcase(example.agent_name, p) for p in agents)
            ):
                found.append(
                    Problem(rollout_id, AGENT_NOT_SELECTED, example.span_id, example.agent_name or "")
                )
            else:
                examples.append(example)
        problems.extend(found)
    return SftResult(tuple(examples), tuple(problems))


def _rollout_examples(
    rollout_id: str, spans: list[Span], reward: float | None
) -> tuple[list[SftExample], list[Problem]]:
    spans.sort(key=lambda s: (s.start_ns, s.seq or 0))
    tree = SpanTree(spans)
    joins: dict[str, str] = {}
    transitions, found = _rollout_transitions(rollout_id, spans, 0.0 if reward is None else reward, joins)
    exact = {t.span_id: t for t in transitions}
    gateway_calls = [s for s in tree.spans if _is_gateway_call(s) or is_gateway_llm(s)]
    candidates: list[Span]
    if gateway_calls:
        candidates = gateway_calls
        # a gateway call that was not trained on for its backend is used through its messages
        problems = [p for p in found if p.reason != NOT_TRAINABLE]
    else:
        by_source: dict[str, list[Span]] = defaultdict(list)
        for span in tree.spans:
            if kind_of(span) == LLM:
                by_source[source_of(span)].append(span)
        order = sorted(by_source, key=lambda name: (name == semconv.SOURCE_OPENINFERENCE, name))
        candidates = by_source[order[0]] if order else []
        # framework calls are used here, not joined: only the rollout-level problems of the transitions stay
        problems = [p for p in found if p.span_id is None and p.reason != NO_LLM_CALL]
        if not candidates:
            problems.append(Problem(rollout_id, NO_LLM_CALL))
    task_id = next(
        (str(s.attributes[semconv.TASK_ID]) for s in spans if semconv.TASK_ID in s.attributes), None
    )
    partner_of = {gateway_id: framework_id for framework_id, gateway_id in joins.items()}
    examples: list[SftExample] = []
    for span in candidates:
        transition = exact.get(span.span_id)
        partner = tree.by_id.get(partner_of.get(span.span_id, ""))
        agent = tree.agent_name(partner if partner is not None else span)
        if transition is not None:
            examples.append(
                SftExample(
                    rollout_id,
                    len(examples),
                    span.span_id,
                    task_id,
                    agent,
                    reward,
                    dataclasses.replace(transition, call_index=len(examples), agent_name=agent),
                )
            )
            continue
        if span.is_error:
            if not is_gateway_llm(span):  # the transitions reported the failed calls with token ids
                problems.append(Problem(rollout_id, CALL_FAILED, span.span_id))
            continue
        if (
            semconv.INPUT_MESSAGES_ORIGINAL_BYTES in span.attributes
            or semconv.TOOL_DEFINITIONS_ORIGINAL_BYTES in span.attributes
        ):
            problems.append(Problem(rollout_id, PROMPT_CUT, span.span_id))
            continue
        messages, response, tools = call_messages(span)
        if not messages:
            problems.append(Problem(rollout_id, NO_MESSAGES, span.span_id))
            continue
        if response is None:
            problems.append(Problem(rollout_id, NO_RESPONSE, span.span_id))
            continue
        examples.append(
            SftExample(
                rollout_id,
                len(examples),
                span.span_id,
                task_id,
                agent,
                reward,
                None,
                tuple(messages),
                response,
                tuple(tools) if tools else None,
            )
        )
    return examples, problems
