"""Pure conversions from OpenAI Agents SDK span data to OpenTelemetry span names and attributes.

Span data is read by its ``type`` and attributes (duck typing), so this module imports nothing from the
SDK. Keys follow the GenAI conventions, plus ``agl.*`` for handoffs and guardrails.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agl_core import semconv
from agl_core.instrumentation import read_usage, usage_attributes

__all__ = [
    "ToolCall",
    "agent_name",
    "end_attributes",
    "error_description",
    "is_bookkeeping",
    "match_tool_call",
    "response_message",
    "response_tool_calls",
    "span_name",
    "start_attributes",
    "start_info",
    "tool_calls",
]

#: ``(call id, tool name, JSON arguments)`` of a tool call the model made.
ToolCall = tuple[str, str, str]

_OPERATIONS = {
    "agent": semconv.OP_INVOKE_AGENT,
    "generation": semconv.OP_CHAT,
    "response": semconv.OP_CHAT,
    "function": semconv.OP_EXECUTE_TOOL,
    "handoff": semconv.OP_HANDOFF,
    "guardrail": semconv.OP_GUARDRAIL,
}


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def span_name(data: Any) -> str:
    """A GenAI-style span name (``invoke_agent triage``, ``chat gpt-4o``, ``execute_tool add``...)."""
    kind = getattr(data, "type", "")
    if kind == "agent":
        return f"{semconv.OP_INVOKE_AGENT} {data.name}"
    if kind in ("generation", "response"):
        model = model_name(data)
        return f"{semconv.OP_CHAT} {model}" if model else semconv.OP_CHAT
    if kind == "function":
        return f"{semconv.OP_EXECUTE_TOOL} {data.name}"
    if kind == "handoff":
        return f"handoff {data.from_agent or '?'} -> {data.to_agent or '?'}"
    if kind == "guardrail":
        return f"guardrail {data.name}"
    name = getattr(data, "name", None)
    return name if isinstance(name, str) and name else kind or "span"


def is_bookkeeping(data: Any) -> bool:
    """The SDK's ``task`` and ``turn`` spans, which only group what runs inside them (older SDKs made
    them custom spans with an ``sdk_span_type``)."""
    kind = getattr(data, "type", "")
    if kind == "custom":
        kind = (getattr(data, "data", None) or {}).get("sdk_span_type")
    return kind in ("task", "turn")


def model_name(data: Any) -> str | None:
    model = getattr(data, "model", None)
    if isinstance(model, str) and model:
        return model
    response = getattr(data, "response", None)
    model = getattr(response, "model", None)
    return model if isinstance(model, str) and model else None


def agent_name(data: Any) -> str | None:
    """The agent a span starts (agent spans) or is about (turn spans); ``None`` for the others."""
    kind = getattr(data, "type", "")
    if kind == "agent":
        return str(data.name)
    value = getattr(data, "agent_name", None)
    if kind == "custom":
        value = (getattr(data, "data", None) or {}).get("agent_name")
    return value if isinstance(value, str) and value else None


def start_attributes(data: Any) -> dict[str, Any]:
    """Attributes known when the span starts."""
    kind = getattr(data, "type", "")
    attrs: dict[str, Any] = {semconv.GEN_AI_OPERATION_NAME: _OPERATIONS.get(kind, semconv.OP_STEP)}
    if kind == "agent":
        attrs[semconv.GEN_AI_AGENT_NAME] = str(data.name)
    elif kind == "function":
        attrs[semconv.GEN_AI_TOOL_NAME] = str(data.name)
    elif kind == "guardrail":
        attrs[semconv.GUARDRAIL_NAME] = str(data.name)
    elif kind in ("generation", "response"):
        model = model_name(data)
        if model:
            attrs[semconv.GEN_AI_REQUEST_MODEL] = model
        config = getattr(data, "model_config", None) or {}
        for key, attr in (
            ("temperature", semconv.GEN_AI_REQUEST_TEMPERATURE),
            ("top_p", semconv.GEN_AI_REQUEST_TOP_P),
            ("max_tokens", semconv.GEN_AI_REQUEST_MAX_TOKENS),
        ):
            if isinstance(config.get(key), (int, float)) and not isinstance(config.get(key), bool):
                attrs[attr] = config[key]
    return attrs


def start_info(data: Any) -> tuple[str, dict[str, Any], str | None, bool]:
    """``(span name, start attributes, agent name, is an LLM call)`` in one pass (the hot path)."""
    return (
        span_name(data),
        start_attributes(data),
        agent_name(data),
        getattr(data, "type", "") in ("generation", "response"),
    )


def _usage(usage: Any) -> dict[str, int]:
    return usage_attributes(*read_usage(usage))


def end_attributes(data: Any, *, capture_content: bool = False) -> dict[str, Any]:
    """Attributes known when the span ends (outputs, usage, handoff target, guardrail result)."""
    kind = getattr(data, "type", "")
    attrs: dict[str, Any] = {}
    if kind == "generation":
        attrs.update(_usage(getattr(data, "usage", None)))
        if capture_content and data.input is not None:
            attrs[semconv.GEN_AI_INPUT_MESSAGES] = _json(list(data.input))
        if capture_content and data.output is not None:
            attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = _json(list(data.output))
    elif kind == "response":
        response = getattr(data, "response", None)
        if response is not None:
            if isinstance(getattr(response, "id", None), str):
                attrs[semconv.GEN_AI_RESPONSE_ID] = response.id
            if isinstance(getattr(response, "model", None), str):
                attrs[semconv.GEN_AI_RESPONSE_MODEL] = response.model
            attrs.update(_usage(getattr(response, "usage", None)))
            if capture_content and getattr(response, "output", None) is not None:
                attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = _json([response_message(response.output)])
        attrs.update(_usage(getattr(data, "usage", None)))
        if capture_content and getattr(data, "input", None) is not None:
            attrs[semconv.GEN_AI_INPUT_MESSAGES] = _json(data.input)
    elif kind == "handoff":
        if data.from_agent:
            attrs[semconv.HANDOFF_FROM_AGENT] = str(data.from_agent)
        if data.to_agent:
            attrs[semconv.HANDOFF_TO_AGENT] = str(data.to_agent)
    elif kind == "guardrail":
        attrs[semconv.GUARDRAIL_TRIGGERED] = bool(data.triggered)
    return attrs


def _field(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, Mapping) else getattr(value, key, None)


def response_message(output: Sequence[Any] | None) -> dict[str, Any]:
    """A Responses API output (its ``message`` and ``function_call`` items, objects or dicts) as one
    OpenAI-chat assistant message: the text of its ``output_text`` parts and its function calls as
    ``tool_calls`` under their ``call_id``. Other items (reasoning, built-in tool calls) are left out."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in output or ():
        kind = _field(item, "type")
        if kind == "message":
            for part in _field(item, "content") or ():
                text = _field(part, "text")
                if _field(part, "type") == "output_text" and isinstance(text, str):
                    texts.append(text)
        elif kind == "function_call":
            function = {"name": _field(item, "name"), "arguments": _field(item, "arguments")}
            calls.append({"id": _field(item, "call_id"), "type": "function", "function": function})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    return message


