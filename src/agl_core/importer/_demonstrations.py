"""Known-good LLM calls (demonstrations) as OTLP JSON lines that ``agl import`` stores as rollouts and the
stored-traces SFT path learns from.

A benchmark's gold answers, or calls a person wrote or approved, are a warm start for a model too weak to
succeed by itself (its rollout groups tie and RL has nothing to compare). :func:`write_demonstrations`
writes each call as one span of its own trace in the OpenTelemetry GenAI conventions
(``gen_ai.input.messages``, ``gen_ai.tool.definitions``, ``gen_ai.output.messages`` with ``text`` and
``tool_call`` parts), in the file format of the Collector's ``file`` exporter, so that the same file can
be inspected, kept, or imported anywhere else.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import semconv

__all__ = ["Demonstration", "write_demonstrations"]

#: Spans per OTLP JSON line.
_PER_LINE = 100
#: The first span's start time (any fixed time: a rerun writes the same file).
_EPOCH_NS = 1_700_000_000_000_000_000


@dataclasses.dataclass(frozen=True)
class Demonstration:
    """One LLM call as it should have gone.

    ``id``: unique among the demonstrations (it fixes the trace id, so a rerun imports nothing twice);
    ``messages``: the prompt, OpenAI chat messages with text content; ``response``: the reply's text;
    ``tool_calls``: the calls it makes instead or as well, ``(function name, arguments)``; ``tools``: the
    OpenAI tool definitions offered; ``agent``: the calling agent's name (``gen_ai.agent.name``), for
    ``traces.filter`` and per-agent policies; ``attributes``: more string attributes for the span.
    """

    id: str
    messages: Sequence[Mapping[str, Any]]
    response: str = ""
    tool_calls: Sequence[tuple[str, Mapping[str, Any]]] = ()
    tools: Sequence[Mapping[str, Any]] = ()
    agent: str | None = None
    attributes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.messages:
            raise ValueError(f"demonstration {self.id!r} has no prompt messages")
        if not self.response and not self.tool_calls:
            raise ValueError(f"demonstration {self.id!r} has neither a response text nor tool calls")
        for message in self.messages:
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise ValueError(
                    f"demonstration {self.id!r}: every prompt message needs a string role and text content"
                )


def _attribute(key: str, value: str) -> dict[str, Any]:
    return {"key": key, "value": {"stringValue": value}}


def _span(demo: Demonstration, start_ns: int) -> dict[str, Any]:
    digest = hashlib.sha256(f"agl-demonstration:{demo.id}".encode()).hexdigest()
    inputs = [
        {"role": m["role"], "parts": [{"type": "text", "content": m["content"]}]} for m in demo.messages
    ]
    parts: list[dict[str, Any]] = [{"type": "text", "content": demo.response}] if demo.response else []
    parts += [
        {"type": "tool_call", "id": f"call_{i}", "name": name, "arguments": dict(arguments)}
        for i, (name, arguments) in enumerate(demo.tool_calls)
    ]
    output = {
        "role": "assistant",
        "parts": parts,
        "finish_reason": "tool_calls" if demo.tool_calls else "stop",
    }
    attributes = [
        _attribute(semconv.GEN_AI_OPERATION_NAME, semconv.OP_CHAT),
        _attribute(semconv.GEN_AI_INPUT_MESSAGES, json.dumps(inputs, ensure_ascii=False)),
        _attribute(semconv.GEN_AI_OUTPUT_MESSAGES, json.dumps([output], ensure_ascii=False)),
    ]
    if demo.tools:
        attributes.append(_attribute(semconv.GEN_AI_TOOL_DEFINITIONS, json.dumps(list(demo.tools))))
    if demo.agent:
        attributes.append(_attribute(semconv.GEN_AI_AGENT_NAME, demo.agent))
    attributes += [_attribute(k, str(v)) for k, v in demo.attributes.items()]
    return {
        "traceId": digest[:32],
        "spanId": digest[32:48],
        "name": "chat demonstration",
        "kind": 3,  # client
        "startTimeUnixNano": str(start_ns),
        "endTimeUnixNano": str(start_ns + 1_000_000),
        "attributes": attributes,
        "status": {"code": 1},
    }


def write_demonstrations(path: str | Path, demonstrations: Iterable[Demonstration], *, service: str) -> int:
    """Write ``demonstrations`` to ``path`` as OTLP JSON lines (resource ``service.name`` = ``service``);
    return how many. ``agl import PATH`` then stores one rollout per demonstration, which
    ``traces.filter.source: import`` selects for ``algorithm: sft``."""
    spans, seen = [], set()
    for i, demo in enumerate(demonstrations):
        if demo.id in seen:
            raise ValueError(f"two demonstrations have the id {demo.id!r}; ids must be unique")
        seen.add(demo.id)
        spans.append(_span(demo, _EPOCH_NS + i * 10_000_000))
    resource = {"attributes": [_attribute("service.name", service)]}
    with Path(path).open("w", encoding="utf-8") as f:
        for start in range(0, len(spans), _PER_LINE):
            scope = {"scope": {"name": "agl.demonstrations"}, "spans": spans[start : start + _PER_LINE]}
            f.write(json.dumps({"resourceSpans": [{"resource": resource, "scopeSpans": [scope]}]}) + "\n")
    return len(spans)
