"""Spans to a file that ``agl import`` reads: OTLP JSON lines, as the Collector's ``file`` exporter writes.

An agent, a gateway or any process with an OpenTelemetry tracer provider can keep its spans in a file
instead of sending them to a store (no network, a machine that cannot reach the store, an audit copy):

    provider.add_span_processor(BatchSpanProcessor(OtlpJsonLinesExporter("spans.jsonl")))

and ``agl import spans.jsonl --store STORE`` later. Each exported batch becomes one line holding an
``ExportTraceServiceRequest`` in the OTLP/JSON mapping: the SDK's own OTLP encoder, then protobuf's JSON
mapping with lowerCamelCase keys, hex trace and span ids, enums as numbers and 64-bit integers as strings.
The file is appended to and never read; nothing is sent anywhere else.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = ["OtlpJsonLinesExporter"]

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _hex_ids(obj: Any) -> Any:
    """protobuf's JSON mapping writes bytes as base64; OTLP/JSON writes trace and span ids as hex."""
    if isinstance(obj, dict):
        return {k: base64.b64decode(v).hex() if k in _ID_KEYS else _hex_ids(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_hex_ids(v) for v in obj]
    return obj


class OtlpJsonLinesExporter(SpanExporter):
    """Appends each exported batch of spans to ``path`` as one OTLP/JSON line (see the module).

    Safe to share between threads, and several exporters (of several tracer providers or processes) may
    append to the same file: each line goes to the operating system in one ``write`` on a file opened for
    appending, before :meth:`export` returns. The file is created with mode 0600 when it does not exist
    yet: spans may hold prompts and responses. After :meth:`shutdown`, exports fail."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._closed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        if self._closed:
            return SpanExportResult.FAILURE
        if not spans:
            return SpanExportResult.SUCCESS
        data = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
        line = (json.dumps(_hex_ids(data), separators=(",", ":"), ensure_ascii=False) + "\n").encode()
        try:
            with self._lock:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    view = memoryview(line)
                    while view:
                        view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._closed = True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
