"""Backends that forward to an OpenAI-compatible HTTP server (pure HTTP, on asyncio streams: see ``_http``).

:class:`OpenAIBackend` talks to any such server, for evaluation: it cannot see token ids, so its calls are
marked as not trainable. :class:`~agl_core.gateway.vllm_backend.VLLMBackend` builds on it with vLLM's
token-id extensions.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from ._http import ConnectFailed, HTTPFailure, Pool, Response, TimedOut
from .backend import (
    BackendError,
    BackendUnavailableError,
    ChatRequest,
    ChoiceDelta,
    Completion,
    ContextTooLongError,
    Event,
    UpstreamError,
)

__all__ = ["OpenAIBackend"]

_CONTEXT = re.compile(
    r"maximum context length is (\d+) tokens.*?\((\d+) in the messages, (\d+) in the completion\)", re.S
)


def _error_message(response: Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.content.decode(errors="replace").strip()[:500] or response.reason
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if data.get("message"):  # vLLM before 0.10: {"object": "error", "message": ...}
            return str(data["message"])
    return json.dumps(data)[:500]


class _ChoiceState:
    """What one streamed choice has accumulated so far."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.entries: list[Mapping[str, Any]] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.prompt_ids: list[int] = []

    def merge_tool_calls(self, deltas: Sequence[Mapping[str, Any]]) -> None:
        for delta in deltas:
            call = self.tool_calls.setdefault(
                int(delta.get("index", 0)),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if delta.get("id"):
                call["id"] = delta["id"]
            fn = delta.get("function") or {}
            if fn.get("name"):
                call["function"]["name"] += fn["name"]
            if fn.get("arguments"):
                call["function"]["arguments"] += fn["arguments"]


class OpenAIBackend:
    """Any OpenAI-compatible endpoint (``base_url`` ends with ``/v1``), for evaluation only.

    ``model_name`` is the name clients use at the gateway; ``upstream_model`` the one sent upstream
    (default: the same). Calls are recorded without token ids and marked not trainable.
    """

    kind = "openai"
    trainable = False

    def __init__(
        self,
        base_url: str,
        *,
        model_name: str,
        upstream_model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_connections: int = 512,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._names = (model_name,)
        self.upstream_model = upstream_model or model_name
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout_s = timeout_s
        self._max_connections = max_connections
        Pool(self.base_url)  # fails now on a malformed URL, not at the first call
        self._pools: dict[asyncio.AbstractEventLoop, Pool] = {}
        self.policy_version = 0

    @property
    def model_names(self) -> Sequence[str]:
        return self._names

    def _pool(self) -> Pool:
        # Connections belong to the event loop that opened them; keep one pool per loop.
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is None:
            pool = Pool(
                self.base_url,
                headers=self._headers,
                timeout_s=self._timeout_s,
                max_idle=self._max_connections,
            )
            self._pools[loop] = pool
        return pool

    def close(self) -> None:
        """Close idle connections (from the loop that made them, or when no loop runs any more)."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    # -- request / response shapes (vLLM overrides the extension points) -------------------------------

    def _served_model(self, request: ChatRequest) -> str:
        return self.upstream_model

    def _extensions(self, request: ChatRequest) -> dict[str, Any]:
        """Extra body fields; plain OpenAI asks for logprobs only when the client did."""
        if not request.logprobs:
            return {}
        if request.is_chat:
            return {"logprobs": True, "top_logprobs": request.top_logprobs or None}
        return {"logprobs": request.top_logprobs}

    def _body(self, request: ChatRequest, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "n": request.n,
        }
        if request.is_chat:
            body["messages"] = [dict(m) for m in request.messages]
            if request.tools:
                body["tools"] = [dict(t) for t in request.tools]
            if request.tool_choice is not None:
                body["tool_choice"] = request.tool_choice
        else:
            body["prompt"] = request.prompt if isinstance(request.prompt, str) else list(request.prompt or ())
        if request.max_tokens is not None:
            body["max_tokens"] = request.max_tokens
        if request.stop:
            body["stop"] = list(request.stop)
        if request.seed is not None:
            body["seed"] = request.seed
        if request.stream:
            body["stream"] = True
        body.update({k: v for k, v in self._extensions(request).items() if v is not None})
        return body

    def _failure(self, status: int, message: str) -> BackendError:
        found = _CONTEXT.search(message)
        if status == 400 and found:
            window, prompt, completion = (int(g) for g in found.groups())
            return ContextTooLongError(prompt, completion, window)
        if status in (502, 503, 504):
            return BackendUnavailableError(f"{self.base_url} answered {status}: {message}")
        if 400 <= status < 500:
            return UpstreamError(status, f"the model server refused the request: {message}")
        return BackendError(f"{self.base_url} answered {status}: {message}")

    # -- generation -----------------------------------------------------------------------------------

    async def generate(self, model: str, request: ChatRequest) -> AsyncIterator[Event]:
        version = self.policy_version
        served = self._served_model(request)
        path = "/chat/completions" if request.is_chat else "/completions"
        body = self._body(request, served)
        try:
            async with self._pool().stream("POST", path, body) as response:
                if response.status != 200:
                    await response.read()
                    raise self._failure(response.status, _error_message(response))
                if not request.stream:
                    await response.read()
                    data = response.json()
                    for choice in sorted(data.get("choices") or [], key=lambda c: c.get("index", 0)):
                        yield self._completion(request, data, choice, version)
                    return
                async for event in self._stream_events(request, response, version):
                    yield event
        except ConnectFailed as exc:
            raise BackendUnavailableError(f"{self.base_url}: {exc}") from None
        except TimedOut as exc:
            raise BackendError(f"{self.base_url} did not answer in time: {exc}") from None
        except HTTPFailure as exc:
            raise BackendError(f"{self.base_url}: {exc}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BackendError(f"bad answer from {self.base_url}: {type(exc).__name__}: {exc}") from None

    def _completion(
        self, request: ChatRequest, data: Mapping[str, Any], choice: Mapping[str, Any], version: int
    ) -> Completion:
        if request.is_chat:
            message = choice.get("message") or {}
            text, calls = message.get("content"), tuple(message.get("tool_calls") or ())
            entries = list((choice.get("logprobs") or {}).get("content") or [])
            prompt_ids = data.get("prompt_token_ids") or ()
        else:
            text, calls = choice.get("text", ""), ()
            entries = _entries_of_text_logprobs(choice.get("logprobs"))
            prompt_ids = choice.get("prompt_token_ids") or ()
        return self._result(
            request,
            choice,
            version,
            text,
            calls,
            entries,
            prompt_ids,
            choice.get("token_ids") or (),
            data.get("model"),
        )

    def _result(
        self,
        request: ChatRequest,
        choice: Mapping[str, Any],
        version: int,
        text: str | None,
        calls: Sequence[Mapping[str, Any]],
        entries: Sequence[Mapping[str, Any]],
        prompt_ids: Sequence[int],
        token_ids: Sequence[int],
        served: str | None,
    ) -> Completion:
        logprobs = tuple(float(e["logprob"]) for e in entries) if entries else None
        tops = (
            tuple(
                tuple((t["token"], float(t["logprob"])) for t in e.get("top_logprobs") or ()) for e in entries
            )
            if request.top_logprobs
            else None
        )
        return Completion(
            text=text,
            finish_reason=choice.get("finish_reason") or "stop",
            prompt_ids=tuple(int(i) for i in prompt_ids),
            response_ids=tuple(int(i) for i in token_ids),
            response_logprobs=logprobs,
            policy_version=version,
            response_tokens=tuple(str(e.get("token", "")) for e in entries),
            index=int(choice.get("index", 0)),
            tool_calls=tuple(calls),
            top_logprobs=tops,
            served_model=served,
        )

    async def _stream_events(
        self, request: ChatRequest, response: Response, version: int
    ) -> AsyncIterator[Event]:
        states: dict[int, _ChoiceState] = {}
        prompt_ids: list[int] = []
        served: str | None = None
        done = False
        async for line in response.lines():  # read to the body's end, so the connection can be reused
            if done or not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            chunk = json.loads(payload)
            if "error" in chunk and not chunk.get("choices"):
                error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
                raise self._failure(int(error.get("code") or 500), str(error.get("message")))
            served = chunk.get("model") or served
            prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
            for choice in chunk.get("choices") or ():
                index = int(choice.get("index", 0))
                state = states.setdefault(index, _ChoiceState())
                state.token_ids.extend(choice.get("token_ids") or ())
                state.prompt_ids = choice.get("prompt_token_ids") or state.prompt_ids
                if request.is_chat:
                    delta = choice.get("delta") or {}
                    text, calls = delta.get("content") or "", delta.get("tool_calls") or ()
                    entries = list((choice.get("logprobs") or {}).get("content") or [])
                else:
                    text, calls = choice.get("text") or "", ()
                    entries = _entries_of_text_logprobs(choice.get("logprobs"))
                state.text.append(text)
                state.entries.extend(entries)
                state.merge_tool_calls(calls)
                if text or calls:
                    yield ChoiceDelta(index, text, tool_calls=tuple(calls), logprobs=tuple(entries))
                if choice.get("finish_reason"):
                    calls_done = tuple(c for _, c in sorted(state.tool_calls.items()))
                    content = (
                        "".join(state.text) if (state.text and any(state.text)) or not calls_done else None
                    )
                    yield self._result(
                        request,
                        choice,
                        version,
                        content,
                        calls_done,
                        state.entries,
                        prompt_ids or state.prompt_ids,
                        state.token_ids,
                        served,
                    )


def _entries_of_text_logprobs(logprobs: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Chat-style logprob entries from a ``/v1/completions`` logprobs object."""
    if not logprobs:
        return []
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    return [
        {
            "token": t,
            "logprob": v,
            "top_logprobs": [{"token": k, "logprob": x} for k, x in (top or {}).items()],
        }
        # The upstream's parallel arrays: one that comes back short truncates the entries, as before.
        for t, v, top in zip(tokens, values, tops, strict=False)
    ]
