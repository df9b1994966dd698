"""The collector-store's HTTP server: OTLP/HTTP span ingest and the coordination API.

Endpoints (JSON unless noted):

=============================================  ==============================================================
``POST /v1/traces``                            OTLP/HTTP, ``application/x-protobuf`` or ``application/json``,
                                               optionally gzip / deflate encoded
``POST /api/rollouts``                         enqueue ``{"rollouts": [{task_id, input, group_id?, ...}]}``
``POST /api/rollouts/dequeue``                 ``{"worker_id", "lease_s"?}`` -> ``{"rollout", "attempt"}``
                                               or 204
``POST /api/rollouts/query``                   ``{"rollout_ids": [...]}`` -> ``{"rollouts": [...]}``
``POST /api/rollouts/list``                    ``{"statuses"?, "task_id"?, "group_id"?, "step"?, "split"?,
                                               "run"?, "agent"?, "text"?, "reward_min"?, "reward_max"?,
                                               "before"?, "limit"?}``
                                               -> a page, newest first (``{"rollouts", "seqs",
                                               "span_counts", "before", "total", "total_capped"}``)
``POST /api/rollouts/cancel``                  ``{"rollout_ids": [...]}`` -> ``{"rollouts": [...]}``
``POST /api/rollouts/consumed``                ``{"rollout_ids": [...]}`` -> ``{"marked": n}``
``POST /api/rollouts/observed``                record finished rollouts that ran outside the queue
                                               (``{"rollouts": [{rollout_id, ...}]}``, as enqueue; ids
                                               already stored are kept) -> ``{"rollouts": [...]}``
``POST /api/rollouts/merge``                   ``{"moves": {old_id: new_id}}`` -> ``{"moved": n}`` (spans of
                                               observed rollouts moved into another; 409 for a rollout
                                               that ran under the queue)
``POST /api/attempts/{attempt_id}/heartbeat``  ``{"lease_s"?}`` -> ``{"attempt"}`` (its status says if it
                                               should stop: cancelled or timed out)
``POST /api/attempts/{attempt_id}/complete``   ``{"status", "reward"?, "error"?}`` -> ``{"rollout"}``
``POST /api/spans/query``                      ``{"rollout_ids"?, "attempt_id"?, "trace_id"?,
                                               "start_after_ns"?, "start_before_ns"?,
                                               "after_seq"?, "limit"?}``
``POST /api/rewards``                          attach rewards after the fact: ``{"rewards": [{reward_id,
                                               value, name?, source?, time?, rollout_id? | trace_id? |
                                               span_id? ...}]}`` -> ``{"rewards": [...]}`` (all or none;
                                               409 for a reward id naming another reward, 404 for an
                                               unknown target)
``PUT /api/resources/{name}``                  ``{"value"}`` -> ``{"resource"}`` (a new version)
``GET /api/resources/{name}``                  the latest version
``GET /api/stats``, ``GET /healthz``
=============================================  ==============================================================

Errors are JSON ``{"error": {"message", "type"}}`` with a 4xx status, except on ``/v1/traces`` where the
OTLP specification asks for a ``google.rpc.Status`` body (protobuf, or JSON for JSON requests). When the
write backlog is full, ``/v1/traces`` answers 503 with ``Retry-After``, which OTLP exporters retry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import math
import zlib
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import pydantic
from google.protobuf import json_format
from google.rpc import status_pb2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import semconv
from ..pipeline.rewards import EPISODE, MAX_REWARD_ID, MAX_ROLLOUT_ID, MAX_SOURCE, Reward
from ..records import RolloutStatus
from ._schema import lone_surrogate_at
from .base import MAX_PAGE, NotFoundError, RolloutFilter, Store, StoreError, StoreUnavailableError
from .formats import wire
from .formats.otlp import OtlpDecodeError, encode_export_response
from .ingest import IngestPipeline, Overloaded
from .redact import MASK, Redactor

__all__ = ["create_store_app", "MAX_BODY_BYTES", "QUERY_PAGE_BYTES"]

#: Largest request body accepted, after decompression (413 beyond it).
MAX_BODY_BYTES = 32 * 1024 * 1024
#: Stored span bytes one ``/api/spans/query`` page holds at most (at least one span); ``"more": true``
#: then says the page stopped short of its ``limit`` for that, and the next starts after its last ``seq``.
QUERY_PAGE_BYTES = 16 * 1024 * 1024
_PROTOBUF = "application/x-protobuf"
_Handler = Callable[[Request], Awaitable[Response]]
#: Most ids one API call may name; StoreClient pages longer lists.
MAX_IDS_PER_CALL = 10_000
_INT64 = 2**63 - 1
#: An id or name: no NUL characters (PostgreSQL text cannot hold them), bounded length.
_Id = Annotated[str, pydantic.StringConstraints(min_length=1, max_length=512, pattern=r"^[^\x00]+$")]


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


class _RolloutIn(_Strict):
    task_id: _Id
    input: Any = None
    group_id: _Id | None = None
    rollout_id: Annotated[_Id, pydantic.Field(max_length=128)] | None = None
    metadata: dict[str, Any] = {}
    max_attempts: int = pydantic.Field(default=1, ge=1, le=100)


class _EnqueueIn(_Strict):
    rollouts: list[_RolloutIn] = pydantic.Field(min_length=1, max_length=MAX_IDS_PER_CALL)


class _ObservedIn(_Strict):
    rollouts: list[_RolloutIn] = pydantic.Field(min_length=1, max_length=MAX_IDS_PER_CALL)

    @pydantic.field_validator("rollouts")
    @classmethod
    def _ids_given(cls, rollouts: list[_RolloutIn]) -> list[_RolloutIn]:
        if any(r.rollout_id is None for r in rollouts):
            raise ValueError("every observed rollout needs its rollout_id")
        return rollouts


_RolloutId = Annotated[str, pydantic.StringConstraints(min_length=1, max_length=256, pattern=r"^[^\x00]+$")]


class _MergeIn(_Strict):
    moves: dict[_RolloutId, _RolloutId] = pydantic.Field(min_length=1, max_length=MAX_IDS_PER_CALL)


class _DequeueIn(_Strict):
    worker_id: Annotated[_Id, pydantic.Field(max_length=256)]
    lease_s: float = pydantic.Field(default=60.0, gt=0, le=86_400)


class _HeartbeatIn(_Strict):
    lease_s: float = pydantic.Field(default=60.0, gt=0, le=86_400)


class _RolloutQueryIn(_Strict):
    rollout_ids: list[_Id] = pydantic.Field(max_length=MAX_IDS_PER_CALL)


class _ListIn(_Strict):
    statuses: list[RolloutStatus] = pydantic.Field(default=[], max_length=8)
    task_id: _Id | None = None
    group_id: _Id | None = None
    step: int | None = pydantic.Field(default=None, ge=0, le=_INT64)
    split: Annotated[_Id, pydantic.Field(max_length=64)] | None = None
    run: Annotated[_Id, pydantic.Field(max_length=256)] | None = None
    agent: Annotated[_Id, pydantic.Field(max_length=256)] | None = None
    text: Annotated[_Id, pydantic.Field(max_length=256)] | None = None
    reward_min: float | None = pydantic.Field(default=None, allow_inf_nan=False)
    reward_max: float | None = pydantic.Field(default=None, allow_inf_nan=False)
    before: int | None = pydantic.Field(default=None, ge=0, le=_INT64)
    limit: int = pydantic.Field(default=50, ge=1, le=MAX_PAGE)

    @pydantic.model_validator(mode="after")
    def _range(self) -> _ListIn:
        self.filter()  # the filter checks its own fields together (the reward range)
        return self

    def filter(self) -> RolloutFilter:
        return RolloutFilter(
            statuses=tuple(s.value for s in self.statuses),
            task_id=self.task_id,
            group_id=self.group_id,
            step=self.step,
            split=self.split,
            run=self.run,
            agent=self.agent,
            text=self.text,
            reward_min=self.reward_min,
            reward_max=self.reward_max,
        )


class _CompleteIn(_Strict):
    status: Literal["succeeded", "failed", "timed_out", "cancelled"]
    reward: float | None = pydantic.Field(default=None, allow_inf_nan=False)
    error: str | None = pydantic.Field(default=None, max_length=65_536)


class _SpanQueryIn(_Strict):
    rollout_ids: list[_Id] | None = pydantic.Field(default=None, max_length=MAX_IDS_PER_CALL)
    attempt_id: Annotated[_Id, pydantic.Field(max_length=256)] | None = None
    trace_id: str | None = pydantic.Field(default=None, pattern=r"^[0-9a-f]{32}$")
    start_after_ns: int | None = pydantic.Field(default=None, ge=0, le=_INT64)
    start_before_ns: int | None = pydantic.Field(default=None, ge=0, le=_INT64)
    after_seq: int = pydantic.Field(default=0, ge=0, le=_INT64)
    limit: int = pydantic.Field(default=10_000, ge=1, le=100_000)


class _ResourceIn(_Strict):
    value: Any
    #: Keep only this many latest versions of the resource (older ones are deleted); unset: all.
    keep: int | None = pydantic.Field(None, ge=1, le=1_000_000)


class _RewardIn(_Strict):
    """Types and sizes only; :class:`~agl_core.pipeline.rewards.Reward` checks the rest, naming the field."""

    reward_id: str = pydantic.Field(max_length=MAX_REWARD_ID)
    value: Any
    name: str = pydantic.Field(default=EPISODE, max_length=128)
    source: str | None = pydantic.Field(default=None, max_length=MAX_SOURCE)
    time: str | None = pydantic.Field(default=None, max_length=64)
    rollout_id: str | None = pydantic.Field(default=None, max_length=MAX_ROLLOUT_ID)
    trace_id: str | None = pydantic.Field(default=None, max_length=32)
    span_id: str | None = pydantic.Field(default=None, max_length=16)


class _RewardsIn(_Strict):
    rewards: list[_RewardIn] = pydantic.Field(min_length=1, max_length=MAX_IDS_PER_CALL)


class _HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


_GRPC_CODES = {400: 3, 401: 16, 413: 8, 415: 3, 503: 14}


def _otlp_error(
    status: int, message: str, *, as_json: bool = False, retry_after_s: int | None = None
) -> Response:
    error = status_pb2.Status(code=_GRPC_CODES.get(status, 2), message=message)
    headers = {"retry-after": str(retry_after_s)} if retry_after_s is not None else None
    if as_json:
        return JSONResponse(json_format.MessageToDict(error), status_code=status, headers=headers)
    return Response(error.SerializeToString(), status_code=status, media_type=_PROTOBUF, headers=headers)


async def _read_body(request: Request) -> bytes:
    """The request body, decompressed, refusing anything over :data:`MAX_BODY_BYTES` (413)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise _HttpError(400, f"invalid Content-Length header {declared!r}")
        if int(declared) > MAX_BODY_BYTES:
            raise _HttpError(
                413, f"body of {declared} bytes is over the {MAX_BODY_BYTES}-byte limit", "too_large"
            )
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _HttpError(413, f"body is over the {MAX_BODY_BYTES}-byte limit", "too_large")
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise _HttpError(415, f"unsupported Content-Encoding {encoding!r}; send gzip, deflate or none")
    try:
        decompressor = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        out = decompressor.decompress(body, MAX_BODY_BYTES + 1)
    except zlib.error as exc:
        raise _HttpError(400, f"body is not valid {encoding} data: {exc}") from None
    if len(out) > MAX_BODY_BYTES:
        raise _HttpError(413, f"decompressed body is over the {MAX_BODY_BYTES}-byte limit", "too_large")
    if not decompressor.eof:
        raise _HttpError(400, f"{encoding} body is truncated")
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send finite numbers (or null)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range for a number; send finite numbers (or null)")
    return value


