"""The OpenAI Responses API, ``POST /v1/responses``, as a front door of the gateway.

The request side is :mod:`agl_core.gateway.protocols._responses_in`. The answer is a ``response`` object, or
its stream of server-sent events (``response.created``, ``response.in_progress``, the output items with their
deltas, then ``response.completed``, ``response.incomplete`` when the policy hit ``max_output_tokens``, or
``response.failed`` when the backend failed). Its output is a ``message`` item when the policy wrote text (or
nothing at all), then one ``function_call`` item per tool call, whose ``call_id`` is the backend's tool call
id: the id the gateway's span records, which tool spans are matched by. The streamed items end equal to the
non-streamed ones.

``previous_response_id`` continues a response this gateway served, from its :class:`ResponseLog`.
"""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ...tracing import RolloutContext
from .._door import CallView, FrontDoor, logprob_entries, session_hint, sse, token_usage, trim_top
from ..backend import ChatRequest, ChoiceDelta, Completion
from ._responses_in import Messages, ResponsesIn, ResponsesRequest, parse_responses

__all__ = ["ResponseLog", "ResponsesDoor"]

#: The rollout attempt a response was served to: ``(rollout id, attempt id)``; ``(None, None)`` for none.
Scope = tuple[str | None, str | None]
#: Bytes of conversation a :class:`ResponseLog` keeps by default.
DEFAULT_LOG_BYTES = 256 * 1024 * 1024


