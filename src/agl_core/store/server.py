"""The collector-store's HTTP server: OTLP/HTTP span ingest and the coordination API.

Endpoints (JSON unless noted):

=============================================  ==============================================================
``POST /v1/traces``                            OTLP/HTTP, ``application/x-protobuf``, optionally gzip-encoded
``POST /api/rollouts``                         enqueue ``{"rollouts": [{task_id, input, group_id?, ...}]}``
``POST /api/rollouts/dequeue``                 ``{"worker_id"}`` -> ``{"rollout", "attempt"}`` or 204
``POST /api/rollouts/query``                   ``{"rollout_ids": [...]}`` -> ``{"rollouts": [...]}``
``POST /api/attempts/{attempt_id}/complete``   ``{"status", "reward"?, "error"?}`` -> ``{"rollout"}``
``POST /api/spans/query``                      ``{"rollout_ids"?, "trace_id"?, "after_seq"?, "limit"?}``
``PUT /api/resources/{name}``                  ``{"value"}`` -> ``{"resource"}`` (a new version)
``GET /api/resources/{name}``                  the latest version
``GET /api/stats``, ``GET /healthz``
=============================================  ==============================================================

Errors are JSON ``{"error": {"message", "type"}}`` with a 4xx status, except on ``/v1/traces`` where the
OTLP specification asks for a protobuf ``google.rpc.Status`` body.
"""

from __future__ import annotations

import hmac
import zlib
from typing import Any, Literal

import pydantic
from google.rpc import status_pb2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..records import RolloutStatus
from . import _wire
from ._otlp import OtlpDecodeError, decode_export_request, encode_export_response
from .base import NotFoundError, Store, StoreError

__all__ = ["create_store_app", "MAX_BODY_BYTES"]

#: Largest request body accepted, after decompression (413 beyond it).
MAX_BODY_BYTES = 32 * 1024 * 1024
_PROTOBUF = "application/x-protobuf"


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


class _RolloutIn(_Strict):
    task_id: str = pydantic.Field(min_length=1, max_length=512)
    input: Any = None
    group_id: str | None = pydantic.Field(default=None, max_length=512)
    rollout_id: str | None = pydantic.Field(default=None, min_length=1, max_length=128)
    metadata: dict[str, Any] = {}
    max_attempts: int = pydantic.Field(default=1, ge=1, le=100)


class _EnqueueIn(_Strict):
    rollouts: list[_RolloutIn] = pydantic.Field(min_length=1, max_length=100_000)


class _DequeueIn(_Strict):
    worker_id: str = pydantic.Field(min_length=1, max_length=256)


class _RolloutQueryIn(_Strict):
    rollout_ids: list[str] = pydantic.Field(max_length=100_000)


class _CompleteIn(_Strict):
    status: Literal["succeeded", "failed", "timed_out", "cancelled"]
    reward: float | None = pydantic.Field(default=None, allow_inf_nan=False)
    error: str | None = pydantic.Field(default=None, max_length=65_536)


class _SpanQueryIn(_Strict):
    rollout_ids: list[str] | None = pydantic.Field(default=None, max_length=100_000)
    trace_id: str | None = pydantic.Field(default=None, pattern=r"^[0-9a-f]{32}$")
    after_seq: int = pydantic.Field(default=0, ge=0)
    limit: int = pydantic.Field(default=10_000, ge=1, le=100_000)


class _ResourceIn(_Strict):
    value: Any


class _HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def _otlp_error(status: int, message: str) -> Response:
    body = status_pb2.Status(code=3 if status == 400 else 8, message=message).SerializeToString()
    return Response(body, status_code=status, media_type=_PROTOBUF)


