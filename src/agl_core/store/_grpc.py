"""OTLP/gRPC receiver (``opentelemetry.proto.collector.trace.v1.TraceService/Export``).

Requests arrive as raw bytes and go through the same pipeline as OTLP/HTTP. gRPC handles gzip itself.
A full backlog answers ``UNAVAILABLE`` (retryable for OTLP exporters); an undecodable request
``INVALID_ARGUMENT``; a missing or wrong bearer token ``UNAUTHENTICATED``.
"""

from __future__ import annotations

import hmac
from concurrent import futures
from typing import Any

from .base import StoreError
from .formats.otlp import OtlpDecodeError, encode_export_response
from .ingest import IngestPipeline, Overloaded

__all__ = ["start_grpc_server"]

_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
MAX_MESSAGE_BYTES = 32 * 1024 * 1024


def start_grpc_server(
    pipeline: IngestPipeline,
    host: str = "127.0.0.1",
    port: int = 4317,
    *,
    token: str | None = None,
    workers: int = 16,
) -> tuple[Any, int]:
    """Start the receiver; returns ``(server, bound_port)``. Stop it with ``server.stop(grace)``."""
    try:
        import grpc
    except ImportError:
        raise ImportError("the OTLP/gRPC receiver needs grpcio: pip install grpcio") from None

    expected = f"Bearer {token}".encode() if token is not None else None

    def export(body: bytes, context: Any) -> bytes:
        if expected is not None:
            given = dict(context.invocation_metadata()).get("authorization", "")
            if not hmac.compare_digest(str(given).encode(), expected):
                context.abort(
                    grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (authorization metadata)"
                )
        try:
            batch = pipeline.ingest_async(body).result()
        except OtlpDecodeError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except StoreError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the store could not write the spans: {exc}")
        return encode_export_response(batch.rejected, batch.error_message)

    handler = grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService",
        {"Export": grpc.unary_unary_rpc_method_handler(export)},
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agl-otlp-grpc"),
        handlers=[handler],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # a second server on a busy port must fail, not silently share it
            ("grpc.so_reuseport", 0),
        ],
    )
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:  # grpcio >= 1.60 raises instead of returning 0
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} for OTLP/gRPC; pick another port")
    server.start()
    return server, bound