def _finite_json(body: bytes) -> Any:
    """Parse a JSON body, refusing NaN, Infinity and numbers too large for a double anywhere in it: JSON
    has no such numbers, and a stored one could never be sent back."""
    try:
        data = json.loads(body, parse_constant=_no_constant, parse_float=_finite_float)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _HttpError(400, f"invalid JSON body: {exc}") from None
    except RecursionError:
        raise _HttpError(400, "invalid JSON body: nested too deeply") from None
    if b"\\u" in body:  # only an escape can spell a lone surrogate in valid UTF-8
        where = lone_surrogate_at(data)
        if where is not None:
            raise _HttpError(
                400,
                f"invalid JSON body: {where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff"
                " escape), which is not text; send valid Unicode",
            )
    return data


async def _json_body(request: Request, model: type[pydantic.BaseModel]) -> Any:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise _HttpError(415, f"send the body as application/json, not {ctype or 'no content type'!r}")
    data = _finite_json(await _read_body(request))
    try:
        return model.model_validate(data, strict=False)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise _HttpError(400, f"invalid request body: {problems}") from None


async def _route_not_found(request: Request, exc: Exception) -> Response:
    return _error(404, f"no endpoint {request.url.path!r}; see the API list in docs/store.md", "not_found")


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    allowed = dict(getattr(exc, "headers", None) or {})
    methods = allowed.get("Allow", "another method")
    response = _error(
        405,
        f"{request.method} is not allowed on {request.url.path}; use {methods}",
        "method_not_allowed",
    )
    response.headers.update(allowed)
    return response


