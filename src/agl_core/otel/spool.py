"""An OTLP/HTTP span exporter that keeps what it could not deliver: spans the store has not acknowledged
wait in a bounded spool (in memory, or in a directory that survives a restart) and are retried with
backoff until the store takes them.

The OpenTelemetry SDK's own OTLP exporter gives a batch up after its export deadline, so a store that is
down for longer than that loses every span of the calls answered meanwhile. :class:`SpoolingSpanExporter`
answers ``export()`` at once whenever the spool holds nothing (a store that is up sees no difference, and
``force_flush()`` of a batch span processor still means "sent"); a batch that fails with a retryable error
(connection refused or reset, a timeout, 408, 429, 5xx) joins the spool, and so does every later batch
while the spool is not empty, so batches reach the store in the order they were exported. A sender thread
retries the oldest batch, waiting ``retry_s`` seconds after a failure, doubling up to ``max_retry_s``.

Batches are split by bytes before they are sent (``batch_bytes`` each, never more than the store's
request limit), so one large span cannot make the store refuse the spans exported beside it; a span that
alone is over ``max_request_bytes`` cannot be stored and is dropped, counted and logged. The spool holds at
most ``max_spool_bytes``: a batch that would pass the bound is dropped (the newest data, as the
OpenTelemetry Collector's persistent queue refuses it), counted and logged. A batch the store refuses for
good (400, 401, 403, 413 ...) is dropped the same way, with the store's answer in the log.

With ``spool_dir``, each spooled batch is a file there (written whole, then renamed), removed once
acknowledged; batches left by an earlier process are sent first. ``stats()`` and ``metric_rows()`` give
the counters: spans sent, queued (spans and bytes), dropped by reason, and failed attempts.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_MAX_SPOOL_BYTES",
    "SpoolStats",
    "SpoolingSpanExporter",
    "split_request",
]

logger = logging.getLogger(__name__)

#: Bytes of serialized spans per request the exporter aims for.
DEFAULT_BATCH_BYTES = 4 * 1024 * 1024
#: The largest request it sends: under the store's 32 MiB body limit, with room for its framing.
DEFAULT_MAX_REQUEST_BYTES = 31 * 1024 * 1024
#: What the spool may hold before it drops new batches.
DEFAULT_MAX_SPOOL_BYTES = 256 * 1024 * 1024

_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_SUFFIX = ".otlp"
#: Bytes a message's tag and length add (an upper bound for anything under 2**28 bytes).
_FRAMING = 6


@dataclasses.dataclass(frozen=True)
class SpoolStats:
    """Counters of a :class:`SpoolingSpanExporter` (spans, except where named bytes)."""

    sent: int
    queued: int
    queued_bytes: int
    #: Dropped spans by reason: ``spool_full``, ``span_too_large``, ``refused_<HTTP status>``,
    #: ``shutdown`` (still queued in memory when the process ended), ``encode_error``.
    dropped: dict[str, int]
    #: Attempts to send a spooled batch that failed and will be retried.
    retries: int


@dataclasses.dataclass
class _Batch:
    spans: int
    size: int
    data: bytes | None  # None: in ``path``
    path: Path | None

    def payload(self) -> bytes:
        if self.data is not None:
            return self.data
        assert self.path is not None
        return self.path.read_bytes()


def split_request(
    request: Any, batch_bytes: int, max_request_bytes: int
) -> tuple[list[tuple[Any, int]], int]:
    """``request`` (an ``ExportTraceServiceRequest``) as requests of about ``batch_bytes`` serialized
    bytes each, with their span counts, and the number of spans left out because a request holding only
    that span would still be over ``max_request_bytes``. Resources and scopes are repeated in every
    request that holds their spans; span order is kept."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    out: list[tuple[Any, int]] = []
    current = ExportTraceServiceRequest()
    size = count = oversize = 0
    open_resource: Any = None  # (source ResourceSpans, its copy in ``current``)
    open_scope: Any = None

    def close() -> None:
        nonlocal current, size, count, open_resource, open_scope
        if count:
            out.append((current, count))
        current = ExportTraceServiceRequest()
        size = count = 0
        open_resource = open_scope = None

    for resource_spans in request.resource_spans:
        resource_head = resource_spans.resource.ByteSize() + len(resource_spans.schema_url) + 3 * _FRAMING
        for scope_spans in resource_spans.scope_spans:
            scope_head = scope_spans.scope.ByteSize() + len(scope_spans.schema_url) + 3 * _FRAMING
            for span in scope_spans.spans:
                span_size = span.ByteSize() + _FRAMING
                if span_size + resource_head + scope_head > max_request_bytes:
                    oversize += 1
                    continue
                extra = span_size
                if open_resource is None or open_resource[0] is not resource_spans:
                    extra += resource_head + scope_head
                elif open_scope is None or open_scope[0] is not scope_spans:
                    extra += scope_head
                if count and size + extra > batch_bytes:
                    close()
                    extra = span_size + resource_head + scope_head
                if open_resource is None or open_resource[0] is not resource_spans:
                    target = current.resource_spans.add()
                    target.resource.CopyFrom(resource_spans.resource)
                    target.schema_url = resource_spans.schema_url
                    open_resource, open_scope = (resource_spans, target), None
                if open_scope is None or open_scope[0] is not scope_spans:
                    scope_target = open_resource[1].scope_spans.add()
                    scope_target.scope.CopyFrom(scope_spans.scope)
                    scope_target.schema_url = scope_spans.schema_url
                    open_scope = (scope_spans, scope_target)
                open_scope[1].spans.add().CopyFrom(span)
                size += extra
                count += 1
    close()
    return out, oversize


