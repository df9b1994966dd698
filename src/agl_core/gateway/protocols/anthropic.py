"""The Anthropic Messages API as a front door: ``POST /v1/messages`` (and ``/v1/messages/count_tokens``).

A Messages request is validated here and becomes the gateway's one internal :class:`ChatRequest`:

* ``system`` (a string or text blocks) becomes the first, system, message;
* ``user`` / ``assistant`` messages keep their role; their ``text`` blocks are joined into the content,
  an assistant's ``tool_use`` blocks become OpenAI-style ``tool_calls`` (``id`` kept, ``arguments`` the
  JSON of ``input``), a user's ``tool_result`` blocks become ``tool`` messages (``tool_call_id`` =
  ``tool_use_id``), placed before the user's own text, as Anthropic requires tool results to come first;
  ``thinking`` / ``redacted_thinking`` blocks are dropped; any other block (``image``, ``document``,
  server-tool blocks) is refused with a 400 naming its type, and so are messages ending with an
  assistant turn (a prefill: the policy would answer a new turn, not continue that one);
* client ``tools`` (``name``, ``description``, ``input_schema``) become function tools, validated like
  Chat Completions tools; a server tool (a ``type`` such as ``web_search_20250305``) is refused;
* ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` become ``auto`` / ``required`` / the named
  function / ``none``; ``stop_sequences``, ``temperature``, ``top_p`` and ``max_tokens`` are passed on.
  ``top_k``, ``metadata``, ``thinking``, ``disable_parallel_tool_use`` and ``is_error`` are accepted and
  not applied.

The answer is a ``message``: a ``text`` block (when the model wrote text), then one ``tool_use`` block per
tool call, under the id the backend gave the call (the id agl's credit assignment joins tool spans by).
A call whose arguments are not a JSON object still gets a valid block: its ``input`` is
``{"agl_invalid_arguments": "<the arguments as the model wrote them>"}`` (:data:`INVALID_ARGUMENTS_KEY`);
the gateway's span of the call marks it malformed. Streamed, the answer is Anthropic's event sequence
(``message_start``, ``content_block_*``, ``message_delta``, ``message_stop``); text streams as it is
generated, each ``tool_use`` block is sent whole when its call is complete (its input must parse).

Errors have Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, with the type that
goes with the status (:func:`error_type`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import pydantic
from starlette.responses import JSONResponse, Response

from .._door import CallView, DoorError, FrontDoor, session_hint, sse, token_usage
from .._schema import RequestError, _Function, check_tool_count, check_tools
from ..backend import ChatRequest, ChoiceDelta, Completion, ToolChoice

__all__ = [
    "INVALID_ARGUMENTS_KEY",
    "CountTokensDoor",
    "MessagesDoor",
    "MessagesIn",
    "error_type",
    "parse_messages",
    "stop_reason",
]

#: Key of the ``input`` of a ``tool_use`` block whose call's arguments are not a JSON object; its value
#: is the arguments text as the model wrote it.
INVALID_ARGUMENTS_KEY = "agl_invalid_arguments"

_MAX_STOP = 16
_DROPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status (``invalid_request_error`` for other 4xx,
    ``api_error`` for other 5xx)."""
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


# -- the request ---------------------------------------------------------------------------------------


def _blocks_or_text(value: Any) -> Any:
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(b, dict) for b in value)):
        return value
    raise ValueError("must be a string or a list of content blocks (objects with a 'type')")


