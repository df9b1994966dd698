"""Pure conversions from LangChain objects to span attributes."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agl_core import semconv
from agl_core.instrumentation import read_usage, usage_attributes

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "tool"}


def message_to_dict(message: Any) -> dict[str, Any]:
    """An OpenAI-style ``{"role", "content"}`` dict for a LangChain ``BaseMessage``."""
    role = _ROLES.get(getattr(message, "type", ""), getattr(message, "type", "user"))
    content = getattr(message, "content", message)
    out: dict[str, Any] = {
        "role": role,
        "content": content if isinstance(content, (str, list)) else str(content),
    }
    tool_calls = getattr(message, "tool_calls", None)
    if tool_calls:
        out["tool_calls"] = [
            {"id": c.get("id"), "name": c.get("name"), "arguments": c.get("args")} for c in tool_calls
        ]
    return out


def messages_json(batches: Sequence[Sequence[Any]]) -> str:
    """JSON of the first prompt's messages (LangChain passes one list per prompt in the batch)."""
    first = batches[0] if batches else []
    return json.dumps([message_to_dict(m) for m in first], ensure_ascii=False, default=str)


def model_name(serialized: Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> str | None:
    params = kwargs.get("invocation_params") or {}
    metadata = kwargs.get("metadata") or {}
    for value in (
        params.get("model"),
        params.get("model_name"),
        metadata.get("ls_model_name"),
        ((serialized or {}).get("kwargs") or {}).get("model_name"),
    ):
        if isinstance(value, str) and value:
            return value
    return None


def run_name(serialized: Mapping[str, Any] | None, kwargs: Mapping[str, Any], default: str) -> str:
    name = kwargs.get("name")
    if isinstance(name, str) and name:
        return name
    serialized = serialized or {}
    serialized_name = serialized.get("name")
    if isinstance(serialized_name, str):
        return serialized_name
    ident = serialized.get("id")
    if isinstance(ident, list) and ident:
        return str(ident[-1])
    return default


def _response_id(output: Mapping[str, Any], response: Any) -> str | None:
    """The provider's completion id of an ``LLMResult`` (``output``: its ``llm_output``), where the
    integration reports it."""
    found = output.get("id")
    if isinstance(found, str):
        return found
    for batch in getattr(response, "generations", None) or []:
        for generation in batch:
            message = getattr(generation, "message", None)
            for info in (
                getattr(message, "response_metadata", None) or {},
                getattr(generation, "generation_info", None) or {},
            ):
                found = info.get("id")
                if isinstance(found, str):
                    return found
    return None


def _usage(output: Mapping[str, Any], response: Any) -> tuple[int | None, int | None]:
    """(input tokens, output tokens) reported for an ``LLMResult``: in its ``llm_output`` (``output``),
    else in the ``usage_metadata`` of its (last) message."""
    prompt, completion = read_usage(output.get("token_usage") or output.get("usage"))
    if prompt is None:
        for batch in getattr(response, "generations", None) or []:
            for generation in batch:
                meta = getattr(getattr(generation, "message", None), "usage_metadata", None)
                prompt, completion = read_usage(meta)
    return prompt, completion


def end_attributes(response: Any, *, capture_content: bool) -> dict[str, Any]:
    """Completion id, usage and (optionally) output messages of an ``LLMResult`` (called at the end of
    every LLM call: its ``llm_output`` is read once)."""
    output = getattr(response, "llm_output", None) or {}
    attrs: dict[str, Any] = usage_attributes(*_usage(output, response))
    completion_id = _response_id(output, response)
    if completion_id:
        attrs[semconv.GEN_AI_RESPONSE_ID] = completion_id
    if capture_content:
        attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = output_json(response)
    return attrs


def output_json(response: Any) -> str:
    texts = []
    for batch in getattr(response, "generations", None) or []:
        for generation in batch:
            message = getattr(generation, "message", None)
            texts.append(
                message_to_dict(message)
                if message is not None
                else {"role": "assistant", "content": generation.text}
            )
    return json.dumps(texts, ensure_ascii=False, default=str)


def tool_result_error(output: Any) -> str | None:
    """The error text of a tool's output when the tool returned its failure as a ``ToolMessage`` with
    status "error" (``handle_tool_error`` / ``handle_validation_error``), else ``None``."""
    if getattr(output, "status", None) != "error":
        return None
    content = getattr(output, "content", "")
    return content if isinstance(content, str) else str(content)