def _path_id(request: Request, name: str) -> str:
    value = str(request.path_params[name])
    if not value or len(value) > 512 or "\x00" in value:
        raise _HttpError(400, f"invalid {name.replace('_', ' ')} {value[:80]!r} in the path")
    return value


class _StoreAPI:
    """The store's HTTP endpoints over one store (see :func:`create_store_app`): OTLP ingest, the rollout
    queue, spans, late rewards and resources, each answering its errors as JSON."""

    def __init__(
        self, store: Store, *, token: str | None, ingest: IngestPipeline, redactor: Redactor | None
    ) -> None:
        self.store, self.token, self.ingest = store, token, ingest
        self.clean = redactor if redactor else None

    def redacted(self, value: Any) -> Any:
        return value if self.clean is None else self.clean.redact_json(value)

    def authorized(self, request: Request) -> bool:
        if self.token is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    def api(self, handler: _Handler) -> _Handler:
        async def endpoint(request: Request) -> Response:
            if not self.authorized(request):
                return _error(
                    401,
                    "missing or wrong bearer token (Authorization: Bearer <token>)",
                    "unauthorized",
                )
            try:
                return await handler(request)
            except _HttpError as exc:
                return _error(exc.status, str(exc), exc.kind)
            except NotFoundError as exc:
                return _error(404, str(exc), "not_found")
            except StoreUnavailableError as exc:
                response = _error(503, f"the store cannot answer now: {exc}; retry later", "unavailable")
                response.headers["retry-after"] = "1"
                return response
            except StoreError as exc:
                return _error(409, str(exc), "conflict")

        return endpoint

    async def ingest_traces(self, request: Request) -> Response:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        as_json = ctype == "application/json"
        if not self.authorized(request):
            return _otlp_error(
                401,
                "missing or wrong bearer token (Authorization: Bearer <token>)",
                as_json=as_json,
            )
        if ctype != _PROTOBUF and not as_json:
            return _otlp_error(
                415,
                f"content type {ctype or '(none)'!r} is not supported; send {_PROTOBUF} or application/json",
            )
        try:
            body = await _read_body(request)
            if self.ingest.has_workers:
                batch = await asyncio.wrap_future(self.ingest.ingest_async(body, json_body=as_json))
            else:
                parsed = await run_in_threadpool(self.ingest.parse_admitted, body, json_body=as_json)
                batch = await asyncio.wrap_future(self.ingest.write_async(parsed))
        except _HttpError as exc:
            return _otlp_error(exc.status, str(exc), as_json=as_json)
        except OtlpDecodeError as exc:
            return _otlp_error(400, str(exc), as_json=as_json)
        except Overloaded as exc:
            return _otlp_error(503, str(exc), as_json=as_json, retry_after_s=exc.retry_after_s)
        except StoreError as exc:
            return _otlp_error(
                503, f"the store could not write the spans: {exc}", as_json=as_json, retry_after_s=1
            )
        if as_json:
            body_json: dict[str, Any] = {}
            if batch.rejected:
                body_json["partialSuccess"] = {
                    "rejectedSpans": str(batch.rejected),
                    "errorMessage": batch.error_message,
                }
            return JSONResponse(body_json)
        return Response(encode_export_response(batch.rejected, batch.error_message), media_type=_PROTOBUF)

    async def observed(self, request: Request) -> Response:
        body = await _json_body(request, _ObservedIn)
        requests = [r.model_dump() for r in body.rollouts]
        for request_ in requests:
            request_["input"] = self.redacted(request_["input"])
            request_["metadata"] = self.redacted(request_["metadata"])
        rollouts = await run_in_threadpool(self.store.add_observed_rollouts, requests)
        return JSONResponse({"rollouts": [wire.rollout_to_json(r) for r in rollouts]})

    async def enqueue(self, request: Request) -> Response:
        body = await _json_body(request, _EnqueueIn)
        requests = [r.model_dump() for r in body.rollouts]
        for request_ in requests:
            request_["input"] = self.redacted(request_["input"])
            request_["metadata"] = self.redacted(request_["metadata"])
        rollouts = await run_in_threadpool(self.store.enqueue_rollouts, requests)
        return JSONResponse({"rollouts": [wire.rollout_to_json(r) for r in rollouts]})

    async def dequeue(self, request: Request) -> Response:
        body = await _json_body(request, _DequeueIn)
        claimed = await run_in_threadpool(
            lambda: self.store.dequeue_rollout(body.worker_id, lease_s=body.lease_s)
        )
        if claimed is None:
            return Response(status_code=204)
        rollout, attempt = claimed
        try:
            return JSONResponse(
                {"rollout": wire.rollout_to_json(rollout), "attempt": wire.attempt_to_json(attempt)}
            )
        except (TypeError, ValueError) as exc:
            # A value stored before the store refused it (NaN, say) cannot be sent: the claim is undone
            # by failing the attempt, so no runner holds it and no later dequeue picks it again.
            reason = f"the stored rollout cannot be sent as JSON ({exc}); it was marked failed"
            await run_in_threadpool(
                lambda: self.store.complete_attempt(attempt.attempt_id, RolloutStatus.FAILED, error=reason)
            )
            return _error(409, f"rollout {rollout.rollout_id}: {reason}", "conflict")

    async def query_rollouts(self, request: Request) -> Response:
        body = await _json_body(request, _RolloutQueryIn)
        rollouts = await run_in_threadpool(self.store.get_rollouts, body.rollout_ids)
        return JSONResponse({"rollouts": [wire.rollout_to_json(r) for r in rollouts]})

    async def list_rollouts(self, request: Request) -> Response:
        body = await _json_body(request, _ListIn)
        page = await run_in_threadpool(
            lambda: self.store.list_rollouts(body.filter(), before=body.before, limit=body.limit)
        )
        return JSONResponse(wire.page_to_json(page))

    async def cancel(self, request: Request) -> Response:
        body = await _json_body(request, _RolloutQueryIn)
        rollouts = await run_in_threadpool(self.store.cancel_rollouts, body.rollout_ids)
        return JSONResponse({"rollouts": [wire.rollout_to_json(r) for r in rollouts]})

    async def consumed(self, request: Request) -> Response:
        body = await _json_body(request, _RolloutQueryIn)
        return JSONResponse({"marked": await run_in_threadpool(self.store.mark_consumed, body.rollout_ids)})

    async def merge(self, request: Request) -> Response:
        body = await _json_body(request, _MergeIn)
        return JSONResponse({"moved": await run_in_threadpool(self.store.merge_rollouts, body.moves)})

    async def heartbeat(self, request: Request) -> Response:
        _path_id(request, "attempt_id")
        body = await _json_body(request, _HeartbeatIn)
        attempt = await run_in_threadpool(
            lambda: self.store.heartbeat(request.path_params["attempt_id"], lease_s=body.lease_s)
        )
        return JSONResponse({"attempt": wire.attempt_to_json(attempt)})

    async def complete(self, request: Request) -> Response:
        _path_id(request, "attempt_id")
        body = await _json_body(request, _CompleteIn)
        rollout = await run_in_threadpool(
            lambda: self.store.complete_attempt(
                request.path_params["attempt_id"],
                RolloutStatus(body.status),
                reward=body.reward,
                error=self.redacted(body.error),
            )
        )
        return JSONResponse({"rollout": wire.rollout_to_json(rollout)})

    async def query_spans(self, request: Request) -> Response:
        body = await _json_body(request, _SpanQueryIn)
        page = getattr(self.store, "span_page", None)
        if page is None:  # a store without byte-bounded pages: its pages as they are

            def page(max_bytes: int, **query: Any) -> tuple[list[Any], bool]:
                return self.store.query_spans(**query), False

        spans, more = await run_in_threadpool(
            lambda: page(
                rollout_ids=body.rollout_ids,
                attempt_id=body.attempt_id,
                trace_id=body.trace_id,
                start_after_ns=body.start_after_ns,
                start_before_ns=body.start_before_ns,
                after_seq=body.after_seq,
                limit=body.limit,
                max_bytes=QUERY_PAGE_BYTES,
            )
        )
        return JSONResponse({"spans": [wire.span_to_json(s) for s in spans], "more": more})

    async def add_rewards(self, request: Request) -> Response:
        body = await _json_body(request, _RewardsIn)
        rewards = []
        for n, item in enumerate(body.rewards):
            try:
                reward = Reward.from_json(item.model_dump())
            except ValueError as exc:
                raise _HttpError(400, f"invalid request body: rewards.{n}.{exc}") from None
            if self.clean is not None:  # ids are never redacted; the name and source are
                kept = self.clean.redact_json(
                    {semconv.REWARD_NAME: reward.name, semconv.REWARD_SOURCE: reward.source}
                )
                if kept.get(semconv.REWARD_NAME) != reward.name:
                    raise _HttpError(
                        400,
                        f"invalid request body: rewards.{n}.name: {reward.name!r} matches the store's"
                        " redaction rules; name the reward without what they mask",
                    )
                reward = dataclasses.replace(reward, source=kept.get(semconv.REWARD_SOURCE, MASK))
            rewards.append(reward)
        try:  # the store refuses values outside its reward range, naming the field
            stored = await run_in_threadpool(self.store.add_rewards, rewards)
        except ValueError as exc:
            raise _HttpError(400, f"invalid request body: {exc}") from None
        return JSONResponse({"rewards": [s.to_json() for s in stored]})

    async def resource(self, request: Request) -> Response:
        name = _path_id(request, "name")
        if request.method == "PUT":
            body = await _json_body(request, _ResourceIn)
            published = await run_in_threadpool(
                lambda: self.store.put_resource(name, self.redacted(body.value), keep=body.keep)
            )
            return JSONResponse({"resource": wire.resource_to_json(published)})
        found = await run_in_threadpool(self.store.get_resource, name)
        if found is None:
            raise NotFoundError(f"no resource named {name!r}")
        return JSONResponse({"resource": wire.resource_to_json(found)})

    async def stats(self, request: Request) -> Response:
        out = await run_in_threadpool(self.store.stats)
        out["ingest_refused_requests"] = self.ingest.refused_requests
        return JSONResponse(out)

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"ok": True})

    def routes(self) -> list[Route]:
        return [
            Route("/v1/traces", self.ingest_traces, methods=["POST"]),
            Route("/api/rollouts", self.api(self.enqueue), methods=["POST"]),
            Route("/api/rollouts/dequeue", self.api(self.dequeue), methods=["POST"]),
            Route("/api/rollouts/query", self.api(self.query_rollouts), methods=["POST"]),
            Route("/api/rollouts/list", self.api(self.list_rollouts), methods=["POST"]),
            Route("/api/rollouts/cancel", self.api(self.cancel), methods=["POST"]),
            Route("/api/rollouts/consumed", self.api(self.consumed), methods=["POST"]),
            Route("/api/rollouts/observed", self.api(self.observed), methods=["POST"]),
            Route("/api/rollouts/merge", self.api(self.merge), methods=["POST"]),
            Route("/api/attempts/{attempt_id}/heartbeat", self.api(self.heartbeat), methods=["POST"]),
            Route("/api/attempts/{attempt_id}/complete", self.api(self.complete), methods=["POST"]),
            Route("/api/spans/query", self.api(self.query_spans), methods=["POST"]),
            Route("/api/rewards", self.api(self.add_rewards), methods=["POST"]),
            Route("/api/resources/{name}", self.api(self.resource), methods=["GET", "PUT"]),
            Route("/api/stats", self.api(self.stats), methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
        ]


def create_store_app(
    store: Store,
    *,
    token: str | None = None,
    pipeline: IngestPipeline | None = None,
    redactor: Redactor | None = None,
) -> Starlette:
    """The ASGI app serving ``store``. With ``token``, every endpoint but ``/healthz`` needs
    ``Authorization: Bearer <token>``. Spans are written through ``pipeline`` (one is made if not
    given, with ``redactor``; ``app.state.pipeline`` holds it). ``redactor`` also applies to what the
    API writes: rollout inputs and metadata, resource values and attempt errors."""
    ingest = pipeline or IngestPipeline(store, redactor=redactor)
    api = _StoreAPI(store, token=token, ingest=ingest, redactor=redactor)
    app = Starlette(
        routes=api.routes(),
        exception_handlers={404: _route_not_found, 405: _method_not_allowed},
    )
    app.state.pipeline = ingest
    return app