class _MessageIn(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: Any

    @pydantic.field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> Any:
        return _blocks_or_text(value)


class MessagesIn(pydantic.BaseModel):
    """A ``POST /v1/messages`` body. Unknown fields are accepted and ignored; the structure of blocks,
    tools and ``tool_choice`` is checked by :func:`parse_messages`."""

    model_config = pydantic.ConfigDict(extra="allow")
    model: str = pydantic.Field(min_length=1)
    max_tokens: int = pydantic.Field(ge=1)
    messages: list[_MessageIn] = pydantic.Field(min_length=1)
    system: Any = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = pydantic.Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = pydantic.Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = pydantic.Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    stream: bool = False
    thinking: dict[str, Any] | None = None

    @pydantic.field_validator("system")
    @classmethod
    def _system(cls, value: Any) -> Any:
        return value if value is None else _blocks_or_text(value)


def _refuse_block(kind: Any, where: str) -> RequestError:
    if kind == "tool_use":
        return RequestError(f"{where}: a tool_use block belongs in an assistant message", where)
    if kind == "tool_result":
        return RequestError(f"{where}: a tool_result block belongs in a user message", where)
    if kind in ("image", "document", "search_result"):
        why = "the policy behind this gateway reads text only"
    else:
        why = "this gateway serves text, tool_use, tool_result and thinking blocks"
    return RequestError(f"{where}: content blocks of type {kind!r} are not supported: {why}", where)


def _text(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise RequestError(f"{where}.text must be a string", f"{where}.text")
    return text


def _texts(blocks: Sequence[Mapping[str, Any]], where: str) -> str:
    """The joined text of ``blocks``, which must all be text blocks."""
    out = []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind != "text":
            raise _refuse_block(kind, f"{where}.{j}")
        out.append(_text(block, f"{where}.{j}"))
    return "".join(out)


def _as_blocks(content: str | list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not content:
        raise RequestError(f"{where} must not be an empty list of blocks", where)
    return content


def _assistant(content: str | list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(_as_blocks(content, where)):
        at = f"{where}.{j}"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not call_id:
                raise RequestError(f"{at}.id must be a non-empty string", f"{at}.id")
            if not isinstance(name, str) or not name:
                raise RequestError(f"{at}.name must be a non-empty string", f"{at}.name")
            if not isinstance(arguments, dict):
                raise RequestError(f"{at}.input must be an object", f"{at}.input")
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
                }
            )
        elif kind not in _DROPPED_BLOCKS:
            raise _refuse_block(kind, at)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(content: str | list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(_as_blocks(content, where)):
        at = f"{where}.{j}"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise RequestError(f"{at}.tool_use_id must be a non-empty string", f"{at}.tool_use_id")
            output = block.get("content", "")
            if isinstance(output, list) and all(isinstance(b, dict) for b in output):
                output = _texts(output, f"{at}.content")
            elif not isinstance(output, str):
                raise RequestError(f"{at}.content must be a string or a list of text blocks", f"{at}.content")
            if not isinstance(block.get("is_error", False), bool):
                raise RequestError(f"{at}.is_error must be true or false", f"{at}.is_error")
            results.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind not in _DROPPED_BLOCKS:
            raise _refuse_block(kind, at)
    if texts or not results:
        results.append({"role": "user", "content": "".join(texts)})
    return results


def _system(system: Any) -> str | None:
    if system is None:
        return None
    text = system if isinstance(system, str) else _texts(system, "system")
    return text or None


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    check_tool_count(len(tools))
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise RequestError(
                f"tools.{i}: tools of type {kind!r} are Anthropic server tools, which this gateway does "
                "not run; offer client tools (name, description, input_schema) and run them yourself",
                f"tools.{i}.type",
            )
        if "input_schema" not in tool:
            raise RequestError(f"tools.{i}.input_schema: Field required", f"tools.{i}.input_schema")
        try:
            function = _Function.model_validate(
                {
                    "name": tool.get("name"),
                    "description": tool.get("description"),
                    "parameters": tool["input_schema"],
                }
            )
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            field = {"parameters": "input_schema"}.get(str(err["loc"][0]), str(err["loc"][0]))
            message = str(err["msg"]).removeprefix("Value error, ").replace("parameters", "input_schema")
            raise RequestError(f"tools.{i}.{field}: {message}", f"tools.{i}.{field}") from None
        out.append({"type": "function", "function": function.model_dump(exclude_none=True)})
    check_tools([t["function"]["name"] for t in out], "tool")
    return out


def _tool_choice(choice: dict[str, Any] | None, names: Sequence[str]) -> ToolChoice | None:
    if choice is None:
        return None
    if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
        raise RequestError(
            "tool_choice.disable_parallel_tool_use must be true or false",
            "tool_choice.disable_parallel_tool_use",
        )
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return "auto" if kind == "auto" else "none"
    if kind not in ("any", "tool"):
        raise RequestError('tool_choice.type must be "auto", "any", "tool" or "none"', "tool_choice.type")
    if not names:
        raise RequestError(f'tool_choice "{kind}" needs at least one tool in "tools"', "tool_choice")
    if kind == "any":
        return "required"
    name = choice.get("name")
    if name not in names:
        raise RequestError(
            f"tool_choice names tool {name!r}, which is not among the request's tools", "tool_choice.name"
        )
    return {"type": "function", "function": {"name": name}}


def parse_messages(raw: bytes) -> tuple[MessagesIn, ChatRequest]:
    """Validate a ``/v1/messages`` body into the internal request (see the module docstring).

    Raises ``pydantic.ValidationError`` or :class:`~agl_core.gateway._schema.RequestError`."""
    body = MessagesIn.model_validate_json(raw)
    messages: list[dict[str, Any]] = []
    system = _system(body.system)
    if system is not None:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        where = f"messages.{i}.content"
        if message.role == "assistant":
            messages.append(_assistant(message.content, where))
        else:
            messages.extend(_user(message.content, where))
    if body.messages[-1].role == "assistant":
        raise RequestError(
            "the last message is an assistant turn: continuing a prefilled assistant turn is not "
            "supported here; end the messages with a user turn",
            f"messages.{len(body.messages) - 1}.role",
        )
    tools = _tools(body.tools)
    names = [t["function"]["name"] for t in tools or ()]
    stops = [s for s in body.stop_sequences or () if s]
    if len(stops) > _MAX_STOP:
        raise RequestError(
            f"at most {_MAX_STOP} stop sequences are supported, got {len(stops)}", "stop_sequences"
        )
    request = ChatRequest(
        messages=messages,
        max_tokens=body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop=tuple(stops),
        tools=tools,
        tool_choice=_tool_choice(body.tool_choice, names),
        stream=body.stream,
    )
    return body, request


# -- the response --------------------------------------------------------------------------------------


def _matched_stop(result: Completion, stops: Sequence[str]) -> str | None:
    """The stop sequence that ended ``result``: the first of ``stops`` in its response tokens' text
    (backends keep a stop string's tokens in the response, and cut it from the text shown)."""
    generated = "".join(result.response_tokens)
    found = [(generated.find(s), -len(s), s) for s in stops if s and s in generated]
    return min(found)[2] if found else None


def stop_reason(result: Completion | None, stops: Sequence[str]) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished choice: ``max_tokens`` when it ran out of tokens,
    ``tool_use`` when it called tools, ``stop_sequence`` (naming it) when one of ``stops`` ended it, else
    ``end_turn``."""
    if result is None:
        return "end_turn", None
    if result.finish_reason == "length":
        return "max_tokens", None
    if result.tool_calls:
        return "tool_use", None
    if result.finish_reason == "content_filter":
        return "refusal", None
    matched = _matched_stop(result, stops) if result.finish_reason == "stop" and stops else None
    return ("stop_sequence", matched) if matched is not None else ("end_turn", None)


def _tool_input(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, Mapping):
        return dict(arguments)
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    return dict(parsed) if isinstance(parsed, dict) else {INVALID_ARGUMENTS_KEY: raw}


def _tool_use(call: Mapping[str, Any], fallback_id: str) -> dict[str, Any]:
    function = call.get("function")
    function = function if isinstance(function, Mapping) else {}
    return {
        "type": "tool_use",
        "id": str(call.get("id") or fallback_id),
        "name": str(function.get("name") or ""),
        "input": _tool_input(function.get("arguments", "{}")),
    }


def _usage(call: CallView) -> dict[str, int]:
    prompt, output = token_usage(call)
    return {
        "input_tokens": prompt,
        "output_tokens": output,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


class MessagesDoor(FrontDoor):
    """``POST /v1/messages``: Anthropic's Messages API (see the module docstring)."""

    endpoint = "messages"
    id_prefix = "msg_"

    def __init__(self) -> None:
        self._started = False
        self._open_text: int | None = None
        self._blocks = 0

    def parse(self, raw: bytes) -> tuple[str, ChatRequest]:
        body, chat = parse_messages(raw)
        # metadata.user_id names the end user (Anthropic's only metadata field), not a session
        user = body.metadata.get("user_id") if body.metadata else None
        self.session_hint = session_hint(body.metadata, user, "metadata.user_id")
        return body.model, chat

    def error(
        self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None
    ) -> Response:
        """Anthropic's error shape; its ``error.type`` follows the status (``kind`` is OpenAI's)."""
        body = {"type": "error", "error": {"type": error_type(status), "message": message}}
        return JSONResponse(body, status_code=status)

    def invalid(self, exc: pydantic.ValidationError) -> Response:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        text = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "json_invalid":
            message = f"the body is not valid JSON: {text}"
        elif not where:
            message = f"the body must be a JSON object: {text}"
        else:
            message = f"{where}: {text}"
        return self.error(400, message, "invalid_request_error")

    def _tool_uses(self, call: CallView, result: Completion) -> list[dict[str, Any]]:
        return [
            _tool_use(c, f"toolu_{call.id.removeprefix(self.id_prefix)}_{i}")
            for i, c in enumerate(result.tool_calls)
        ]

    def response(self, call: CallView) -> dict[str, Any]:
        result = call.completions[0] if call.completions else None
        content: list[dict[str, Any]] = []
        if result is not None and result.text:
            content.append({"type": "text", "text": result.text})
        if result is not None:
            content.extend(self._tool_uses(call, result))
        reason, sequence = stop_reason(result, call.chat.stop)
        return {
            "id": call.id,
            "type": "message",
            "role": "assistant",
            "model": call.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage(call),
        }

    # -- streaming ----------------------------------------------------------------------------------------
    # message_start goes out with the first content (or at the end), so that its usage carries the prompt's
    # token count whenever the backend reported it by then; message_delta always carries both counts.

    def _start(self, call: CallView) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        usage = _usage(call)
        usage["output_tokens"] = 0
        message: dict[str, Any] = {
            "id": call.id,
            "type": "message",
            "role": "assistant",
            "model": call.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return [sse({"type": "message_start", "message": message}, "message_start")]

    def _block(self, block: dict[str, Any]) -> tuple[int, bytes]:
        index, self._blocks = self._blocks, self._blocks + 1
        event = {"type": "content_block_start", "index": index, "content_block": block}
        return index, sse(event, "content_block_start")

    @staticmethod
    def _block_stop(index: int) -> bytes:
        return sse({"type": "content_block_stop", "index": index}, "content_block_stop")

    def stream_delta(self, call: CallView, delta: ChoiceDelta) -> list[bytes]:
        # Tool-call pieces are not forwarded: each tool_use block goes whole at the choice's end.
        out = self._start(call)
        if delta.text:
            if self._open_text is None:
                self._open_text, opening = self._block({"type": "text", "text": ""})
                out.append(opening)
            text = {"type": "text_delta", "text": delta.text}
            out.append(
                sse(
                    {"type": "content_block_delta", "index": self._open_text, "delta": text},
                    "content_block_delta",
                )
            )
        return out

    def stream_choice_end(self, call: CallView, result: Completion) -> list[bytes]:
        out = self._start(call)
        if self._open_text is not None:
            out.append(self._block_stop(self._open_text))
            self._open_text = None
        for block in self._tool_uses(call, result):
            index, opening = self._block({**block, "input": {}})
            arguments = {
                "type": "input_json_delta",
                "partial_json": json.dumps(block["input"], ensure_ascii=False),
            }
            out.append(opening)
            out.append(
                sse(
                    {"type": "content_block_delta", "index": index, "delta": arguments}, "content_block_delta"
                )
            )
            out.append(self._block_stop(index))
        return out

    def stream_end(self, call: CallView) -> list[bytes]:
        out = self._start(call)
        if self._open_text is not None:  # a choice that never ended (no Completion came)
            out.append(self._block_stop(self._open_text))
            self._open_text = None
        result = call.completions[0] if call.completions else None
        reason, sequence = stop_reason(result, call.chat.stop)
        usage = _usage(call)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        out.append(sse({"type": "message_delta", "delta": delta, "usage": usage}, "message_delta"))
        out.append(sse({"type": "message_stop"}, "message_stop"))
        return out

    def stream_error(self, call: CallView, status: int, message: str, kind: str) -> list[bytes]:
        return [sse({"type": "error", "error": {"type": error_type(status), "message": message}}, "error")]


class CountTokensDoor(MessagesDoor):
    """``POST /v1/messages/count_tokens``: refused with a 501. A backend counts a prompt's tokens only by
    serving it; a message's ``usage.input_tokens`` is that count, exact."""

    endpoint = "count_tokens"

    def parse(self, raw: bytes) -> tuple[str, ChatRequest]:
        raise DoorError(
            501,
            "counting tokens is not served by this gateway (its backends count a prompt only by generating "
            "from it); the usage.input_tokens of a message is the exact count of its prompt",
            kind="api_error",
        )

    def error(
        self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None
    ) -> Response:
        response = super().error(status, message, kind, param, code)
        if status == 501:
            response.headers["x-should-retry"] = "false"  # the Anthropic SDK retries 5xx otherwise
        return response
