"""OpenAI-compatible gateway that records exact token ids for every LLM call.

Rollout attribution, without changing agent code, by either
* a rollout-scoped base URL: ``{gateway}/rollouts/{rollout_id}/attempts/{attempt_id}/v1`` (the runner hands
  this to the agent), or
* the ``x-agl-rollout-id`` / ``x-agl-attempt-id`` headers.
A W3C ``traceparent`` header on the request makes the gateway span a child of the caller's span.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

import pydantic
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import semconv
from ..tracing import RolloutContext, get_tracer, rollout_attributes
from .backend import Backend, BackendError, ChatRequest, Completion, ContextTooLongError

__all__ = ["create_gateway_app", "rollout_base_url"]

_MAX_BODY = 8 * 1024 * 1024
_propagator = TraceContextTextMapPropagator()


def rollout_base_url(gateway_url: str, rollout_id: str, attempt_id: str | None = None) -> str:
    """The OpenAI ``base_url`` that attributes every call made through it to the given rollout."""
    url = f"{gateway_url.rstrip('/')}/rollouts/{rollout_id}"
    if attempt_id:
        url += f"/attempts/{attempt_id}"
    return url + "/v1"


class _Message(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def flat(self) -> dict[str, Any]:
        """The message with list-of-parts content joined into one string."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") not in ("text", "input_text") or not isinstance(part.get("text"), str):
                    raise ValueError(f"only text content parts are supported, got a {part.get('type')!r} part")
                texts.append(part["text"])
            out["content"] = "".join(texts)
        elif self.content is None:
            out["content"] = ""
        if out["role"] == "developer":
            out["role"] = "system"
        return out


class _ChatIn(pydantic.BaseModel):
    # OpenAI clients send many optional fields; unknown ones are accepted and ignored like OpenAI does.
    model_config = pydantic.ConfigDict(extra="allow")
    model: str = pydantic.Field(min_length=1)
    messages: list[_Message] = pydantic.Field(min_length=1)
    max_tokens: int | None = pydantic.Field(default=None, ge=1)
    max_completion_tokens: int | None = pydantic.Field(default=None, ge=1)
    temperature: float = pydantic.Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = pydantic.Field(default=1.0, gt=0.0, le=1.0)
    n: int = pydantic.Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    logprobs: bool = False
    tools: list[dict[str, Any]] | None = None


def _openai_error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status
    )