class ResponseLog:
    """The conversations of the responses a gateway served, for ``previous_response_id``; in memory.

    An entry holds the internal messages a response continued (its instructions excluded, as the Responses
    API does not carry them over) followed by the assistant turn it produced. Entries are kept per rollout
    attempt: a response id is found only by a request attributed to the same rollout and attempt (or, for
    a response attributed to none, by a request attributed to none). At most ``capacity`` entries and
    ``max_bytes`` bytes of conversation (as UTF-8 JSON) are kept; the least recently used go first, and a
    conversation over ``max_bytes`` on its own is not kept (continuing it is answered as an unknown
    ``previous_response_id``). Thread-safe (requests may be parsed off the event loop).
    """

    def __init__(self, capacity: int = 4096, *, max_bytes: int = DEFAULT_LOG_BYTES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[tuple[Scope, str], tuple[Messages, int]] = (
            collections.OrderedDict()
        )
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """Bytes of the conversations kept (UTF-8 JSON)."""
        return self._bytes

    def get(self, scope: Scope, response_id: str) -> Messages | None:
        """The conversation of ``response_id`` as served to ``scope``, or ``None``."""
        key = (scope, response_id)
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            return found[0]

    def put(self, scope: Scope, response_id: str, conversation: Messages) -> None:
        size = len(json.dumps(list(conversation), ensure_ascii=False, default=str).encode("utf-8"))
        key = (scope, response_id)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if size > self.max_bytes:
                return
            self._entries[key] = (conversation, size)
            self._bytes += size
            while len(self._entries) > self.capacity or self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped


def _assistant_turn(result: Completion) -> dict[str, Any]:
    """A choice as the internal assistant message (what the next prompt renders)."""
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.tool_calls:
        message["tool_calls"] = [dict(c) for c in result.tool_calls]
    return message


def _text_part(text: str, logprobs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def _message_item(status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": f"fc_{uuid.uuid4().hex}",
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _function(call: Mapping[str, Any]) -> tuple[str, str, str]:
    """``(call id, name, arguments)`` of an OpenAI-shaped tool call (or tool-call delta)."""
    fn = call.get("function") or {}
    arguments = fn.get("arguments")
    return (
        str(call.get("id") or ""),
        str(fn.get("name") or ""),
        arguments if isinstance(arguments, str) else "",
    )


def _status(result: Completion) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


def _text_format(body: ResponsesIn) -> dict[str, Any]:
    """The ``text.format`` the request asked for, echoed back as given (``{"type": "text"}`` by default)."""
    if body.text is None or body.text.format is None:
        return {"type": "text"}
    return body.text.format.model_dump(exclude_none=True)


class ResponsesDoor(FrontDoor):
    """``POST /v1/responses`` (one instance per request; ``log`` is the gateway's)."""

    endpoint = "responses"
    id_prefix = "resp_"
    prompt_param = "input"

    def __init__(self, log: ResponseLog) -> None:
        self.log = log
        self.scope: Scope = (None, None)
        self.parsed: ResponsesRequest | None = None
        # the stream: events are numbered; output items in the order they were announced
        self._sequence = 0
        self._items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None
        self._streamed_text: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}

    def bind(self, rollout: RolloutContext | None) -> None:
        self.scope = (rollout.rollout_id, rollout.attempt_id) if rollout is not None else (None, None)

    def parse(self, raw: bytes) -> tuple[str, ChatRequest]:
        self.parsed = parse_responses(raw, lambda response_id: self.log.get(self.scope, response_id))
        self.session_hint = session_hint(self.parsed.body.metadata, self.parsed.body.user)
        return self.parsed.body.model, self.parsed.chat

    def recorded(self, call: CallView) -> None:
        parsed = self.parsed
        if parsed is None or parsed.body.store is False:
            return
        self.log.put(self.scope, call.id, (*parsed.conversation, _assistant_turn(call.completions[0])))

    # -- the response object ------------------------------------------------------------------------

    def _response(
        self,
        call: CallView,
        status: str,
        output: list[dict[str, Any]],
        *,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        parsed = self.parsed
        if parsed is None:  # the gateway shapes answers only to requests that parsed
            raise RuntimeError("ResponsesDoor: a response is shaped before its request was parsed")
        body, chat = parsed.body, call.chat
        finished = status in ("completed", "incomplete")
        usage = None
        if finished:
            prompt, completion = token_usage(call)
            usage = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            }
        return {
            "id": call.id,
            "object": "response",
            "created_at": call.created,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": call.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": None,
            "store": body.store is not False,
            "temperature": chat.temperature,
            "text": {"format": _text_format(body)},
            "tool_choice": parsed.tool_choice,
            "tools": list(parsed.tools),
            "top_logprobs": body.top_logprobs,
            "top_p": chat.top_p,
            "truncation": body.truncation or "disabled",
            "usage": usage,
            "user": body.user,
        }

    def _no_output(self, call: CallView) -> dict[str, Any]:
        error = {"code": "server_error", "message": "the backend returned no output"}
        return self._response(call, "failed", [], error=error)

    def _logprobs(self, call: CallView, result: Completion) -> list[dict[str, Any]]:
        return logprob_entries(result, call.chat.top_logprobs) if call.chat.logprobs else []

    def response(self, call: CallView) -> dict[str, Any]:
        if not call.completions:
            return self._no_output(call)
        result = call.completions[0]
        status = _status(result)
        output = []
        if result.text or not result.tool_calls:
            part = _text_part(result.text or "", self._logprobs(call, result))
            output.append(_message_item(status, [part]))
        for tool_call in result.tool_calls:
            output.append(_call_item(*_function(tool_call), status="completed"))
        return self._response(call, status, output)

    # -- streaming ----------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        return sse(payload, kind)

    def _event_json(self, kind: str, fields: str) -> bytes:
        """An event whose fields are JSON already (``"key":value,...``, values escaped by the caller).

        The hot events (a text delta per token, the response snapshots) are built this way: formatting a
        string costs a fraction of encoding a dict, and a streamed response sends a dozen events more
        than a streamed chat completion."""
        data = f'{{"type":"{kind}",{fields},"sequence_number":{self._sequence}}}'
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + data.encode() + b"\n\n"

    def _announce(self, item: dict[str, Any]) -> bytes:
        self._items.append(item)
        shown = {**item, "content": []} if item["type"] == "message" else dict(item)
        return self._event("response.output_item.added", output_index=len(self._items) - 1, item=shown)

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._items.index(item)}

    def _open_message(self) -> list[bytes]:
        if self._message is not None:
            return []
        self._message = _message_item("in_progress", [])
        return [
            self._announce(self._message),
            self._event(
                "response.content_part.added",
                **self._at(self._message),
                content_index=0,
                part=_text_part("", []),
            ),
        ]

    def _text_delta(self, text: str, logprobs: Sequence[Mapping[str, Any]]) -> list[bytes]:
        out = self._open_message()
        assert self._message is not None
        self._streamed_text.append(text)
        # item ids are the gateway's own (msg_ + hex): nothing in them needs escaping
        out.append(
            self._event_json(
                "response.output_text.delta",
                f'"item_id":"{self._message["id"]}","output_index":{self._items.index(self._message)},'
                f'"content_index":0,"delta":{json.dumps(text, ensure_ascii=False)},'
                f'"logprobs":{json.dumps(list(logprobs), ensure_ascii=False) if logprobs else "[]"}',
            )
        )
        return out

    def _call_delta(self, piece: Mapping[str, Any], position: int) -> list[bytes]:
        index = piece.get("index", position)
        index = index if isinstance(index, int) else position
        call_id, name, arguments = _function(piece)
        out = []
        item = self._calls.get(index)
        if item is None:
            item = self._calls[index] = _call_item(call_id, name, "", "in_progress")
            out.append(self._announce(item))
        if arguments:
            item["arguments"] += arguments
            out.append(
                self._event("response.function_call_arguments.delta", **self._at(item), delta=arguments)
            )
        return out

    def stream_start(self, call: CallView) -> list[bytes]:
        snapshot = json.dumps(self._response(call, "in_progress", []), ensure_ascii=False)
        return [
            self._event_json("response.created", f'"response":{snapshot}'),
            self._event_json("response.in_progress", f'"response":{snapshot}'),
        ]

    def stream_delta(self, call: CallView, delta: ChoiceDelta) -> list[bytes]:
        out = []
        if delta.text:
            logprobs = trim_top(delta.logprobs, call.chat.top_logprobs) if call.chat.logprobs else []
            out += self._text_delta(delta.text, logprobs)
        for position, piece in enumerate(delta.tool_calls):
            out += self._call_delta(piece, position)
        return out

    def stream_choice_end(self, call: CallView, result: Completion) -> list[bytes]:
        """Close the streamed items with the choice's final values (those of the non-streamed answer)."""
        status = _status(result)
        out = []
        text = result.text or ""
        if self._message is not None or text or not result.tool_calls:
            streamed = "".join(self._streamed_text)
            if text != streamed and text.startswith(streamed):  # what the backend did not stream
                out += self._text_delta(text[len(streamed) :], [])
            out += self._open_message()
            message = self._message
            assert message is not None
            part = _text_part(text, self._logprobs(call, result))
            at = self._at(message)
            out.append(
                self._event(
                    "response.output_text.done", **at, content_index=0, text=text, logprobs=part["logprobs"]
                )
            )
            out.append(self._event("response.content_part.done", **at, content_index=0, part=part))
            message.update(status=status, content=[part])
            out.append(
                self._event("response.output_item.done", output_index=at["output_index"], item=message)
            )
        for index, tool_call in enumerate(result.tool_calls):
            call_id, name, arguments = _function(tool_call)
            item = self._calls.get(index)
            if item is None:
                item = self._calls[index] = _call_item(call_id, name, "", "in_progress")
                out.append(self._announce(item))
            if not item["arguments"] and arguments:
                out.append(
                    self._event("response.function_call_arguments.delta", **self._at(item), delta=arguments)
                )
            item.update(call_id=call_id, name=name, arguments=arguments, status="completed")
            at = self._at(item)
            out.append(self._event("response.function_call_arguments.done", **at, arguments=arguments))
            out.append(
                self._event("response.output_item.done", output_index=at["output_index"], item=dict(item))
            )
        for index, item in self._calls.items():
            if index >= len(result.tool_calls):  # streamed, but not a call of the final answer
                item["status"] = "incomplete"
                out.append(
                    self._event(
                        "response.output_item.done", output_index=self._at(item)["output_index"], item=item
                    )
                )
        return out

    def stream_end(self, call: CallView) -> list[bytes]:
        if not call.completions:
            return [self._event("response.failed", response=self._no_output(call))]
        status = _status(call.completions[0])
        body = self._response(call, status, list(self._items))
        return [self._event(f"response.{status}", response=body)]

    def stream_error(self, call: CallView, status: int, message: str, kind: str) -> list[bytes]:
        error = {"code": "server_error" if status >= 500 else "invalid_prompt", "message": message}
        body = self._response(call, "failed", list(self._items), error=error)
        return [self._event("response.failed", response=body)]
