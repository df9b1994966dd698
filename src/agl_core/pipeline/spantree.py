"""One reading of a rollout's spans, whichever component wrote them.

agl's adapters write OpenTelemetry GenAI attributes, OpenInference instrumentors write
``openinference.span.kind`` and their own keys, the gateway writes token ids. These pure functions give a
single view of all of them: what kind of step a span is, which agent it belongs to, how many tokens an
LLM call used. No I/O, no framework.

Agent names. The nearest span (the span itself, then its ancestors) that names an agent explicitly
(``gen_ai.agent.name``, or OpenInference's ``agent.name`` / ``graph.node.id`` on an AGENT span) wins.
Spans of OpenInference's LangChain instrumentor name no agent; for them the LangGraph rule of
:class:`agl_langchain.AglCallbackHandler` is applied to their ``metadata``: the outermost graph compiled
with a name of its own, else the outermost graph node, is the agent.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .. import semconv
from ..records import Span

__all__ = [
    "AGENT",
    "GATEWAY",
    "LLM",
    "OTHER",
    "STEP",
    "TOOL",
    "SpanTree",
    "is_gateway_llm",
    "is_timeout_error",
    "kind_of",
    "langgraph_role",
    "own_agent_name",
    "source_of",
    "tool_name",
    "usage",
]

# What a span is, whatever wrote it.
LLM = "llm"  # a framework's record of an LLM call
GATEWAY = "gateway"  # the gateway's record of an LLM call, with token ids
TOOL = "tool"
AGENT = "agent"
STEP = "step"  # a chain, graph node or workflow step that is neither of the above
OTHER = "other"

#: The name LangGraph gives a compiled graph that was not named.
_LANGGRAPH_DEFAULT_NAME = "LangGraph"
_LANGGRAPH = "langgraph"


def is_gateway_llm(span: Span) -> bool:
    return semconv.RESPONSE_TOKEN_IDS in span.attributes and semconv.PROMPT_TOKEN_IDS in span.attributes


def is_timeout_error(span: Span) -> bool:
    """An ``agl.error`` span recording a timeout: ``error.type`` is ``RolloutTimeout`` (what the runner
    records for a rollout that ran past its time limit) or another name ending in ``Timeout`` or
    ``TimeoutError``."""
    if span.name != semconv.SPAN_ERROR:
        return False
    kind = span.attributes.get(semconv.ERROR_TYPE)
    return isinstance(kind, str) and (
        kind == semconv.ERROR_TYPE_ROLLOUT_TIMEOUT or kind.endswith(("Timeout", "TimeoutError"))
    )


def kind_of(span: Span) -> str:
    attrs = span.attributes
    if is_gateway_llm(span) or attrs.get(semconv.SOURCE) == semconv.SOURCE_GATEWAY:
        return GATEWAY
    op = attrs.get(semconv.GEN_AI_OPERATION_NAME)
    oi = attrs.get(semconv.OPENINFERENCE_SPAN_KIND)
    if op in (semconv.OP_CHAT, semconv.OP_TEXT_COMPLETION) or oi == semconv.OPENINFERENCE_KIND_LLM:
        return LLM
    if op == semconv.OP_EXECUTE_TOOL or oi == semconv.OPENINFERENCE_KIND_TOOL:
        return TOOL
    if op == semconv.OP_INVOKE_AGENT or oi == semconv.OPENINFERENCE_KIND_AGENT:
        return AGENT
    if op is not None or oi is not None:
        return STEP
    return OTHER


def source_of(span: Span) -> str:
    """``agl.source``; ``openinference`` for OpenInference spans; ``""`` when nothing says."""
    source = span.attributes.get(semconv.SOURCE)
    if isinstance(source, str):
        return source
    if semconv.OPENINFERENCE_SPAN_KIND in span.attributes:
        return semconv.SOURCE_OPENINFERENCE
    return ""


def own_agent_name(span: Span) -> str | None:
    """The agent this span itself names, if it names one explicitly."""
    attrs = span.attributes
    for key in (semconv.GEN_AI_AGENT_NAME, semconv.OI_AGENT_NAME):
        value = attrs.get(key)
        if isinstance(value, str) and value:
            return value
    if attrs.get(semconv.OPENINFERENCE_SPAN_KIND) == semconv.OPENINFERENCE_KIND_AGENT:
        value = attrs.get(semconv.OI_GRAPH_NODE_ID)
        if isinstance(value, str) and value:
            return value
    return None


def tool_name(span: Span) -> str | None:
    for key in (semconv.GEN_AI_TOOL_NAME, semconv.OI_TOOL_NAME):
        value = span.attributes.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def usage(span: Span) -> tuple[int | None, int | None]:
    """(input tokens, output tokens) an LLM span reports, ``None`` where it reports nothing."""
    attrs = span.attributes
    prompt = _int(attrs.get(semconv.GEN_AI_USAGE_INPUT_TOKENS, attrs.get(semconv.LLM_TOKEN_COUNT_PROMPT)))
    completion = _int(
        attrs.get(semconv.GEN_AI_USAGE_OUTPUT_TOKENS, attrs.get(semconv.LLM_TOKEN_COUNT_COMPLETION))
    )
    return prompt, completion


def langgraph_role(name: str, metadata: Mapping[str, Any] | None) -> str | None:
    """What a LangChain run is to LangGraph, from its name and metadata: ``"graph"`` for a graph compiled
    with a name of its own, ``"node"`` for a graph node, else ``None``."""
    if not metadata:
        return None
    node = metadata.get("langgraph_node")
    if node is not None:
        return "node" if node == name else None
    # A graph's own run carries only this marker (LangGraph 1.x); older versions mark no graph run.
    return (
        "graph" if metadata.get("ls_integration") == _LANGGRAPH and name != _LANGGRAPH_DEFAULT_NAME else None
    )


def _langgraph_role(span: Span) -> str | None:
    """:func:`langgraph_role` of an OpenInference LangChain span (its metadata is a JSON string)."""
    raw = span.attributes.get(semconv.OI_METADATA)
    if not isinstance(raw, str) or "langgraph" not in raw:
        return None
    try:
        metadata = json.loads(raw)
    except ValueError:
        return None
    return langgraph_role(span.name, metadata) if isinstance(metadata, Mapping) else None


class SpanTree:
    """The spans of one rollout (or any set of spans) as a tree; spans whose parent is absent are roots."""

    def __init__(self, spans: Iterable[Span]) -> None:
        self.spans = sorted(spans, key=lambda s: (s.start_ns, s.seq or 0))
        self.by_id = {s.span_id: s for s in self.spans}
        self._children: dict[str | None, list[Span]] = defaultdict(list)
        for span in self.spans:
            parent = span.parent_span_id if span.parent_span_id in self.by_id else None
            self._children[parent].append(span)
        self._agent_cache: dict[str, str | None] = {}

    def parent(self, span: Span) -> Span | None:
        return self.by_id.get(span.parent_span_id) if span.parent_span_id else None

    def children(self, span: Span | None) -> list[Span]:
        """Children in start order (``None``: the roots)."""
        return self._children.get(span.span_id if span is not None else None, [])

    def ancestors(self, span: Span) -> Iterator[Span]:
        """Parent, grandparent, ... (stops on a cycle)."""
        seen = {span.span_id}
        current = self.parent(span)
        while current is not None and current.span_id not in seen:
            yield current
            seen.add(current.span_id)
            current = self.parent(current)

    def agent_name(self, span: Span) -> str | None:
        """The agent ``span`` belongs to (see the module docstring)."""
        if span.span_id in self._agent_cache:
            return self._agent_cache[span.span_id]
        name = own_agent_name(span)
        lineage = [span, *self.ancestors(span)]
        if name is None:
            name = next((n for n in map(own_agent_name, lineage) if n is not None), None)
        if name is None:
            # Outermost first: a named graph, else a node, encloses everything below it.
            roles = [(s, _langgraph_role(s)) for s in reversed(lineage)]
            found = next((s for s, r in roles if r == "graph"), None) or next(
                (s for s, r in roles if r == "node"), None
            )
            name = found.name if found is not None else None
        self._agent_cache[span.span_id] = name
        return name

    def agent_step(self, span: Span) -> Span | None:
        """The nearest enclosing agent step (an agent span, or a LangGraph graph / node) of the agent
        ``span`` belongs to."""
        name = self.agent_name(span)
        for ancestor in self.ancestors(span):
            if (kind_of(ancestor) == AGENT or _langgraph_role(ancestor)) and self.agent_name(
                ancestor
            ) == name:
                return ancestor
        return None

    def walk(self) -> Iterator[tuple[int, Span]]:
        """Depth-first, children in start order: ``(depth, span)``."""
        stack = [(0, s) for s in reversed(self.children(None))]
        while stack:
            depth, span = stack.pop()
            yield depth, span
            stack.extend((depth + 1, c) for c in reversed(self.children(span)))