def create_gateway_app(backend: Backend, *, tracer_provider: trace.TracerProvider | None = None) -> Starlette:
    """The ASGI app of the gateway in front of ``backend``; spans go through ``tracer_provider``."""
    tracer = get_tracer(tracer_provider)

    async def chat_completions(request: Request) -> Response:
        raw = await request.body()
        if len(raw) > _MAX_BODY:
            return _openai_error(413, f"request body over {_MAX_BODY} bytes", "invalid_request_error")
        try:
            body = _ChatIn.model_validate_json(raw)
            messages = [m.flat() for m in body.messages]
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            return _openai_error(400, f"invalid request: {param}: {err['msg']}", "invalid_request_error", param)
        except ValueError as exc:
            return _openai_error(400, f"invalid request: {exc}", "invalid_request_error", "messages")
        if body.stream:
            return _openai_error(400, "stream=true is not supported by this gateway version", "invalid_request_error", "stream")
        if body.model not in backend.model_names:
            return _openai_error(
                404,
                f"model {body.model!r} does not exist here; available: {', '.join(backend.model_names)}",
                "invalid_request_error",
                "model",
            )
        rollout = _rollout_of(request)
        chat = ChatRequest(
            messages=messages,
            max_tokens=body.max_completion_tokens or body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
            seed=body.seed,
            tools=body.tools,
        )
        parent = _propagator.extract({k.lower(): v for k, v in request.headers.items()})
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        choices = []
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for index in range(body.n):
            attrs: dict[str, Any] = rollout_attributes(rollout) if rollout else {}
            attrs.update(
                {
                    semconv.SOURCE: semconv.SOURCE_GATEWAY,
                    semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
                    semconv.GEN_AI_PROVIDER_NAME: "agl",
                    semconv.GEN_AI_REQUEST_MODEL: body.model,
                    semconv.GEN_AI_REQUEST_TEMPERATURE: body.temperature,
                    semconv.GEN_AI_REQUEST_TOP_P: body.top_p,
                    semconv.GEN_AI_RESPONSE_ID: completion_id,
                    semconv.GEN_AI_INPUT_MESSAGES: json.dumps(messages, ensure_ascii=False),
                    semconv.TRAINABLE: backend.trainable,
                }
            )
            if chat.max_tokens:
                attrs[semconv.GEN_AI_REQUEST_MAX_TOKENS] = chat.max_tokens
            with tracer.start_as_current_span(
                f"chat {body.model}", context=parent, kind=SpanKind.SERVER, attributes=attrs,
                record_exception=False, set_status_on_exception=False,
            ) as span:
                try:
                    result = await run_in_threadpool(backend.chat, body.model, chat)
                except ContextTooLongError as exc:
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    span.set_attribute(semconv.ERROR_TYPE, "context_length_exceeded")
                    return _openai_error(400, str(exc), "invalid_request_error", "messages")
                except BackendError as exc:
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    span.set_attribute(semconv.ERROR_TYPE, "backend_error")
                    return _openai_error(502, f"the model backend failed: {exc}", "server_error")
                _record(span, result)
            usage["prompt_tokens"] = len(result.prompt_ids)
            usage["completion_tokens"] += len(result.response_ids)
            choices.append(_choice(index, result, body.logprobs))
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return JSONResponse(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.model,
                "choices": choices,
                "usage": usage,
            }
        )

    async def models(request: Request) -> Response:
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "agl"} for name in backend.model_names]
        return JSONResponse({"object": "list", "data": data})

    routes = []
    for prefix in ("", "/rollouts/{rollout_id}", "/rollouts/{rollout_id}/attempts/{attempt_id}"):
        routes.append(Route(prefix + "/v1/chat/completions", chat_completions, methods=["POST"]))
        routes.append(Route(prefix + "/v1/models", models, methods=["GET"]))
    return Starlette(routes=routes)


def _rollout_of(request: Request) -> RolloutContext | None:
    rollout_id = request.path_params.get("rollout_id") or request.headers.get(semconv.HEADER_ROLLOUT_ID)
    if not rollout_id:
        return None
    attempt_id = request.path_params.get("attempt_id") or request.headers.get(semconv.HEADER_ATTEMPT_ID)
    return RolloutContext(rollout_id, attempt_id)


def _record(span: trace.Span, result: Completion) -> None:
    span.set_attribute(semconv.GEN_AI_RESPONSE_FINISH_REASONS, [result.finish_reason])
    span.set_attribute(semconv.GEN_AI_USAGE_INPUT_TOKENS, len(result.prompt_ids))
    span.set_attribute(semconv.GEN_AI_USAGE_OUTPUT_TOKENS, len(result.response_ids))
    span.set_attribute(semconv.PROMPT_TOKEN_IDS, list(result.prompt_ids))
    span.set_attribute(semconv.RESPONSE_TOKEN_IDS, list(result.response_ids))
    if result.response_logprobs is not None:
        span.set_attribute(semconv.RESPONSE_LOGPROBS, list(result.response_logprobs))
    span.set_attribute(semconv.POLICY_VERSION, result.policy_version)
    span.set_attribute(
        semconv.GEN_AI_OUTPUT_MESSAGES,
        json.dumps([{"role": "assistant", "content": result.text}], ensure_ascii=False),
    )


def _choice(index: int, result: Completion, with_logprobs: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "message": {"role": "assistant", "content": result.text},
        "finish_reason": result.finish_reason,
        "logprobs": None,
    }
    if with_logprobs and result.response_logprobs is not None:
        tokens = result.response_tokens or tuple("" for _ in result.response_ids)
        choice["logprobs"] = {
            "content": [
                {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                for tok, lp in zip(tokens, result.response_logprobs)
            ]
        }
    return choice
