"""Validation of OpenAI request bodies (the HTTP boundary): pydantic in, frozen :class:`ChatRequest` out."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any, Literal

import pydantic

from .backend import ChatRequest

__all__ = ["ChatIn", "CompletionIn", "RequestError", "parse_chat", "parse_completion"]

_MAX_STOP = 16


class RequestError(ValueError):
    """A request that is valid JSON but not a valid OpenAI request; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


class _Function(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    # what OpenAI accepts: letters, digits, underscores and dashes, at most 64
    name: str = pydantic.Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @pydantic.field_validator("parameters")
    @classmethod
    def _schema_shape(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        """The outer shape of a JSON Schema: its ``type``, ``properties`` and ``required`` (what the
        backend renders into the prompt); deeper validation is the model's business."""
        if schema is None:
            return None
        kind = schema.get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
        if not all(isinstance(k, str) and k in _JSON_TYPES for k in kinds) or (
            isinstance(kind, list) and not kind
        ):
            raise ValueError(f"parameters.type must be one of {sorted(_JSON_TYPES)} (or a list of them)")
        properties = schema.get("properties")
        if properties is not None and not (
            isinstance(properties, dict) and all(isinstance(v, dict | bool) for v in properties.values())
        ):
            raise ValueError("parameters.properties must map each argument name to a JSON Schema object")
        required = schema.get("required")
        if required is not None and not (
            isinstance(required, list) and all(isinstance(r, str) for r in required)
        ):
            raise ValueError("parameters.required must be a list of argument names")
        return schema


class _Tool(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: _Function


class _Message(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def flat(self) -> dict[str, Any]:
        """The message with list-of-parts content joined into one string."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") not in ("text", "input_text", "output_text") or not isinstance(
                    part.get("text"), str
                ):
                    raise RequestError(
                        f"only text content parts are supported, got a {part.get('type')!r} part", "messages"
                    )
                texts.append(part["text"])
            out["content"] = "".join(texts)
        elif self.content is None:
            out["content"] = None if self.tool_calls else ""
        if out["role"] == "developer":
            out["role"] = "system"
        if out["role"] == "tool" and not self.tool_call_id:
            raise RequestError("a message with role 'tool' needs the 'tool_call_id' it answers", "messages")
        return out


class _StreamOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    include_usage: bool = False


class _Common(pydantic.BaseModel):
    # OpenAI clients send many optional fields; unknown ones are accepted and ignored like OpenAI does.
    model_config = pydantic.ConfigDict(extra="allow")
    model: str = pydantic.Field(min_length=1)
    max_tokens: int | None = pydantic.Field(default=None, ge=1)
    temperature: float | None = pydantic.Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = pydantic.Field(default=None, gt=0.0, le=1.0)
    n: int | None = pydantic.Field(default=None, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > _MAX_STOP:
            raise RequestError(f"at most {_MAX_STOP} stop sequences are supported, got {len(stops)}", "stop")
        return tuple(s for s in stops if s)


class ChatIn(_Common):
    messages: list[_Message] = pydantic.Field(min_length=1)
    max_completion_tokens: int | None = pydantic.Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = pydantic.Field(default=None, ge=0, le=20)
    tools: list[_Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None


class CompletionIn(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = pydantic.Field(default=None, ge=0, le=20)
    echo: bool | None = False
    suffix: str | None = None


def _sampling(body: _Common) -> dict[str, Any]:
    return {
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "n": body.n or 1,
        "stop": body.stops(),
        "seed": body.seed,
        "stream": bool(body.stream),
    }


#: The most tools one request may offer (OpenAI's limit: a client written for it never sends more).
MAX_TOOLS = 128


def check_tool_count(count: int) -> None:
    """:class:`RequestError` when a request offers more than :data:`MAX_TOOLS` tools."""
    if count > MAX_TOOLS:
        raise RequestError(f"tools: at most {MAX_TOOLS} tools per request, got {count}", "tools")


def check_tools(names: Sequence[str], word: str = "function") -> None:
    """:class:`RequestError` when there are more than :data:`MAX_TOOLS` tools or a name repeats."""
    check_tool_count(len(names))
    counts = collections.Counter(names)
    repeated = sorted(n for n, c in counts.items() if c > 1)
    if repeated:
        raise RequestError(
            f"tools: each {word} name must be unique; repeated: {', '.join(repeated)}", "tools"
        )


def parse_chat(raw: bytes) -> tuple[ChatIn, ChatRequest]:
    """Validate a ``/v1/chat/completions`` body.

    Raises ``pydantic.ValidationError`` or :class:`RequestError`."""
    body = ChatIn.model_validate_json(raw)
    messages = [m.flat() for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    check_tools([t["function"]["name"] for t in tools or ()])
    choice = body.tool_choice
    if isinstance(choice, dict):
        name = (
            (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        )
        if choice.get("type") != "function" or not name:
            raise RequestError(
                'tool_choice must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise RequestError(
                f"tool_choice names function {name!r}, which is not among the request's tools", "tool_choice"
            )
    elif choice == "required" and not tools:
        raise RequestError('tool_choice "required" needs at least one tool in "tools"', "tool_choice")
    if body.top_logprobs and not body.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    request = ChatRequest(
        messages=messages,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        tools=tools,
        tool_choice=choice,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0,
        **_sampling(body),
    )
    return body, request


def parse_completion(raw: bytes) -> tuple[CompletionIn, ChatRequest]:
    """Validate a ``/v1/completions`` body (one prompt: a string or token ids)."""
    body = CompletionIn.model_validate_json(raw)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise RequestError("one prompt per request is supported; send several requests instead", "prompt")
        prompt = prompt[0]
    if not prompt:
        raise RequestError("prompt must not be empty", "prompt")
    if body.echo or body.suffix:
        raise RequestError("echo and suffix are not supported", "echo" if body.echo else "suffix")
    request = ChatRequest(
        prompt=prompt,  # type: ignore[arg-type]
        max_tokens=body.max_tokens or 16,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
        **_sampling(body),
    )
    return body, request
