"""Front doors: the wire protocols the gateway speaks, each parsed into one :class:`ChatRequest`.

Every protocol (OpenAI Chat Completions and Completions here; the Responses API and Anthropic Messages in
their own modules) is a :class:`FrontDoor`: it validates a request body into the one internal request the
backends serve, and shapes the backend's :class:`Completion` values into that protocol's response body
and server-sent events. Everything between (routing a call to the backend, recording its span with the
exact token ids, metrics, disconnects) is the gateway's and is the same for every door.

A door object lives for one request: :meth:`FrontDoor.parse` may keep what the response needs (for
example whether the client asked for usage in the stream).
"""

from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import pydantic
from starlette.responses import JSONResponse, Response

from .. import semconv
from ._schema import parse_chat, parse_completion
from .backend import ChatRequest, ChoiceDelta, Completion

if TYPE_CHECKING:
    from ..tracing import RolloutContext

__all__ = [
    "CallView",
    "ChatDoor",
    "CompletionDoor",
    "DoorError",
    "FrontDoor",
    "SessionHint",
    "logprob_entries",
    "openai_error",
    "session_hint",
    "sse",
    "token_usage",
    "trim_top",
    "whole_delta",
]


class CallView(Protocol):
    """What a door sees of the call it shapes: identity, request and the finished choices."""

    @property
    def id(self) -> str: ...

    @property
    def created(self) -> int: ...

    @property
    def model(self) -> str: ...

    @property
    def chat(self) -> ChatRequest: ...

    @property
    def completions(self) -> list[Completion]: ...


@dataclasses.dataclass(frozen=True)
class SessionHint:
    """What a request body says about the session it belongs to, as sent: ``(field, value)`` pairs, the
    field named as an error names it (``metadata.session_id``), ``None`` when the body has none.

    ``session`` names a session; ``user`` names a user (several sessions of one user). Values are not
    checked here: only a gateway that captures sessions (:mod:`agl_core.gateway.capture`) reads them."""

    session: tuple[str, Any] | None = None
    user: tuple[str, Any] | None = None


def session_hint(metadata: Any, user: Any, user_field: str = "user") -> SessionHint:
    """The :class:`SessionHint` of a body with this ``metadata`` (its ``session_id`` names the session) and
    this user (``user_field`` says where the body holds it)."""
    session = metadata.get("session_id") if isinstance(metadata, dict) else None
    return SessionHint(
        None if session is None else ("metadata.session_id", session),
        None if user is None else (user_field, user),
    )


def openai_error(
    status: int, message: str, kind: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status
    )


def sse(payload: Mapping[str, Any], event: str | None = None) -> bytes:
    """One server-sent event carrying ``payload`` as JSON (with an ``event:`` line when named)."""
    data = b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"
    return b"event: " + event.encode() + b"\n" + data if event else data


def token_usage(call: CallView) -> tuple[int, int]:
    """``(prompt tokens, completion tokens over all choices)`` of a finished call."""
    prompt = len(call.completions[0].prompt_ids) if call.completions else 0
    return prompt, sum(len(c.response_ids) for c in call.completions)


def logprob_entries(result: Completion, top: int) -> list[dict[str, Any]]:
    """OpenAI ``logprobs.content`` entries of a completion's response tokens."""
    if result.response_logprobs is None:
        return []
    tokens = result.response_tokens or tuple("" for _ in result.response_ids)
    tops = result.top_logprobs or ()
    out = []
    # One token per logprob (the Completion contract), so strict: a backend breaking it fails loudly.
    for i, (tok, lp) in enumerate(zip(tokens, result.response_logprobs, strict=True)):
        alternatives = tops[i][:top] if top and i < len(tops) else ()
        out.append(
            {
                "token": tok,
                "logprob": lp,
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in alternatives
                ],
            }
        )
    return out


def trim_top(entries: Sequence[Mapping[str, Any]], top: int) -> list[Mapping[str, Any]]:
    """Logprob entries with at most ``top`` alternatives each."""
    if all(len(e.get("top_logprobs", ())) <= top for e in entries):
        return list(entries)
    return [{**e, "top_logprobs": list(e["top_logprobs"])[:top]} for e in entries]