async def _read_body(request: Request) -> bytes:
    """The request body, decompressed, refusing anything over :data:`MAX_BODY_BYTES` (413)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise _HttpError(400, f"invalid Content-Length header {declared!r}")
        if int(declared) > MAX_BODY_BYTES:
            raise _HttpError(413, f"body of {declared} bytes is over the {MAX_BODY_BYTES}-byte limit", "too_large")
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


async def _json_body(request: Request, model: type[pydantic.BaseModel]) -> Any:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise _HttpError(415, f"send the body as application/json, not {ctype or 'no content type'!r}")
    body = await _read_body(request)
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise _HttpError(400, f"invalid request body: {problems}") from None


def create_store_app(store: Store, *, token: str | None = None) -> Starlette:
    """The ASGI app serving ``store``. With ``token``, every endpoint but ``/healthz`` needs
    ``Authorization: Bearer <token>``."""

    def authorized(request: Request) -> bool:
        if token is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

    def api(handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            if not authorized(request):
                return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)", "unauthorized")
            try:
                return await handler(request)
            except _HttpError as exc:
                return _error(exc.status, str(exc), exc.kind)
            except NotFoundError as exc:
                return _error(404, str(exc), "not_found")
            except StoreError as exc:
                return _error(409, str(exc), "conflict")

        return endpoint

    async def ingest_traces(request: Request) -> Response:
        if not authorized(request):
            return _otlp_error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != _PROTOBUF:
            return _otlp_error(415, f"content type {ctype or '(none)'!r} is not supported; send {_PROTOBUF}")
        try:
            body = await _read_body(request)
            result = await run_in_threadpool(decode_export_request, body)
        except _HttpError as exc:
            return _otlp_error(exc.status, str(exc))
        except OtlpDecodeError as exc:
            return _otlp_error(400, str(exc))
        if result.spans:
            await run_in_threadpool(store.add_spans, result.spans)
        return Response(encode_export_response(result.rejected, result.error_message), media_type=_PROTOBUF)

    async def enqueue(request: Request) -> Response:
        body = await _json_body(request, _EnqueueIn)
        rollouts = await run_in_threadpool(store.enqueue_rollouts, [r.model_dump() for r in body.rollouts])
        return JSONResponse({"rollouts": [_wire.rollout_to_json(r) for r in rollouts]})

    async def dequeue(request: Request) -> Response:
        body = await _json_body(request, _DequeueIn)
        claimed = await run_in_threadpool(store.dequeue_rollout, body.worker_id)
        if claimed is None:
            return Response(status_code=204)
        rollout, attempt = claimed
        return JSONResponse({"rollout": _wire.rollout_to_json(rollout), "attempt": _wire.attempt_to_json(attempt)})

    async def query_rollouts(request: Request) -> Response:
        body = await _json_body(request, _RolloutQueryIn)
        rollouts = await run_in_threadpool(store.get_rollouts, body.rollout_ids)
        return JSONResponse({"rollouts": [_wire.rollout_to_json(r) for r in rollouts]})

    async def complete(request: Request) -> Response:
        body = await _json_body(request, _CompleteIn)
        rollout = await run_in_threadpool(
            lambda: store.complete_attempt(
                request.path_params["attempt_id"], RolloutStatus(body.status), reward=body.reward, error=body.error
            )
        )
        return JSONResponse({"rollout": _wire.rollout_to_json(rollout)})

    async def query_spans(request: Request) -> Response:
        body = await _json_body(request, _SpanQueryIn)
        spans = await run_in_threadpool(
            lambda: store.query_spans(
                rollout_ids=body.rollout_ids, trace_id=body.trace_id, after_seq=body.after_seq, limit=body.limit
            )
        )
        return JSONResponse({"spans": [_wire.span_to_json(s) for s in spans]})

    async def resource(request: Request) -> Response:
        name = request.path_params["name"]
        if request.method == "PUT":
            body = await _json_body(request, _ResourceIn)
            published = await run_in_threadpool(store.put_resource, name, body.value)
            return JSONResponse({"resource": _wire.resource_to_json(published)})
        found = await run_in_threadpool(store.get_resource, name)
        if found is None:
            raise NotFoundError(f"no resource named {name!r}")
        return JSONResponse({"resource": _wire.resource_to_json(found)})

    async def stats(request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(store.stats))

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    return Starlette(
        routes=[
            Route("/v1/traces", ingest_traces, methods=["POST"]),
            Route("/api/rollouts", api(enqueue), methods=["POST"]),
            Route("/api/rollouts/dequeue", api(dequeue), methods=["POST"]),
            Route("/api/rollouts/query", api(query_rollouts), methods=["POST"]),
            Route("/api/attempts/{attempt_id}/complete", api(complete), methods=["POST"]),
            Route("/api/spans/query", api(query_spans), methods=["POST"]),
            Route("/api/resources/{name}", api(resource), methods=["GET", "PUT"]),
            Route("/api/stats", api(stats), methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
        ]
    )

