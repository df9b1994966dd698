"""OpenAI-compatible gateway that records exact token ids for every LLM call.

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (both also streamed as server-sent
events), ``POST /v1/responses`` (the OpenAI Responses API, see :mod:`.responses`), ``POST /v1/messages``
(Anthropic Messages, see :mod:`.anthropic`), ``GET /v1/models``,
``GET /metrics`` (Prometheus text), ``GET /health``, and ``GET|POST /agl/v1/policy`` (the policy version
served; publishing a new one to backends that can load it).

Rollout attribution, without changing agent code, by either
* a rollout-scoped base URL: ``{gateway}/rollouts/{rollout_id}/attempts/{attempt_id}/v1`` (the runner hands
  this to the agent), or
* the ``x-agl-rollout-id`` / ``x-agl-attempt-id`` headers.
A W3C ``traceparent`` header on the request makes the gateway span a child of the caller's span.
With production capture (:mod:`.capture`), a call attributed to no rollout joins the rollout of its session.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import pydantic
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from .. import semconv
from ..tracing import RolloutContext, get_tracer, rollout_attributes
from ..urls import API_PREFIXES, agent_name_of, rollout_base_url
from ._door import ChatDoor, CompletionDoor, DoorError, FrontDoor, openai_error, whole_delta
from ._schema import RequestError
from .backend import (
    Backend,
    BackendError,
    BackendUnavailableError,
    ChatRequest,
    Completion,
    ContextTooLongError,
    Event,
    PolicyUpdate,
    UpstreamError,
)
from .metrics import GatewayMetrics
from .prompts import PromptPolicies, PromptPolicy, parse_prompt_policy
from .protocols.anthropic import CountTokensDoor, MessagesDoor
from .protocols.responses import ResponseLog, ResponsesDoor
from .render import TemplateRenderer
from .tools import malformed_tool_calls

if TYPE_CHECKING:
    from .capture import Capture, CapturedSession

__all__ = ["create_gateway_app", "rollout_base_url"]

logger = logging.getLogger(__name__)
#: One line per policy version published to the gateway, loaded or refused (``agl`` commands show it).
policy_log = logging.getLogger("agl_core.gateway.policy")

_MAX_BODY = 8 * 1024 * 1024
_propagator = TraceContextTextMapPropagator()
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _rollout_header(rollout: RolloutContext | None) -> dict[str, str]:
    """``x-agl-rollout-id`` on an answer: the rollout the call was recorded in (given by the caller, or
    its captured session's), so a client outside agl's runner learns the id to inspect or reward."""
    if rollout is None or not (rollout.rollout_id.isascii() and rollout.rollout_id.isprintable()):
        return {}  # a header carries printable ASCII only: such an id is left out, never an error
    return {semconv.HEADER_ROLLOUT_ID: rollout.rollout_id}


def _rollout_of(request: Request) -> RolloutContext | None:
    """The rollout (and attempt) a request is attributed to: by its URL, else by its headers."""
    headers = request.headers
    rollout_id = request.path_params.get("rollout_id") or headers.get(semconv.HEADER_ROLLOUT_ID)
    attempt_id = request.path_params.get("attempt_id") or headers.get(semconv.HEADER_ATTEMPT_ID)
    return RolloutContext(rollout_id, attempt_id) if rollout_id else None


class _TooLarge(Exception):
    pass


async def _read_body(request: Request, limit: int = _MAX_BODY) -> bytes:
    """The request body, refused (:class:`_TooLarge`) as soon as it is known to pass ``limit`` bytes:
    from ``Content-Length`` before anything is read, or while a chunked body streams in. The rest of an
    oversized body is never read into memory."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _TooLarge(f"request body of {declared} bytes is over the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge(f"request body is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


async def _not_found(request: Request, exc: Exception) -> Response:
    return openai_error(
        404, f"no endpoint {request.url.path!r} here; the API is under /v1", "invalid_request_error"
    )


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    allowed = dict(getattr(exc, "headers", None) or {})
    methods = allowed.get("Allow", "another method")
    response = openai_error(
        405,
        f"{request.method} is not allowed on {request.url.path}; use {methods}",
        "invalid_request_error",
    )
    response.headers.update(allowed)
    return response


def _error_of(exc: BackendError) -> tuple[int, str, str, str | None]:
    """(HTTP status, message, OpenAI error type, error.type for the span) for a backend failure."""
    if isinstance(exc, ContextTooLongError):
        return 400, str(exc), "invalid_request_error", "context_length_exceeded"
    if isinstance(exc, UpstreamError):
        return exc.status, str(exc), exc.kind, "upstream_error"
    if isinstance(exc, BackendUnavailableError):
        return 503, f"the model backend is unavailable: {exc}", "server_error", "backend_unavailable"
    return 502, f"the model backend failed: {exc}", "server_error", "backend_error"


class _Call:
    """One request through the gateway: its identity, the spans it records, the drift check."""

    def __init__(
        self,
        app: _Gateway,
        request: Request,
        chat: ChatRequest,
        model: str,
        door: FrontDoor,
        rollout: RolloutContext | None,
        agent_name: str | None,
        session_id: str | None = None,
        prompt: PromptPolicy | None = None,
    ) -> None:
        self.app = app
        self.chat = chat
        self.model = model
        self.door = door
        self.endpoint = door.endpoint
        self.t0 = time.time_ns()
        self.first_event_ns: int | None = None
        self.id = f"{door.id_prefix}{uuid.uuid4().hex}"
        self.created = self.t0 // 1_000_000_000
        headers = request.headers
        self.parent = (
            _propagator.extract(
                {"traceparent": headers["traceparent"], "tracestate": headers.get("tracestate", "")}
            )
            if "traceparent" in headers
            else None
        )
        self.rollout = rollout
        #: The calling agent its URL (``.../agents/{name}/v1``) or the agent-name header names, if any.
        self.agent_name = agent_name
        #: The session production capture attributed the call to (``session.id``), if any.
        self.session_id = session_id
        #: The prompt policy applied to the call's messages (``chat`` holds them applied), if any.
        self.prompt = prompt
        self.completions: list[Completion] = []
        # The drift check renders the prompt on a worker thread while the backend generates.
        self.expected: asyncio.Task[list[int] | None] | None = None
        if app.renderer is not None:
            self.expected = asyncio.ensure_future(asyncio.to_thread(self._render, app.renderer))

    def _render(self, renderer: TemplateRenderer) -> list[int] | None:
        try:
            if self.chat.is_chat:
                return renderer.render(
                    self.chat.messages, self.chat.tools if self.chat.tools_enabled else None
                )
            return renderer.encode(self.chat.prompt)  # type: ignore[arg-type]
        except Exception:  # the backend reports the template error itself; nothing to compare
            return None

    def saw_event(self) -> None:
        if self.first_event_ns is None:
            self.first_event_ns = time.time_ns()

    def _base_attributes(self) -> dict[str, Any]:
        chat, backend = self.chat, self.app.backend
        attrs: dict[str, Any] = rollout_attributes(self.rollout) if self.rollout else {}
        attrs.update(
            {
                semconv.SOURCE: semconv.SOURCE_GATEWAY,
                semconv.GEN_AI_OPERATION_NAME: self.door.operation,
                semconv.GATEWAY_PROTOCOL: self.door.endpoint,
                semconv.GEN_AI_PROVIDER_NAME: "agl",
                semconv.GEN_AI_REQUEST_MODEL: self.model,
                semconv.GEN_AI_REQUEST_TEMPERATURE: chat.temperature,
                semconv.GEN_AI_REQUEST_TOP_P: chat.top_p,
                semconv.GEN_AI_RESPONSE_ID: self.id,
                semconv.TRAINABLE: backend.trainable,
                semconv.GATEWAY_BACKEND: getattr(backend, "kind", type(backend).__name__),
                semconv.STREAM: chat.stream,
            }
        )
        if self.agent_name:
            attrs[semconv.GEN_AI_AGENT_NAME] = self.agent_name
        if self.session_id is not None:
            attrs[semconv.SESSION_ID] = self.session_id
        messages = chat.messages if chat.is_chat else [{"role": "user", "content": chat.prompt}]
        bound = self.app.max_recorded_prompt_bytes
        _record_bounded(
            attrs,
            semconv.GEN_AI_INPUT_MESSAGES,
            semconv.INPUT_MESSAGES_ORIGINAL_BYTES,
            json.dumps(list(messages), ensure_ascii=False),
            bound,
        )
        if chat.max_tokens:
            attrs[semconv.GEN_AI_REQUEST_MAX_TOKENS] = chat.max_tokens
        if chat.n != 1:
            attrs[semconv.GEN_AI_REQUEST_CHOICE_COUNT] = chat.n
        if chat.seed is not None:
            attrs[semconv.GEN_AI_REQUEST_SEED] = chat.seed
        if chat.stop:
            attrs[semconv.GEN_AI_REQUEST_STOP_SEQUENCES] = list(chat.stop)
        if chat.tools:
            _record_bounded(
                attrs,
                semconv.GEN_AI_TOOL_DEFINITIONS,
                semconv.TOOL_DEFINITIONS_ORIGINAL_BYTES,
                json.dumps(list(chat.tools), ensure_ascii=False),
                bound,
            )
        return attrs

    def _span(self, attrs: dict[str, Any]) -> trace.Span:
        return self.app.tracer.start_span(
            f"{self.door.operation} {self.model}",
            context=self.parent,
            kind=SpanKind.SERVER,
            attributes=attrs,
            start_time=self.t0,
            record_exception=False,
            set_status_on_exception=False,
        )

    async def record(self, error: tuple[str, str] | None = None) -> None:
        """Write one span per finished choice (or one error span) and update the metrics.

        ``error`` is ``(error.type, message)`` when the call failed; choices that finished before the
        failure are not recorded (the client never received them whole)."""
        metrics = self.app.metrics
        base = self._base_attributes()
        if self.first_event_ns is not None:
            base[semconv.TIME_TO_FIRST_TOKEN] = (self.first_event_ns - self.t0) / 1e9
        if error is not None or not self.completions:
            kind, description = error or ("no_choices", "the backend returned no choice")
            span = self._span(base)
            span.set_attribute(semconv.ERROR_TYPE, kind)
            span.set_status(Status(StatusCode.ERROR, description))
            span.end()
            if self.expected is not None:
                self.expected.cancel()
            return
        drift: bool | None = None
        expected: list[int] | None = None
        prompt_ids = self.completions[0].prompt_ids
        if self.expected is not None and prompt_ids:
            expected = await self.expected
            if expected is not None:
                drift = tuple(expected) != tuple(prompt_ids)
                metrics.prompt_checks += 1
                metrics.prompt_drift += int(drift)
                if drift:
                    logger.warning(
                        "agl gateway: prompt token ids of %s differ from the chat template's "
                        "(%d vs %d tokens)",
                        self.id,
                        len(prompt_ids),
                        len(expected),
                    )
        metrics.prompt_tokens += len(prompt_ids)
        for result in self.completions:
            metrics.completion_tokens += len(result.response_ids)
            attrs = dict(base)
            attrs[semconv.CHOICE_INDEX] = result.index
            attrs[semconv.GEN_AI_RESPONSE_MODEL] = result.served_model or self.model
            attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = [result.finish_reason]
            attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = len(result.prompt_ids)
            attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = len(result.response_ids)
            attrs[semconv.PROMPT_TOKEN_IDS] = list(result.prompt_ids)
            attrs[semconv.RESPONSE_TOKEN_IDS] = list(result.response_ids)
            if result.response_logprobs is not None:
                attrs[semconv.RESPONSE_LOGPROBS] = list(result.response_logprobs)
            if result.forced_tokens:
                attrs[semconv.RESPONSE_FORCED_TOKENS] = result.forced_tokens
            attrs[semconv.POLICY_VERSION] = result.policy_version
            if self.prompt is not None:
                attrs[semconv.PROMPT_VERSION] = self.prompt.version
                attrs[semconv.PROMPT_SCOPE] = self.prompt.agent or "*"
            if self.app.policy_owner is not None:
                attrs[semconv.POLICY_OWNER] = self.app.policy_owner
            if result.policy_name is not None:
                attrs[semconv.POLICY_NAME] = result.policy_name
            if drift is not None:
                attrs[semconv.PROMPT_DRIFT] = drift
                if drift and expected is not None:
                    attrs[semconv.RENDERED_PROMPT_TOKEN_IDS] = expected
            message: dict[str, Any] = {"role": "assistant", "content": result.text}
            if result.tool_calls:
                message["tool_calls"] = [dict(c) for c in result.tool_calls]
            attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = json.dumps([message], ensure_ascii=False)
            if self.chat.is_chat and self.chat.tools_enabled:
                attrs.update(_tool_call_check(result, self.chat))
            self._span(attrs).end()


def _tool_call_check(result: Completion, chat: ChatRequest) -> dict[str, Any]:
    """Span attributes saying whether the tool calls of one choice are malformed (see ``semconv``)."""
    found = malformed_tool_calls(result.tool_calls, chat.tools, unparseable=result.tool_call_unparseable)
    attrs: dict[str, Any] = {semconv.TOOL_CALL_MALFORMED: bool(found)}
    if found:
        attrs[semconv.TOOL_CALL_MALFORMED_REASONS] = [reason for reason, _ in found]
        ids = [call_id for _, call_id in found if call_id]
        if ids:
            attrs[semconv.TOOL_CALL_MALFORMED_IDS] = ids
    return attrs


#: Request bodies over this many bytes are parsed off the event loop (``/health`` keeps answering).
_PARSE_OFF_LOOP_BYTES = 256 * 1024
#: Bytes of a call's input messages (and of its tool definitions) a span records by default.
DEFAULT_MAX_RECORDED_PROMPT_BYTES = 1024 * 1024
TRUNCATION_MARKER = "…[cut by agl: {size} bytes recorded of {original}]"


def _record_bounded(attrs: dict[str, Any], key: str, size_key: str, text: str, bound: int) -> None:
    """``attrs[key] = text``, cut to ``bound`` UTF-8 bytes with a marker (and the original size under
    ``size_key``) when longer: one caller's huge prompt must not make its spans too large to store."""
    encoded = text.encode("utf-8")
    if len(encoded) <= bound:
        attrs[key] = text
        return
    kept = encoded[:bound].decode("utf-8", errors="ignore")
    attrs[key] = kept + TRUNCATION_MARKER.format(size=len(kept.encode("utf-8")), original=len(encoded))
    attrs[size_key] = len(encoded)


class _Gateway:
    def __init__(
        self,
        backend: Backend,
        tracer: trace.Tracer,
        renderer: TemplateRenderer | None,
        metrics: GatewayMetrics,
        admin_token: str | None,
        capture: Capture | None = None,
    ) -> None:
        #: Objects with ``metric_rows()`` whose rows ``/metrics`` shows too (the span spool).
        self.metric_sources: tuple[Any, ...] = ()
        #: The most bytes of a call's input messages (or tool definitions) a span records.
        self.max_recorded_prompt_bytes = DEFAULT_MAX_RECORDED_PROMPT_BYTES
        self.backend = backend
        self.tracer = tracer
        self.renderer = renderer
        self.metrics = metrics
        self.admin_token = admin_token
        self.capture = capture
        #: Required of every model request when set (``Authorization: Bearer`` or ``x-api-key``).
        self.client_token: bytes | None = None
        #: The ``agl improve`` service that publishes this gateway's policy versions: the first publish that
        #: names an owner claims the gateway, and a publish for another owner (or none) is refused after.
        self.policy_owner: str | None = None
        #: The prompt policies applied to chat calls (``/agl/v1/prompt``).
        self.prompts = PromptPolicies()

    def _authorised(self, request: Request) -> bool:
        """Whether ``request`` carries the client token (always, when the gateway has none)."""
        if self.client_token is None:
            return True
        return _header_is(request, "authorization", b"Bearer " + self.client_token) or _header_is(
            request, "x-api-key", self.client_token
        )

    # -- endpoints ------------------------------------------------------------------------------------

    def door(self, make: Callable[[], FrontDoor]) -> Callable[[Request], Awaitable[Response]]:
        """The endpoint serving the protocol of the doors ``make`` builds (one per request)."""

        async def endpoint(request: Request) -> Response:
            door = make()
            if not self._authorised(request):
                return self._done(door.endpoint, door.error(401, _NO_TOKEN, "authentication_error"))
            try:
                agent = agent_name_of(
                    request.path_params.get("agent_name"), request.headers.get(semconv.HEADER_AGENT_NAME)
                )
            except ValueError as exc:
                return self._done(door.endpoint, door.error(400, str(exc), "invalid_request_error"))
            rollout = _rollout_of(request)
            door.bind(rollout)
            return await self._serve(request, door, rollout, agent)

        return endpoint

    async def models(self, request: Request) -> Response:
        if not self._authorised(request):
            return openai_error(401, _NO_TOKEN, "authentication_error")
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "agl"}
            for name in self.backend.model_names
        ]
        return JSONResponse({"object": "list", "data": data})

    async def metrics_text(self, request: Request) -> Response:
        if not self._authorised(request):
            return openai_error(401, _NO_TOKEN, "authentication_error")
        text = self.metrics.render(self.capture, self.backend, self.prompts, *self.metric_sources)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    def _not_admin(self, request: Request, what: str) -> Response | None:
        """A 401 when the gateway has an admin token and ``request`` does not carry it."""
        if self.admin_token is None:
            return None
        if _header_is(request, "authorization", b"Bearer " + self.admin_token.encode()):
            return None
        return openai_error(
            401, f"{what} needs 'Authorization: Bearer <admin token>'", "authentication_error"
        )

    async def prompt(self, request: Request) -> Response:
        """``GET``: the prompt policies applied; ``POST``: publish one (replacing the agent's); ``DELETE
        ?agent=NAME`` (no agent: the one for every agent): withdraw one."""
        if request.method == "GET":
            return JSONResponse({"prompts": self.prompts.to_json()})
        refused = self._not_admin(request, "publishing or withdrawing a prompt")
        if refused is not None:
            return refused
        if request.method == "DELETE":
            agent = request.query_params.get("agent") or None
            removed = self.prompts.withdraw(agent)
            if removed is None:
                return openai_error(
                    404, f"no prompt policy for {agent or 'every agent'}", "invalid_request_error"
                )
            policy_log.info("prompt v%d for %s withdrawn", removed.version, agent or "every agent")
            return JSONResponse({"withdrawn": removed.to_json()})
        try:
            raw = await _read_body(request)
        except _TooLarge as exc:
            return openai_error(413, str(exc), "invalid_request_error")
        try:
            policy = parse_prompt_policy(json.loads(raw))
        except (ValueError, RecursionError) as exc:
            return openai_error(
                400,
                'expected {"version": int, "agent": str|null, "system": str|null, "mode":'
                f' "replace"|"prepend", "demonstrations": [{{role, content}}, ...]}}: {exc}',
                "invalid_request_error",
            )
        previous = self.prompts.publish(policy)
        policy_log.info(
            "now applying prompt v%d to %s, replacing %s",
            policy.version,
            policy.agent or "every agent",
            "none" if previous is None else f"v{previous.version}",
        )
        return JSONResponse({"prompt": policy.to_json()})

    async def policy(self, request: Request) -> Response:
        if request.method == "GET":
            version = getattr(self.backend, "policy_version", None)
            return JSONResponse({"policy_version": version, "owner": self.policy_owner})
        refused = self._not_admin(request, "publishing a policy")
        if refused is not None:
            return refused
        update_policy = getattr(self.backend, "update_policy", None)
        if update_policy is None:
            return openai_error(
                501,
                f"the {getattr(self.backend, 'kind', 'configured')} backend cannot load new policy versions",
                "invalid_request_error",
            )
        try:
            raw = await _read_body(request)
        except _TooLarge as exc:
            return openai_error(413, str(exc), "invalid_request_error")
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise TypeError(f"the body is a JSON {type(body).__name__}, not an object")
            update = PolicyUpdate(
                version=int(body["version"]), path=str(body["path"]), kind=body.get("kind", "lora")
            )
            if update.kind not in ("lora", "full"):
                raise ValueError(f"kind must be 'lora' or 'full', got {update.kind!r}")
            owner = _owner_of(body)
        except (ValueError, KeyError, TypeError) as exc:
            return openai_error(
                400,
                f'expected {{"version": int, "path": str, "kind": "lora"|"full", "owner": str}}: {exc}',
                "invalid_request_error",
            )
        if self.policy_owner is not None and owner != self.policy_owner:
            policy_log.warning(
                "policy v%d refused: published for %r, and this gateway takes versions from %r",
                update.version,
                owner,
                self.policy_owner,
            )
            self.metrics.policy_refused += 1
            return openai_error(
                409,
                f"this gateway takes its policy versions from the agl improve service {self.policy_owner!r}"
                f" (it published to it first), not from {owner!r}: one service drives a gateway; restart"
                " the gateway to hand it to another",
                "invalid_request_error",
            )
        before = getattr(self.backend, "policy_version", None)
        try:
            await update_policy(update)
        except BackendError as exc:
            status, message, kind, _ = _error_of(exc)
            self.metrics.policy_refused += 1
            policy_log.warning("policy v%d (%s) refused: %s", update.version, update.kind, exc)
            return openai_error(
                status if status != 502 else 500, f"cannot load policy v{update.version}: {exc}", kind
            )
        self.metrics.policy_changes += 1
        self.metrics.policy_loaded_at = time.time()
        if owner is not None and self.policy_owner is None:
            self.policy_owner = owner
            policy_log.info("policy versions of this gateway now come from the agl improve service %r", owner)
        policy_log.info(
            "now serving policy v%d (%s weights from %s), replacing v%s",
            update.version,
            update.kind,
            update.path,
            before,
        )
        return JSONResponse({"policy_version": update.version})

    # -- the generation path --------------------------------------------------------------------------

    async def _serve(
        self, request: Request, door: FrontDoor, rollout: RolloutContext | None, agent: str | None
    ) -> Response:
        metrics, endpoint = self.metrics, door.endpoint
        parsed = await self._parse(request, door)
        if isinstance(parsed, Response):
            return self._done(endpoint, parsed)
        model, chat = parsed
        session: CapturedSession | None = None
        if rollout is None and self.capture is not None:
            try:
                session = self.capture.session_of(request.headers, door.session_hint)
            except RequestError as exc:
                return self._done(
                    endpoint, door.error(400, f"invalid request: {exc}", "invalid_request_error", exc.param)
                )
            if session is not None:
                rollout = RolloutContext(session.rollout_id)
        if model not in self.backend.model_names:
            return self._done(
                endpoint,
                door.error(
                    404,
                    f"model {model!r} does not exist here; available: {', '.join(self.backend.model_names)}",
                    "invalid_request_error",
                    "model",
                    "model_not_found",
                ),
            )
        session_id = None
        if session is not None and self.capture is not None:
            self.capture.note(session)
            self.metrics.captured_calls += 1
            session_id = session.session_id
        if agent is not None:
            chat = dataclasses.replace(chat, agent=agent)
        prompt = self.prompts.for_agent(chat.agent) if chat.is_chat else None
        if prompt is not None:  # the model sees (and the span records) the messages with the prompt applied
            chat = dataclasses.replace(chat, messages=prompt.apply(chat.messages))
        call = _Call(self, request, chat, model, door, rollout, agent, session_id, prompt)
        metrics.inflight += 1
        events = self.backend.generate(model, chat)
        try:
            if chat.stream:
                # The first event is awaited here, so a request the backend refuses still gets a proper
                # status.
                first = await events.__anext__()
                call.saw_event()
                return _SSEResponse(_EventStream(self, call, events, first), _rollout_header(rollout))
            with anyio.CancelScope() as scope:
                # stop generating when the client goes away: nobody waits for the answer any more
                watcher = asyncio.ensure_future(_cancel_when_gone(request, scope))
                try:
                    async for event in events:
                        call.saw_event()
                        if isinstance(event, Completion):
                            call.completions.append(event)
                finally:
                    watcher.cancel()
            gone = scope.cancelled_caught
            if gone:
                with anyio.CancelScope(shield=True):
                    await _aclose(events)
                    metrics.inflight -= 1
                    metrics.client_disconnects += 1
                    call.completions.clear()
                    await call.record(("client_disconnected", "the client went away before the answer"))
                return self._done(endpoint, Response(status_code=499))
        except StopAsyncIteration:
            pass
        except BackendError as exc:
            await _aclose(events)
            metrics.inflight -= 1
            status, message, kind, span_error = _error_of(exc)
            await call.record((span_error or "backend_error", str(exc)))
            too_long = isinstance(exc, ContextTooLongError)
            param = door.prompt_param if too_long else None
            code = "context_length_exceeded" if too_long else None
            return self._done(endpoint, door.error(status, message, kind, param, code))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _aclose(events)
            metrics.inflight -= 1
            raise
        metrics.inflight -= 1
        await call.record()
        call.completions.sort(key=lambda c: c.index)
        body = door.response(call)
        if call.completions:
            door.recorded(call)
        return self._done(endpoint, JSONResponse(body, headers=_rollout_header(rollout)))

    async def _parse(self, request: Request, door: FrontDoor) -> tuple[str, ChatRequest] | Response:
        """The request's model and generation request, or the error answer its body gets."""
        try:
            raw = await _read_body(request)
        except _TooLarge as exc:
            return door.error(413, str(exc), "invalid_request_error")
        try:
            if len(raw) > _PARSE_OFF_LOOP_BYTES:  # a heavy body is parsed on a worker thread
                return await asyncio.to_thread(door.parse, raw)
            return door.parse(raw)
        except pydantic.ValidationError as exc:
            return door.invalid(exc)
        except RequestError as exc:
            return door.error(400, f"invalid request: {exc}", "invalid_request_error", exc.param)
        except DoorError as exc:
            return door.error(exc.status, str(exc), exc.kind, exc.param)

    def _done(self, endpoint: str, response: Response) -> Response:
        self.metrics.request_done(endpoint, response.status_code)
        return response


