"""The ingest pipeline shared by the OTLP/HTTP and OTLP/gRPC receivers.

Request bodies are decoded and validated in the request thread, or, with ``parse_workers``, in worker
processes so decoding runs beside the writer on another core. One writer thread commits whatever has
queued up since its last commit in a single transaction (group commit), then acknowledges every request
in it. The backlog is
bounded: past ``max_pending_spans`` a request is refused with :class:`Overloaded`, which the receivers
turn into the protocol's retryable answer (HTTP 503 + Retry-After, gRPC UNAVAILABLE). Nothing is
acknowledged before it is committed.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from ._otlp import ParsedBatch, decode_json, decode_protobuf, extract_rows
from .redact import Redactor

__all__ = ["IngestPipeline", "Overloaded"]

logger = logging.getLogger(__name__)


class Overloaded(Exception):
    """The store's write backlog is full; the sender should retry after ``retry_after_s``."""

    def __init__(self, pending: int, limit: int, retry_after_s: int = 1) -> None:
        super().__init__(
            f"the store is busy ({pending} spans waiting to be written, limit {limit}); retry later"
        )
        self.retry_after_s = retry_after_s


def _parse(body: bytes, json_body: bool, redactor: Redactor | None) -> ParsedBatch:
    request = decode_json(body) if json_body else decode_protobuf(body)
    return extract_rows(request, redactor)


class IngestPipeline:
    def __init__(
        self,
        store: Any,
        *,
        redactor: Redactor | None = None,
        max_pending_spans: int = 200_000,
        max_commit_spans: int = 20_000,
        parse_workers: int = 0,
    ) -> None:
        if max_pending_spans < 1 or max_commit_spans < 1:
            raise ValueError("max_pending_spans and max_commit_spans must be >= 1")
        if parse_workers < 0:
            raise ValueError("parse_workers must be >= 0")
        self.store = store
        self.redactor = redactor if redactor else None
        # spawn, not fork: the server process runs threads (gRPC, uvicorn) that must not be forked.
        self._pool = (
            ProcessPoolExecutor(parse_workers, mp_context=multiprocessing.get_context("spawn"))
            if parse_workers
            else None
        )
        self.max_pending_spans = max_pending_spans
        self.max_commit_spans = max_commit_spans
        self._queue: queue.Queue[tuple[ParsedBatch, Future[int]] | None] = queue.Queue()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.refused_requests = 0

    @property
    def has_workers(self) -> bool:
        return self._pool is not None

    def parse(self, body: bytes, *, json_body: bool = False) -> ParsedBatch:
        """Decode and validate a request body (raises ``OtlpDecodeError``) in the calling thread."""
        return _parse(body, json_body, self.redactor)

    def parse_async(self, body: bytes, *, json_body: bool = False) -> Future[ParsedBatch]:
        """Like :meth:`parse`, in a worker process when the pipeline has them (small bodies stay here:
        shipping them costs more than decoding them)."""
        if self._pool is None or len(body) < 16_384:
            done: Future[ParsedBatch] = Future()
            try:
                done.set_result(self.parse(body, json_body=json_body))
            except BaseException as exc:
                done.set_exception(exc)
            return done
        return self._pool.submit(_parse, body, json_body, self.redactor)

    def submit(self, batch: ParsedBatch) -> Future[int]:
        """Queue a parsed batch for writing; the future resolves (to the count of new spans) once it is
        committed. Raises :class:`Overloaded` when the backlog is full."""
        done: Future[int] = Future()
        if not batch.rows:
            done.set_result(0)
            return done
        with self._pending_lock:
            if self._pending and self._pending + len(batch.rows) > self.max_pending_spans:
                self.refused_requests += 1
                raise Overloaded(self._pending, self.max_pending_spans)
            self._pending += len(batch.rows)
        self._ensure_writer()
        self._queue.put((batch, done))
        return done

    def _ensure_writer(self) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._write_loop, name="agl-store-writer", daemon=True
                    )
                    self._thread.start()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            items = [item]
            size = len(item[0].rows)
            stop = False
            while size < self.max_commit_spans:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                items.append(more)
                size += len(more[0].rows)
            self._commit(items, size)
            if stop:
                return

    def _commit(self, items: list[tuple[ParsedBatch, Future[int]]], size: int) -> None:
        rows = [row for batch, _ in items for row in batch.rows]
        scopes: dict[bytes, tuple[bytes, bytes]] = {}
        for batch, _ in items:
            scopes.update(batch.scopes)
        try:
            self.store.add_span_rows(rows, scopes)
        except Exception as exc:  # reported to every sender in the group; they may retry
            logger.exception("agl store: writing %d spans failed", len(rows))
            for _, done in items:
                done.set_exception(exc)
        else:
            for batch, done in items:
                done.set_result(len(batch.rows))
        finally:
            with self._pending_lock:
                self._pending -= size

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then stop the writer (and the parse workers)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            self._thread = None