def whole_delta(result: Completion, chat: ChatRequest) -> ChoiceDelta:
    """The whole of one choice as a single streamed piece (for backends that do not stream pieces)."""
    calls = tuple({"index": i, **call} for i, call in enumerate(result.tool_calls))
    entries = tuple(logprob_entries(result, chat.top_logprobs)) if chat.logprobs else ()
    return ChoiceDelta(result.index, result.text or "", tool_calls=calls, logprobs=entries)


class FrontDoor(abc.ABC):
    """One wire protocol of the gateway (see the module docstring); one instance per request."""

    #: Label of the endpoint in ``/metrics`` and on spans (``agl.gateway.protocol``).
    endpoint: ClassVar[str]
    #: Prefix of the response ids this protocol hands out (``chatcmpl-``, ``resp_``, ``msg_``).
    id_prefix: ClassVar[str]
    #: ``gen_ai.operation.name`` of its calls.
    operation: ClassVar[str] = semconv.OP_CHAT
    #: Where a context-window error points (the request field holding the prompt).
    prompt_param: ClassVar[str] = "messages"
    #: What the parsed body says about its session (set by :meth:`parse`; none by default).
    session_hint: SessionHint = SessionHint()

    def bind(self, rollout: RolloutContext | None) -> None:  # noqa: B027 - an optional hook
        """Called before :meth:`parse` with the rollout (and attempt) the request is attributed to by its
        URL or headers; ``None`` when it is attributed to none. A door whose requests can refer to earlier
        calls (``previous_response_id``) keeps those references within one rollout attempt with it."""

    @abc.abstractmethod
    def parse(self, raw: bytes) -> tuple[str, ChatRequest]:
        """``(model, request)`` of a body. Raises ``pydantic.ValidationError`` or
        :class:`~agl_core.gateway._schema.RequestError` (400), or :class:`DoorError` for a refusal with a
        status of its own."""

    def error(
        self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None
    ) -> Response:
        """An error response in this protocol's shape. ``kind`` is OpenAI's error type."""
        return openai_error(status, message, kind, param, code)

    def invalid(self, exc: pydantic.ValidationError) -> Response:
        """The 400 answer to a body that failed validation."""
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "json_invalid":
            message = f"the body is not valid JSON: {err['msg']}"
        else:
            message = f"invalid request: {param}: {err['msg']}"
        return self.error(400, message, "invalid_request_error", param)

    @abc.abstractmethod
    def response(self, call: CallView) -> dict[str, Any]:
        """The body of a non-streamed answer (choices sorted by index)."""

    # -- streaming: each hook returns the events to send, in order ------------------------------------

    def stream_start(self, call: CallView) -> list[bytes]:
        return []

    @abc.abstractmethod
    def stream_delta(self, call: CallView, delta: ChoiceDelta) -> list[bytes]: ...

    @abc.abstractmethod
    def stream_choice_end(self, call: CallView, result: Completion) -> list[bytes]: ...

    @abc.abstractmethod
    def stream_end(self, call: CallView) -> list[bytes]:
        """The closing events, sent after the call's spans are recorded."""

    @abc.abstractmethod
    def stream_error(self, call: CallView, status: int, message: str, kind: str) -> list[bytes]:
        """The event(s) telling the client the stream failed (its headers are gone already)."""

    def recorded(self, call: CallView) -> None:  # noqa: B027 - an optional hook
        """Called once the call finished and was recorded (whole, not failed or cut off)."""