class _Refused(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status = status


class SpoolingSpanExporter(SpanExporter):
    """Sends spans to ``endpoint`` (a ``.../v1/traces`` URL) as OTLP/HTTP protobuf, spooling what the
    store has not acknowledged (see the module docstring). Thread-safe."""

    def __init__(
        self,
        endpoint: str,
        *,
        token: str | None = None,
        timeout_s: float = 10.0,
        spool_dir: str | os.PathLike[str] | None = None,
        max_spool_bytes: int = DEFAULT_MAX_SPOOL_BYTES,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        retry_s: float = 0.5,
        max_retry_s: float = 30.0,
    ) -> None:
        for name, value in (
            ("max_spool_bytes", max_spool_bytes),
            ("batch_bytes", batch_bytes),
            ("max_request_bytes", max_request_bytes),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if timeout_s <= 0 or retry_s <= 0 or max_retry_s < retry_s:
            raise ValueError("timeout_s and retry_s must be > 0, and max_retry_s at least retry_s")
        import httpx

        self.endpoint = endpoint
        headers = {"content-type": "application/x-protobuf"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._client = httpx.Client(headers=headers, timeout=timeout_s)
        self._max_spool_bytes = max_spool_bytes
        self._batch_bytes = min(batch_bytes, max_request_bytes)
        self._max_request_bytes = max_request_bytes
        self._retry_s, self._max_retry_s = retry_s, max_retry_s
        self._lock = threading.Condition()
        self._queue: collections.deque[_Batch] = collections.deque()
        self._queued_bytes = 0
        self._sent = 0
        self._retries = 0
        self._dropped: collections.Counter[str] = collections.Counter()
        self._sending = False  # the sender thread holds the oldest batch
        self._closed = False
        self._wake = threading.Event()  # new data while idle
        self._kick = threading.Event()  # flush or shutdown: retry now
        self._seq = 0
        self._dir: Path | None = None
        if spool_dir is not None:
            self._dir = Path(spool_dir)
            self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._load_spooled()
        self._thread: threading.Thread | None = None  # started when a batch is first spooled
        if self._queue:
            self._start_sender()

    # --- SpanExporter ---------------------------------------------------------------------------------
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        if self._closed:
            self._drop("shutdown", len(spans), "the exporter is shut down")
            return SpanExportResult.FAILURE
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        try:
            requests, oversize = split_request(
                encode_spans(spans), self._batch_bytes, self._max_request_bytes
            )
        except Exception as exc:  # noqa: BLE001 - a span the encoder cannot take is dropped, not raised
            self._drop("encode_error", len(spans), f"cannot encode: {exc}")
            return SpanExportResult.FAILURE
        if oversize:
            self._drop(
                "span_too_large",
                oversize,
                f"a span is over the {self._max_request_bytes}-byte request limit on its own",
            )
        for request, count in requests:
            data = request.SerializeToString()
            with self._lock:
                direct = not self._queue and not self._sending
            if direct:
                try:
                    self._post(data)
                except _Refused as exc:
                    if exc.status in _RETRYABLE_STATUS:
                        self._enqueue(data, count)
                    else:
                        self._drop(f"refused_{exc.status}", count, f"the store refused them: {exc}")
                    continue
                except Exception:  # noqa: BLE001 - connection refused, reset, timed out: keep and retry
                    self._enqueue(data, count)
                    continue
                with self._lock:
                    self._sent += count
            else:
                self._enqueue(data, count)
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Wait until the spool is empty (``True``) or ``timeout_millis`` passed (``False``)."""
        deadline = time.monotonic() + timeout_millis / 1000
        with self._lock:
            self._kick.set()
            while self._queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.1))
        return True

    def shutdown(self, timeout_millis: int = 30_000) -> None:
        """Send what the spool holds (for at most ``timeout_millis``: 2 s with a ``spool_dir``, 5 s in
        memory), then stop. What is left stays in ``spool_dir`` for the next process, or (in memory) is
        counted as dropped and logged."""
        if self._closed:
            return
        # A spool directory keeps what is left, so shutdown waits briefly; in memory it is lost after.
        flushed = self.force_flush(min(timeout_millis, 2_000 if self._dir is not None else 5_000))
        with self._lock:
            self._closed = True
            self._wake.set()
            self._kick.set()
            left = [b for b in self._queue if b.path is None]
            kept = [b for b in self._queue if b.path is not None]
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, self._retry_s * 2))
        if not flushed and left:
            self._drop("shutdown", sum(b.spans for b in left), "the store did not take them before shutdown")
        if kept:
            logger.warning(
                "agl: %d span(s) the store has not acknowledged stay in %s; they are sent when an exporter"
                " with this spool_dir starts again",
                sum(b.spans for b in kept),
                self._dir,
            )
        self._client.close()

    # --- counters -------------------------------------------------------------------------------------
    def stats(self) -> SpoolStats:
        with self._lock:
            return SpoolStats(
                sent=self._sent,
                queued=sum(b.spans for b in self._queue),
                queued_bytes=self._queued_bytes,
                dropped=dict(self._dropped),
                retries=self._retries,
            )

    def metric_rows(self) -> list[tuple[str, str, str, int]]:
        """``(name, kind, help, value)`` rows for a Prometheus page."""
        stats = self.stats()
        return [
            ("agl_spans_sent_total", "counter", "Spans the store acknowledged.", stats.sent),
            ("agl_spans_queued", "gauge", "Spans waiting in the spool for the store.", stats.queued),
            ("agl_spans_queued_bytes", "gauge", "Bytes of spans waiting in the spool.", stats.queued_bytes),
            (
                "agl_spans_dropped_total",
                "counter",
                "Spans dropped (spool full, a span over the request limit, refused by the store).",
                sum(stats.dropped.values()),
            ),
            ("agl_span_send_retries_total", "counter", "Failed sends that will be retried.", stats.retries),
        ]

    # --- internals ------------------------------------------------------------------------------------
    def _post(self, data: bytes) -> None:
        response = self._client.post(self.endpoint, content=data)
        if response.status_code >= 300:
            raise _Refused(response.status_code, response.text)

    def _drop(self, reason: str, spans: int, why: str) -> None:
        with self._lock:
            self._dropped[reason] += spans
            total = sum(self._dropped.values())
        logger.error(
            "agl: dropped %d span(s) for %s: %s (%d dropped so far)", spans, self.endpoint, why, total
        )

    def _enqueue(self, data: bytes, spans: int) -> None:
        with self._lock:
            if self._queued_bytes + len(data) > self._max_spool_bytes:
                full = True
            else:
                full = False
                path = None
                if self._dir is not None:
                    self._seq += 1
                    path = self._dir / f"{time.time_ns():020d}-{self._seq:06d}-{spans}{_SUFFIX}"
                    tmp = path.with_suffix(".tmp")
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                    os.replace(tmp, path)
                batch = _Batch(spans, len(data), None if path is not None else data, path)
                self._queue.append(batch)
                self._queued_bytes += len(data)
                self._wake.set()
                if self._thread is None:
                    self._start_sender()
        if full:
            self._drop(
                "spool_full",
                spans,
                f"the spool is full ({self._max_spool_bytes} bytes waiting for the store); raise its bound"
                " or bring the store back",
            )

    def _start_sender(self) -> None:
        self._thread = threading.Thread(target=self._run, name="agl-span-spool", daemon=True)
        self._thread.start()

    def _load_spooled(self) -> None:
        assert self._dir is not None
        for stale in self._dir.glob("*.tmp"):
            stale.unlink(missing_ok=True)  # a write cut short: never acknowledged to anyone
        for path in sorted(self._dir.glob(f"*{_SUFFIX}")):
            try:
                spans = int(path.stem.rsplit("-", 1)[1])
                size = path.stat().st_size
            except (IndexError, ValueError, OSError):
                logger.warning("agl: %s is not a spooled span batch; left alone", path)
                continue
            self._queue.append(_Batch(spans, size, None, path))
            self._queued_bytes += size
        if self._queue:
            logger.info(
                "agl: %d spooled span(s) from an earlier run to send", sum(b.spans for b in self._queue)
            )

    def _run(self) -> None:
        delay = self._retry_s
        while True:
            with self._lock:
                if self._closed:
                    return
                batch = self._queue[0] if self._queue else None
                self._sending = batch is not None
            if batch is None:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            outcome: str | None = None
            try:
                self._post(batch.payload())
                outcome = "sent"
            except _Refused as exc:
                if exc.status not in _RETRYABLE_STATUS:
                    outcome = f"refused_{exc.status}"
                    self._drop(outcome, batch.spans, f"the store refused them: {exc}")
            except OSError as exc:  # a spool file gone: nothing to send
                outcome = "lost"
                self._drop("spool_file", batch.spans, f"cannot read {batch.path}: {exc}")
            except Exception:  # noqa: BLE001 - the store still down
                outcome = None
            if outcome is None:
                with self._lock:
                    self._retries += 1
                    self._sending = False
                self._kick.wait(delay * (0.75 + random.random() / 2))
                self._kick.clear()
                delay = min(delay * 2, self._max_retry_s)
                continue
            delay = self._retry_s
            if batch.path is not None:
                batch.path.unlink(missing_ok=True)
            with self._lock:
                self._queue.popleft()
                self._queued_bytes -= batch.size
                if outcome == "sent":
                    self._sent += batch.spans
                self._sending = False
                self._lock.notify_all()