async def _cancel_when_gone(request: Request, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` once the client of ``request`` (whose body was read) has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


class _EventStream:
    """Server-sent events for one streamed call, shaped by its door; records the call's spans when the
    stream ends."""

    def __init__(self, gateway: _Gateway, call: _Call, events: AsyncIterator[Event], first: Event) -> None:
        self.gateway = gateway
        self.call = call
        self.events = events
        self.first = first
        self.status: int | None = None
        self.error: tuple[str, str] | None = None
        self.finished = False

    async def _all_events(self) -> AsyncIterator[Event]:
        yield self.first
        async for event in self.events:
            self.call.saw_event()
            yield event

    async def sse(self) -> AsyncIterator[bytes]:
        call, door = self.call, self.call.door
        try:
            for chunk in door.stream_start(call):
                yield chunk
            streamed: set[int] = set()
            async for event in self._all_events():
                if isinstance(event, Completion):
                    call.completions.append(event)
                    if event.index not in streamed and (event.text or event.tool_calls):
                        # a backend that does not stream pieces: the whole choice goes as one delta
                        for chunk in door.stream_delta(call, whole_delta(event, call.chat)):
                            yield chunk
                    for chunk in door.stream_choice_end(call, event):
                        yield chunk
                elif event.text or event.tool_calls:
                    streamed.add(event.index)
                    for chunk in door.stream_delta(call, event):
                        yield chunk
            # Recorded before the stream's end reaches the client: whoever reads the spans after the call
            # returned (a runner flushing at the end of a rollout) finds them.
            self.status = 200
            await self.finish()
            call.completions.sort(key=lambda c: c.index)
            closing = door.stream_end(call)
            if call.completions:
                door.recorded(call)
            for chunk in closing:
                yield chunk
        except BackendError as exc:
            status, message, kind, span_error = _error_of(exc)
            self.status, self.error = status, (span_error or "backend_error", str(exc))
            # Headers are gone already: the error travels as an event.
            for chunk in door.stream_error(call, status, message, kind):
                yield chunk
        finally:
            await self.finish()

    async def finish(self) -> None:
        """Stop the backend and record the call, once; a stream that did not reach its end (the client
        went away, or the response never started) counts as a disconnect."""
        if self.finished:
            return
        self.finished = True
        metrics = self.gateway.metrics
        if self.status is None:
            self.status = 499
            self.error = ("client_disconnected", "the client closed the stream before it ended")
            metrics.client_disconnects += 1
        with anyio.CancelScope(shield=True):
            try:
                await _aclose(self.events)
            finally:
                metrics.inflight -= 1
                metrics.request_done(self.call.endpoint, self.status)
                await self.call.record(self.error)


class _SSEResponse(StreamingResponse):
    """A streaming response that always finishes its call, also when the client leaves before it starts."""

    def __init__(self, stream: _EventStream, headers: Mapping[str, str]) -> None:
        super().__init__(stream.sse(), media_type="text/event-stream", headers={**_SSE_HEADERS, **headers})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        coalesce = _CoalescingSend(send)
        try:
            await super().__call__(scope, receive, coalesce)
        finally:
            coalesce.cancel()
            await self._stream.finish()


class _CoalescingSend:
    """Sends the stream's events that become ready in the same event-loop turn as one write.

    A socket write costs far more than formatting an event; a burst of events (several tokens read from
    the backend at once, or the last token, the finish and ``[DONE]``) then costs one. Nothing waits for a
    timer: the buffer is flushed as soon as the task producing events yields to the loop."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._buffer: list[bytes] = []
        self._flush: asyncio.Task[None] | None = None

    async def __call__(self, message: Message) -> None:
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        self._buffer.append(message.get("body", b""))
        if message.get("more_body", False):
            if len(self._buffer) == 1:
                self._flush = asyncio.get_running_loop().create_task(self._flush_soon(self._flush))
            return
        if self._flush is not None:
            await self._flush
        body, self._buffer = b"".join(self._buffer), []
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def _flush_soon(self, previous: asyncio.Task[None] | None) -> None:
        if previous is not None:
            await previous
        body, self._buffer = b"".join(self._buffer), []
        if body:
            await self._send({"type": "http.response.body", "body": body, "more_body": True})

    def cancel(self) -> None:
        if self._flush is not None and not self._flush.done():
            self._flush.cancel()


async def _aclose(events: AsyncIterator[Event]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


#: The protocols the gateway serves under each API prefix: ``(path, door factory)``.
_DOORS: tuple[tuple[str, Callable[[], FrontDoor]], ...] = (
    ("/v1/chat/completions", ChatDoor),
    ("/v1/completions", CompletionDoor),
    ("/v1/messages", MessagesDoor),
    ("/v1/messages/count_tokens", CountTokensDoor),
)


def _header_is(request: Request, name: str, expected: bytes) -> bool:
    """Whether header ``name`` of ``request`` is exactly ``expected``, compared in constant time. Bytes,
    not str: compare_digest refuses non-ASCII text (a header is latin-1 on the wire)."""
    return hmac.compare_digest(request.headers.get(name, "").encode("latin-1", "replace"), expected)


_NO_TOKEN = (
    "this gateway needs its token: send it as the API key ('Authorization: Bearer TOKEN' or"
    " 'x-api-key: TOKEN'); agl's runners pass it to the agent as llm.api_key"
)


def _owner_of(body: dict[str, Any]) -> str | None:
    """A publish's ``owner`` (the ``agl improve`` service's name), checked: a short printable string."""
    owner = body.get("owner")
    if owner is None:
        return None
    if not isinstance(owner, str) or not 0 < len(owner) <= 128 or not owner.isprintable():
        raise ValueError(f"owner must be a printable string of 1 to 128 characters, got {str(owner)[:40]!r}")
    return owner


def create_gateway_app(
    backend: Backend,
    *,
    tracer_provider: trace.TracerProvider | None = None,
    renderer: TemplateRenderer | None = None,
    metrics: GatewayMetrics | None = None,
    admin_token: str | None = None,
    capture: Capture | None = None,
    client_token: str | None = None,
    span_exporter: Any = None,
    max_recorded_prompt_bytes: int = DEFAULT_MAX_RECORDED_PROMPT_BYTES,
) -> Starlette:
    """The ASGI app of the gateway in front of ``backend``; spans go through ``tracer_provider``.

    ``renderer`` turns on the drift check: the gateway renders each prompt with it and compares the ids
    with what the backend reports (flagged on the span, counted in ``/metrics``). ``admin_token``, when
    set, is required to publish a new policy version. ``capture`` turns on production capture: calls that
    name no rollout join the rollout of their session, registered in the store (:mod:`.capture`); the
    caller closes it. ``client_token``, when set, is required of every model request and of ``/metrics``
    (``Authorization: Bearer TOKEN``, as OpenAI clients send their API key, or ``x-api-key: TOKEN``, as
    Anthropic's do): a gateway reachable from other machines needs one. ``span_exporter``: the exporter
    behind ``tracer_provider``, whose counters (``metric_rows()``: spans sent, queued, dropped) ``/metrics``
    shows. A call's input messages and tool definitions are recorded up to ``max_recorded_prompt_bytes``
    bytes each (UTF-8 JSON); a longer one is cut there, ends with a marker and its span carries the original
    size (:data:`~agl_core.semconv.INPUT_MESSAGES_ORIGINAL_BYTES`, ``TOOL_DEFINITIONS_ORIGINAL_BYTES``).
    """
    if max_recorded_prompt_bytes < 1024:
        raise ValueError(f"max_recorded_prompt_bytes must be at least 1024, got {max_recorded_prompt_bytes}")
    gateway = _Gateway(
        backend, get_tracer(tracer_provider), renderer, metrics or GatewayMetrics(), admin_token, capture
    )
    gateway.max_recorded_prompt_bytes = max_recorded_prompt_bytes
    if span_exporter is not None and hasattr(span_exporter, "metric_rows"):
        gateway.metric_sources = (span_exporter,)
    if client_token is not None:
        if not client_token:
            raise ValueError("client_token may not be empty")
        gateway.client_token = client_token.encode()
    routes = [
        Route("/metrics", gateway.metrics_text, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/agl/v1/policy", gateway.policy, methods=["GET", "POST"]),
        Route("/agl/v1/prompt", gateway.prompt, methods=["GET", "POST", "DELETE"]),
    ]
    # The Responses API's previous_response_id refers to earlier calls: their record is the gateway's.
    responses = ResponseLog()
    doors = (*_DOORS, ("/v1/responses", lambda: ResponsesDoor(responses)))
    for prefix in API_PREFIXES:
        for path, door in doors:
            routes.append(Route(prefix + path, gateway.door(door), methods=["POST"]))
        routes.append(Route(prefix + "/v1/models", gateway.models, methods=["GET"]))
    app = Starlette(routes=routes, exception_handlers={404: _not_found, 405: _method_not_allowed})
    app.state.metrics = gateway.metrics
    app.state.backend = gateway.backend
    return app