class DoorError(Exception):
    """A refusal a door decides itself, with its status (for example 404 for an unknown response id)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.kind = kind


# -- OpenAI Chat Completions and Completions ---------------------------------------------------------


class ChatDoor(FrontDoor):
    """``POST /v1/chat/completions``."""

    endpoint = "chat"
    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def __init__(self) -> None:
        self.include_usage = False

    def parse(self, raw: bytes) -> tuple[str, ChatRequest]:
        body, chat = parse_chat(raw)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.session_hint = _extra_hint(body.model_extra)
        return body.model, chat

    def usage(self, call: CallView) -> dict[str, int]:
        prompt, completion = token_usage(call)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def envelope(self, call: CallView, name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": call.id,
            "object": name,
            "created": call.created,
            "model": call.model,
            "choices": choices,
        }

    def response(self, call: CallView) -> dict[str, Any]:
        out = self.envelope(call, self.object_name, [self.choice(call, c) for c in call.completions])
        out["usage"] = self.usage(call)
        return out

    def choice(self, call: CallView, result: Completion) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        if result.tool_calls:
            message["tool_calls"] = [dict(c) for c in result.tool_calls]
        logprobs = (
            {"content": logprob_entries(result, call.chat.top_logprobs)} if call.chat.logprobs else None
        )
        return {
            "index": result.index,
            "message": message,
            "finish_reason": result.finish_reason,
            "logprobs": logprobs,
        }

    def chunk(self, call: CallView, choices: list[dict[str, Any]]) -> bytes:
        out = self.envelope(call, self.chunk_name, choices)
        if self.include_usage:
            out["usage"] = None
        return sse(out)

    def opening(self, call: CallView, index: int) -> dict[str, Any] | None:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def stream_start(self, call: CallView) -> list[bytes]:
        openings = (self.opening(call, index) for index in range(call.chat.n))
        return [self.chunk(call, [o]) for o in openings if o is not None]

    def delta(self, call: CallView, event: ChoiceDelta) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if event.text:
            delta["content"] = event.text
        if event.tool_calls:
            delta["tool_calls"] = [dict(c) for c in event.tool_calls]
        logprobs = (
            {"content": trim_top(event.logprobs, call.chat.top_logprobs)}
            if call.chat.logprobs and event.logprobs
            else None
        )
        return {"index": event.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}

    def stream_delta(self, call: CallView, delta: ChoiceDelta) -> list[bytes]:
        return [self.chunk(call, [self.delta(call, delta)])]

    def closing(self, call: CallView, result: Completion) -> dict[str, Any]:
        return {"index": result.index, "delta": {}, "logprobs": None, "finish_reason": result.finish_reason}

    def stream_choice_end(self, call: CallView, result: Completion) -> list[bytes]:
        return [self.chunk(call, [self.closing(call, result)])]

    def stream_end(self, call: CallView) -> list[bytes]:
        out = []
        if self.include_usage:
            usage = self.envelope(call, self.chunk_name, [])
            usage["usage"] = self.usage(call)
            out.append(sse(usage))
        out.append(b"data: [DONE]\n\n")
        return out

    def stream_error(self, call: CallView, status: int, message: str, kind: str) -> list[bytes]:
        # As OpenAI-compatible servers do: the error travels as a data event.
        return [sse({"error": {"message": message, "type": kind, "param": None, "code": status}})]


def _extra_hint(extra: dict[str, Any] | None) -> SessionHint:
    # metadata and user are not fields of the Chat Completions schema here: they arrive as extras
    extra = extra or {}
    return session_hint(extra.get("metadata"), extra.get("user"))


def _text_logprobs(entries: Sequence[Mapping[str, Any]], offset: int = 0) -> dict[str, Any]:
    tokens = [e["token"] for e in entries]
    offsets, at = [], offset
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs", [])} for e in entries],
        "text_offset": offsets,
    }


class CompletionDoor(ChatDoor):
    """``POST /v1/completions`` (one prompt: a string or token ids)."""

    endpoint = "completions"
    id_prefix = "cmpl-"
    operation = semconv.OP_TEXT_COMPLETION
    prompt_param = "prompt"
    object_name = chunk_name = "text_completion"

    def parse(self, raw: bytes) -> tuple[str, ChatRequest]:
        body, chat = parse_completion(raw)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.session_hint = _extra_hint(body.model_extra)
        return body.model, chat

    def choice(self, call: CallView, result: Completion) -> dict[str, Any]:
        logprobs = (
            _text_logprobs(logprob_entries(result, call.chat.top_logprobs)) if call.chat.logprobs else None
        )
        return {
            "index": result.index,
            "text": result.text or "",
            "logprobs": logprobs,
            "finish_reason": result.finish_reason,
        }

    def opening(self, call: CallView, index: int) -> dict[str, Any] | None:
        return None

    def delta(self, call: CallView, event: ChoiceDelta) -> dict[str, Any]:
        logprobs = (
            _text_logprobs(trim_top(event.logprobs, call.chat.top_logprobs))
            if call.chat.logprobs and event.logprobs
            else None
        )
        return {"index": event.index, "text": event.text, "logprobs": logprobs, "finish_reason": None}

    def closing(self, call: CallView, result: Completion) -> dict[str, Any]:
        return {"index": result.index, "text": "", "logprobs": None, "finish_reason": result.finish_reason}
