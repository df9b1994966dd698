"""Validation of OpenAI Responses API bodies (``POST /v1/responses``): pydantic in, a frozen
:class:`ResponsesRequest` holding the one internal :class:`~agl_core.gateway.backend.ChatRequest` out.

``instructions`` become the first system message; message items (roles ``user``, ``system``,
``developer``, ``assistant``; text parts) messages; ``function_call`` items the ``tool_calls`` of an
assistant turn (consecutive calls, and the assistant text right before them, make one turn, as the policy
wrote them in one answer); ``function_call_output`` items ``tool`` messages; ``reasoning`` items are
dropped. Function tools get the same checks as on ``/v1/chat/completions``.

What cannot be served is refused (:class:`~agl_core.gateway._schema.RequestError`, a 400) with a message
naming it: OpenAI's built-in tools, image / file / audio input, stored conversations, prompt templates,
background responses, ``n`` other than 1, and a ``previous_response_id`` the caller's history does not
hold. Structured output (``text.format`` ``json_schema`` / ``json_object``) is served unconstrained, as
Chat Completions' ``response_format`` is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import pydantic

from .._schema import RequestError, _Function, check_tool_count, check_tools
from ..backend import ChatRequest

__all__ = ["Messages", "ResponsesIn", "ResponsesRequest", "parse_responses"]

#: A conversation as internal (OpenAI-chat) messages.
Messages = tuple[Mapping[str, Any], ...]
_Choice = Literal["none", "auto", "required"]

_LOGPROBS = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")


class _FunctionTool(_Function):
    """A function tool in the Responses shape (flat): ``{"type": "function", "name", "description",
    "parameters", "strict"}``; name and parameters are checked as for Chat Completions."""

    type: Literal["function"]


#: ``text.format`` types. Structured output (``json_schema`` / ``json_object``) is accepted as Chat
#: Completions' ``response_format`` is: nothing constrains the policy's sampling, so an agent asking for
#: JSON (the Agents SDK's ``output_type``) runs, and its reward teaches the format.
_TEXT_FORMATS = ("text", "json_schema", "json_object")


class _TextFormat(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    type: str = "text"


class _Text(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    format: _TextFormat | None = None


class ResponsesIn(pydantic.BaseModel):
    """A ``/v1/responses`` body. Unknown fields are accepted and ignored, as OpenAI's clients send many."""

    model_config = pydantic.ConfigDict(extra="allow")
    model: str = pydantic.Field(min_length=1)
    # Unions are checked by hand: pydantic would name the member type in the error's location.
    input: Any = None
    instructions: str | None = None
    previous_response_id: str | None = pydantic.Field(default=None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    temperature: float | None = pydantic.Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = pydantic.Field(default=None, gt=0.0, le=1.0)
    max_output_tokens: int | None = pydantic.Field(default=None, ge=1)
    top_logprobs: int | None = pydantic.Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool | None = False
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    text: _Text | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    n: int | None = None
    # Refused when set: nothing here can serve them.
    background: bool | None = None
    conversation: Any = None
    prompt: dict[str, Any] | None = None

    @property
    def logprobs(self) -> bool:
        """Whether the client asked to see logprobs."""
        return _LOGPROBS in (self.include or ()) or self.top_logprobs is not None


def _refuse_unserved(body: ResponsesIn) -> None:
    if body.n is not None and body.n != 1:
        raise RequestError(
            f"n must be 1: a response is one answer (got n={body.n}); send several requests", "n"
        )
    if body.background:
        raise RequestError(
            "background responses are not served; send the request without background", "background"
        )
    if body.conversation is not None:
        raise RequestError(
            "conversations are not served: the gateway stores none; send the full input, or continue a"
            " response with previous_response_id",
            "conversation",
        )
    if body.prompt is not None:
        raise RequestError("prompt templates are not served; send instructions and input instead", "prompt")
    kind = body.text.format.type if body.text is not None and body.text.format is not None else "text"
    if kind not in _TEXT_FORMATS:
        raise RequestError(
            f"text.format type {kind!r} is unknown; use one of {', '.join(_TEXT_FORMATS)}", "text.format"
        )


def _text_of(content: Any, where: str) -> str:
    """The text of a message's content: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in (*_TEXT_PARTS, "refusal"):
            raise RequestError(
                f"{where}[{j}]: {kind!r} content parts are not served; the policy reads text only"
                " (input_text / output_text parts)",
                "input",
            )
        key = "refusal" if kind == "refusal" else "text"
        text = part.get(key)
        if not isinstance(text, str):
            raise RequestError(f"{where}[{j}].{key} must be a string", "input")
        texts.append(text)
    return "".join(texts)


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    """``item[key]``, a string (not empty, unless it is the arguments of a call)."""
    value = item.get(key)
    empty_ok = key == "arguments"
    if not isinstance(value, str) or not (value or empty_ok):
        raise RequestError(f"{where}.{key} must be a {'' if empty_ok else 'non-empty '}string", "input")
    return value


def _conversation(items: Sequence[Any], history: Messages) -> list[Mapping[str, Any]]:
    """``history`` continued by the input items, as internal (OpenAI-chat) messages."""
    out: list[Mapping[str, Any]] = list(history)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object (an input item)", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind is None:
            raise RequestError(f"{where} needs a 'type' (or, for a message, a 'role')", "input")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(
                    f"{where}.role must be 'user', 'system', 'developer' or 'assistant', got {role!r}",
                    "input",
                )
            content = _text_of(item.get("content"), f"{where}.content")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            function = {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}
            call = {"id": _string(item, "call_id", where), "type": "function", "function": function}
            last = out[-1] if out else None
            if last is not None and last.get("role") == "assistant":
                # the same turn: text and calls the policy wrote in one answer
                out[-1] = {**last, "tool_calls": [*(last.get("tool_calls") or ()), call]}
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text_of(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output})
        elif kind != "reasoning":
            raise RequestError(
                f"{where}: {kind!r} items are not served; input items are messages, function_call,"
                " function_call_output and reasoning (ignored)",
                "input",
            )
    return out


def _tools(raw: Sequence[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(tools in the internal OpenAI-chat shape, tools as the response echoes them)``."""
    internal: list[dict[str, Any]] = []
    echo: list[dict[str, Any]] = []
    check_tool_count(len(raw))
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise RequestError(
                f"tools[{i}]: {kind!r} tools are not served: built-in tools run on OpenAI's platform, and"
                ' this gateway serves only function tools (type "function") to its policy',
                "tools",
            )
        try:
            fn = _FunctionTool.model_validate(tool)
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise RequestError(f"tools[{i}].{where}: {err['msg']}", "tools") from None
        # The keys a Chat Completions client sends, in its order: the prompt renders tools the same way.
        function = fn.model_dump(include={"name", "description", "parameters", "strict"}, exclude_none=True)
        internal.append({"type": "function", "function": function})
        echo.append({"type": "function", **function})
    check_tools([t["function"]["name"] for t in internal])
    return internal, echo


def _tool_choice(
    choice: Any, names: Sequence[str]
) -> tuple[_Choice | dict[str, Any] | None, _Choice | dict[str, Any]]:
    """``(tool_choice for the backend, tool_choice as the response echoes it)``."""
    if choice is None:
        return None, "auto"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not names:
            raise RequestError('tool_choice "required" needs at least one tool in "tools"', "tool_choice")
        return choice, choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    name = choice.get("name") if isinstance(choice, dict) else None
    if kind != "function" or not isinstance(name, str) or not name:
        served = f"; {kind!r} choices are not served" if kind not in (None, "function") else ""
        raise RequestError(
            f'tool_choice must be "none", "auto", "required" or {{"type": "function", "name": ...}}{served}',
            "tool_choice",
        )
    if name not in names:
        raise RequestError(
            f"tool_choice names function {name!r}, which is not among the request's tools", "tool_choice"
        )
    return {"type": "function", "function": {"name": name}}, {"type": "function", "name": name}


@dataclasses.dataclass(frozen=True)
class ResponsesRequest:
    """A validated ``/v1/responses`` body: what the backend serves and what the response echoes."""

    body: ResponsesIn
    #: The conversation the request continues, as internal messages: the history ``previous_response_id``
    #: names, then the body's input; the instructions are not part of it (the Responses API does not carry
    #: them over to a continuation).
    conversation: Messages
    #: For the backend: the instructions as a system message, then the conversation.
    chat: ChatRequest
    #: ``tools`` and ``tool_choice`` in the Responses shape, as the response echoes them.
    tools: tuple[Mapping[str, Any], ...]
    tool_choice: str | Mapping[str, Any]


def parse_responses(raw: bytes, history: Callable[[str], Messages | None]) -> ResponsesRequest:
    """Validate a ``/v1/responses`` body. ``history(response_id)`` is the conversation a
    ``previous_response_id`` continues (instructions excluded, its output included), ``None`` for one that
    is not known. Raises ``pydantic.ValidationError`` or :class:`RequestError`."""
    body = ResponsesIn.model_validate_json(raw)
    _refuse_unserved(body)
    earlier: Messages = ()
    if body.previous_response_id is not None:
        found = history(body.previous_response_id)
        if found is None:
            raise RequestError(
                f"previous response {body.previous_response_id!r} is not known here (the gateway keeps only"
                " its most recent responses, in memory, each for the rollout attempt it served); send the"
                " full input instead",
                "previous_response_id",
            )
        earlier = found
    if body.input is None or body.input == []:
        raise RequestError("input is required: a string, or a list of input items", "input")
    if not isinstance(body.input, (str, list)):
        raise RequestError("input must be a string, or a list of input items", "input")
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    conversation = _conversation(items, earlier)
    tools, tools_echo = _tools(body.tools) if body.tools else ([], [])
    choice, choice_echo = _tool_choice(body.tool_choice, [t["function"]["name"] for t in tools])
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat = ChatRequest(
        messages=[*system, *conversation],
        max_tokens=body.max_output_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        tools=tools or None,
        tool_choice=choice,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        stream=bool(body.stream),
    )
    return ResponsesRequest(body, tuple(conversation), chat, tuple(tools_echo), choice_echo)