def response_tool_calls(response: Any) -> list[ToolCall]:
    """The function calls in a Responses API response's output."""
    output = getattr(response, "output", None)
    return tool_calls([response_message(output)]) if output else []


def tool_calls(output: Sequence[Mapping[str, Any]] | None) -> list[ToolCall]:
    """The tool calls in a generation's output messages (OpenAI chat format)."""
    calls: list[ToolCall] = []
    for message in output or []:
        for call in (message.get("tool_calls") if isinstance(message, Mapping) else None) or []:
            function = call.get("function") or {}
            if isinstance(call.get("id"), str) and isinstance(function.get("name"), str):
                calls.append((call["id"], function["name"], str(function.get("arguments") or "")))
    return calls


def _same_arguments(a: str, b: Any) -> bool:
    try:
        return bool(json.loads(a or "{}") == json.loads(b or "{}"))
    except (TypeError, ValueError):
        return bool(a == b)


def match_tool_call(name: str, arguments: Any, calls: list[ToolCall]) -> str | None:
    """Take from ``calls`` the call a function span ran (same name, same arguments; else same name)."""
    for exact in (True, False):
        for i, (call_id, call_name, call_args) in enumerate(calls):
            if call_name == name and (not exact or _same_arguments(call_args, arguments)):
                del calls[i]
                return call_id
    return None


def error_description(error: Mapping[str, Any]) -> tuple[str, str]:
    """``(error.type, status description)`` of an SDK ``SpanError`` (``{"message", "data"}``)."""
    message = str(error.get("message") or "error")
    data = error.get("data") or {}
    detail = data.get("error") if isinstance(data, Mapping) else None
    description = f"{message}: {detail}" if detail else message
    kind = message.split(" (")[0].strip().replace(" ", "_").lower() or "error"
    return kind, description
