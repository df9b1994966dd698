"""Pure conversions from AutoGen AgentChat objects to OpenTelemetry span attributes.

Objects are read by attribute (duck typing); nothing here imports AutoGen.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agl_core import semconv
from agl_core.instrumentation import read_usage, usage_attributes

__all__ = [
    "agent_attributes",
    "llm_end_attributes",
    "llm_start_attributes",
    "messages_json",
    "tool_attributes",
]

_ROLES = {
    "SystemMessage": "system",
    "UserMessage": "user",
    "AssistantMessage": "assistant",
    "FunctionExecutionResultMessage": "tool",
}


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _function_calls(calls: Sequence[Any]) -> list[dict[str, Any]]:
    return [
        {
            "id": getattr(c, "id", None),
            "name": getattr(c, "name", None),
            "arguments": getattr(c, "arguments", None),
        }
        for c in calls
    ]


def message_to_dict(message: Any) -> dict[str, Any]:
    """An OpenAI-style dict for an AutoGen ``LLMMessage`` (system / user / assistant / tool results)."""
    role = _ROLES.get(type(message).__name__, str(getattr(message, "type", "user")))
    content = getattr(message, "content", None)
    out: dict[str, Any] = {"role": role}
    source = getattr(message, "source", None)
    if isinstance(source, str):
        out["name"] = source
    if isinstance(content, str):
        out["content"] = content
    elif role == "assistant" and isinstance(content, list):
        out["content"] = None
        out["tool_calls"] = _function_calls(content)
    elif role == "tool" and isinstance(content, list):
        out["content"] = [
            {
                "tool_call_id": getattr(r, "call_id", None),
                "content": getattr(r, "content", None),
                "is_error": getattr(r, "is_error", None),
            }
            for r in content
        ]
    else:
        out["content"] = str(content)
    return out


def messages_json(messages: Sequence[Any]) -> str:
    return _json([message_to_dict(m) for m in messages])


def _with(attrs: dict[str, Any], optional: dict[str, Any]) -> dict[str, Any]:
    attrs.update((k, v) for k, v in optional.items() if v)
    return attrs


def agent_attributes(agent_name: str, agent_id: str | None, description: str | None) -> dict[str, Any]:
    return _with(
        {semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT, semconv.GEN_AI_AGENT_NAME: agent_name},
        {semconv.GEN_AI_AGENT_ID: agent_id, semconv.GEN_AI_AGENT_DESCRIPTION: description},
    )


def tool_attributes(tool_name: str, call_id: str | None, agent_name: str | None) -> dict[str, Any]:
    return _with(
        {semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL, semconv.GEN_AI_TOOL_NAME: tool_name},
        {semconv.GEN_AI_TOOL_CALL_ID: call_id, semconv.GEN_AI_AGENT_NAME: agent_name},
    )


def llm_start_attributes(
    model: str | None, messages: Sequence[Any] | None, agent_name: str | None, *, capture_content: bool
) -> dict[str, Any]:
    attrs: dict[str, Any] = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT}
    if model:
        attrs[semconv.GEN_AI_REQUEST_MODEL] = model
    if agent_name:
        attrs[semconv.GEN_AI_AGENT_NAME] = agent_name
    if capture_content and messages is not None:
        attrs[semconv.GEN_AI_INPUT_MESSAGES] = messages_json(messages)
    return attrs


def llm_end_attributes(result: Any, *, capture_content: bool) -> dict[str, Any]:
    """Usage, finish reason and (optionally) the output message of a ``CreateResult``."""
    prompt, completion = read_usage(getattr(result, "usage", None))
    # AutoGen's model clients write 0 for a count the server did not send them (a stream without usage;
    # the Anthropic client reads the prompt's count from message_start only). No call recorded by the
    # gateway has 0 tokens on either side, so 0 is no count, not a count to check the join against.
    attrs: dict[str, Any] = usage_attributes(prompt or None, completion or None)
    finish = getattr(result, "finish_reason", None)
    if isinstance(finish, str):
        attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = [finish]
    if capture_content:
        content = getattr(result, "content", None)
        message: dict[str, Any] = {"role": "assistant"}
        if isinstance(content, list):
            message["content"] = None
            message["tool_calls"] = _function_calls(content)
        else:
            message["content"] = content
        attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = _json([message])
    return attrs
