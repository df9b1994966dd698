"""The ingest pipeline shared by the OTLP/HTTP and OTLP/gRPC receivers.

Request bodies are decoded and validated in the request thread, or, with ``parse_workers``, in worker
processes (:mod:`.workers`) so decoding runs beside the writer on another core. One writer thread commits
whatever has queued up since its last commit in a single transaction (group commit), then acknowledges
every request in it. On a SQLite store the workers write too (``workers_write``): a worker commits what it
decoded itself and the request is acknowledged after that commit, the writers of the file taking turns
(:meth:`SqliteStore.share_writes`). The backlog is bounded: past ``max_pending_spans`` spans waiting for
the writer, or past the decode budget of bodies being decoded (or decoded and written by a worker), a
request is refused with :class:`Overloaded`, which the receivers turn into the protocol's retryable
answer (HTTP 503 + Retry-After, gRPC UNAVAILABLE). Nothing is acknowledged before it is committed.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..pipeline.rewards import DEFAULT_REWARD_RANGE, RewardRange
from .base import StoreError, StoreUnavailableError
from .formats.otlp import ParsedBatch, decode_json, decode_protobuf, extract_rows
from .redact import Redactor
from .workers import WorkerLost, WorkerPool

__all__ = ["IngestPipeline", "Ingested", "Overloaded"]

logger = logging.getLogger(__name__)


def as_store_error(exc: Exception) -> StoreError:
    """What a failed span write is reported as: a :class:`StoreError` as it is, anything else (a driver's
    own error) as a retryable :class:`StoreUnavailableError` naming it."""
    return (
        exc if isinstance(exc, StoreError) else StoreUnavailableError(f"{type(exc).__name__}: {exc}".strip())
    )


class Overloaded(Exception):
    """The store cannot take this request now (its write backlog or decode budget is full, or a parse
    worker was lost); the sender should retry after ``retry_after_s``. Receivers answer HTTP 503 +
    Retry-After and gRPC UNAVAILABLE, which OTLP exporters retry."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def _parse(
    body: bytes, json_body: bool, redactor: Redactor | None, rewards: RewardRange = DEFAULT_REWARD_RANGE
) -> ParsedBatch:
    if json_body:
        return extract_rows(decode_json(body), redactor, rewards=rewards)
    return extract_rows(decode_protobuf(body), redactor, raw=body, rewards=rewards)


def _parse_elsewhere(
    body: bytes, json_body: bool, redactor: Redactor | None, rewards: RewardRange = DEFAULT_REWARD_RANGE
) -> ParsedBatch:
    """:func:`_parse` in a parse worker: a span kept as the bytes it arrived as comes back as its place
    in ``body`` (which the store process still holds), not as a copy sent back over the pipe (on two
    cores that took ingest from 72-74k to 79k spans/s, bench/RESULTS.md); :func:`_with_bodies` puts the
    bytes back."""
    if json_body:
        return extract_rows(decode_json(body), redactor, rewards=rewards)
    return extract_rows(decode_protobuf(body), redactor, raw=body, offsets=True, rewards=rewards)


def _with_bodies(batch: ParsedBatch, body: bytes) -> ParsedBatch:
    """The rows of a batch parsed by :func:`_parse_elsewhere`, each with its span's bytes."""
    rows = [
        row if type(row[10]) is bytes else (*row[:10], body[row[10][0] : row[10][1]]) for row in batch.rows
    ]
    return dataclasses.replace(batch, rows=rows)


@dataclasses.dataclass(frozen=True)
class Ingested:
    """What became of one export request: ``spans`` kept (written, or already stored), ``rejected`` and
    the first rejection's reason (OTLP's partial success)."""

    spans: int
    rejected: int
    error_message: str


#: Bodies smaller than this are decoded in the receiving process: shipping them costs more than decoding.
_SHIP_BYTES = 16_384

#: In a worker process: the store each (file, synchronous) is written through, opened at first use.
_worker_stores: dict[tuple[str, str], Any] = {}


def _write_elsewhere(
    body: bytes, json_body: bool, redactor: Redactor | None, rewards: RewardRange, target: tuple[str, str]
) -> Ingested:
    """In a worker process: decode ``body`` and commit its spans into the SQLite file ``target``
    (path, synchronous), taking turns with the store process and the other workers
    (:meth:`SqliteStore.share_writes`). Any failure to write comes back as a :class:`StoreError`."""
    batch = _parse(body, json_body, redactor, rewards)
    if batch.rows:
        try:
            store = _worker_stores.get(target)
            if store is None:
                from .sqlite import SqliteStore

                store = SqliteStore(target[0], synchronous=target[1], checkpoints=False)
                store.share_writes()
                _worker_stores[target] = store
            store.add_span_rows(batch.rows, batch.scopes)
        except Exception as exc:
            raise as_store_error(exc) from None
    return Ingested(len(batch.rows), batch.rejected, batch.error_message)


def _pass_on(done: Future[Any]) -> Callable[[Future[Any]], None]:
    """A done-callback that settles ``done`` as the future it is called with was settled."""

    def settle(source: Future[Any]) -> None:
        exc = source.exception()
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(source.result())

    return settle


def _resolved(value: Any) -> Future[Any]:
    done: Future[Any] = Future()
    done.set_result(value)
    return done


class IngestPipeline:
    def __init__(
        self,
        store: Any,
        *,
        redactor: Redactor | None = None,
        reward_range: RewardRange | None = None,
        max_pending_spans: int = 200_000,
        max_commit_spans: int = 20_000,
        parse_workers: int = 0,
        max_decoding_bytes: int = 64 * 1024 * 1024,
        workers_write: bool = False,
    ) -> None:
        if max_pending_spans < 1 or max_commit_spans < 1:
            raise ValueError("max_pending_spans and max_commit_spans must be >= 1")
        if parse_workers < 0:
            raise ValueError("parse_workers must be >= 0")
        self.store = store
        self.redactor = redactor if redactor else None
        #: ``agl.reward`` spans whose value lies outside it are refused (OTLP partial success); by default
        #: the store's own range, the one its late rewards are held to.
        own: RewardRange = getattr(store, "reward_range", DEFAULT_REWARD_RANGE)
        self.reward_range = own if reward_range is None else reward_range
        self.parse_workers = parse_workers
        # Workers that write what they decode (a SQLite store): the rows never cross back to this
        # process, and two workers decode and write at once, taking turns only on the write itself.
        self._target: tuple[str, str] | None = None
        if workers_write and parse_workers:
            from .sqlite import SqliteStore

            if not isinstance(store, SqliteStore):
                raise ValueError("workers_write needs a SqliteStore")
            store.share_writes()
            self._target = (str(store.path), store.synchronous)
        self._pool = WorkerPool(parse_workers) if parse_workers else None
        # Bytes being decoded at once: decoding expands a body many times over in memory, so beyond this
        # budget a request is refused before it is decoded (retryable), not after.
        self.max_decoding_bytes = max_decoding_bytes
        self._decoding = 0
        self._decoding_lock = threading.Lock()
        self.max_pending_spans = max_pending_spans
        self.max_commit_spans = max_commit_spans
        self._queue: queue.Queue[tuple[ParsedBatch, Future[int]] | None] = queue.Queue()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.refused_requests = 0

    @property
    def workers_restarted(self) -> int:
        """Parse workers started in place of one that died."""
        return self._pool.restarted if self._pool is not None else 0

    @property
    def has_workers(self) -> bool:
        return self._pool is not None

    def parse(self, body: bytes, *, json_body: bool = False) -> ParsedBatch:
        """Decode and validate a request body (raises ``OtlpDecodeError``) in the calling thread."""
        return _parse(body, json_body, self.redactor, self.reward_range)

    def parse_admitted(self, body: bytes, *, json_body: bool = False) -> ParsedBatch:
        """:meth:`parse` in the calling thread, within the write backlog and decode budget: refused with
        :class:`Overloaded` before decoding as :meth:`admit` says (the path of a store without parse
        workers)."""
        size = len(body)
        self.admit(size)
        try:
            return self.parse(body, json_body=json_body)
        finally:
            self._release(size)

    def admit(self, size: int) -> None:
        """Refuse (:class:`Overloaded`) a body of ``size`` bytes before it is decoded when the write
        backlog is full or the bytes already being decoded would pass ``max_decoding_bytes``; otherwise
        reserve its share of the decode budget until its parse finishes."""
        with self._pending_lock:
            if self._pending >= self.max_pending_spans:
                self.refused_requests += 1
                raise Overloaded(self._busy_message())
        with self._decoding_lock:
            if self._decoding and self._decoding + size > self.max_decoding_bytes:
                self.refused_requests += 1
                raise Overloaded(
                    f"the store is decoding {self._decoding} bytes of other requests (limit"
                    f" {self.max_decoding_bytes}); retry later"
                )
            self._decoding += size

    def _release(self, size: int) -> None:
        with self._decoding_lock:
            self._decoding -= size

    def parse_async(self, body: bytes, *, json_body: bool = False) -> Future[ParsedBatch]:
        """Like :meth:`parse`, in a worker process when the pipeline has them (small bodies stay here:
        shipping them costs more than decoding them). Refuses with :class:`Overloaded` before decoding
        (see :meth:`admit`). A worker that dies (killed, out of memory) fails only the request it held,
        with :class:`Overloaded` so its sender retries; another worker takes its place."""
        size = len(body)
        self.admit(size)
        done: Future[ParsedBatch] = Future()
        pool = self._pool
        if pool is None or size < _SHIP_BYTES:
            try:
                done.set_result(self.parse(body, json_body=json_body))
            except BaseException as exc:
                done.set_exception(exc)
            finally:
                self._release(size)
            return done
        inner = self._ship(pool, size, _parse_elsewhere, body, json_body, self.redactor, self.reward_range)
        return self._answered(inner, size, lambda parsed: _with_bodies(parsed, body))

    def _answered(self, inner: Future[Any], size: int, result: Callable[[Any], Any]) -> Future[Any]:
        """The request's future for a worker's job ``inner``: the decode budget is given back when the
        job ends; a lost worker refuses the request retryably (:class:`Overloaded`); otherwise it gets
        ``result(the worker's answer)``, or what that raised (a callback's exception would leave the
        request waiting for ever)."""
        done: Future[Any] = Future()

        def finished(inner: Future[Any]) -> None:
            self._release(size)
            exc = inner.exception()
            if isinstance(exc, WorkerLost):
                done.set_exception(Overloaded(str(exc)))
            elif exc is not None:
                done.set_exception(exc)
            else:
                try:
                    done.set_result(result(inner.result()))
                except Exception as failed:
                    done.set_exception(failed)

        inner.add_done_callback(finished)
        return done

    def ingest_async(self, body: bytes, *, json_body: bool = False) -> Future[Ingested]:
        """Decode ``body`` and write its spans; the future resolves once they are committed. With
        writing workers, a worker does both; otherwise :meth:`parse_async` then :meth:`submit`. Raises
        :class:`Overloaded` (before decoding) as :meth:`admit` says; the future fails with
        ``OtlpDecodeError``, :class:`Overloaded` (a worker was lost) or :class:`StoreError`."""
        pool, target, size = self._pool, self._target, len(body)
        if pool is None or target is None or size < _SHIP_BYTES:
            return self._then(self.parse_async(body, json_body=json_body), self.write_async)
        self.admit(size)
        inner = self._ship(
            pool, size, _write_elsewhere, body, json_body, self.redactor, self.reward_range, target
        )
        return self._answered(inner, size, self._written_elsewhere)

    def _written_elsewhere(self, ingested: Ingested) -> Ingested:
        self.store.checkpoint_soon()  # a worker's commit grew the WAL: the store process checkpoints
        return ingested

    def write_async(self, batch: ParsedBatch) -> Future[Ingested]:
        """:meth:`submit` a parsed batch; the future resolves to what became of its request."""
        return self._then(
            self.submit(batch), lambda n: _resolved(Ingested(n, batch.rejected, batch.error_message))
        )

    @staticmethod
    def _then(first: Future[Any], step: Callable[[Any], Future[Any]]) -> Future[Any]:
        """A future for ``step(first's result)`` (itself a future), failing as either fails."""
        done: Future[Any] = Future()

        def chain(first: Future[Any]) -> None:
            try:
                second = step(first.result())
            except BaseException as exc:
                done.set_exception(exc)
                return
            second.add_done_callback(_pass_on(done))

        first.add_done_callback(chain)
        return done

    def _ship(self, pool: WorkerPool, size: int, function: Any, body: bytes, *args: Any) -> Future[Any]:
        """``pool.submit``; a pool shut down (the store is stopping) gives back the decode budget and
        refuses with :class:`Overloaded`."""
        try:
            return pool.submit(function, body, *args)
        except RuntimeError:
            self._release(size)
            raise Overloaded("the store is shutting down; retry") from None

    def _busy_message(self) -> str:
        return (
            f"the store is busy ({self._pending} spans waiting to be written, limit"
            f" {self.max_pending_spans}); retry later"
        )

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
                raise Overloaded(self._busy_message())
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
        except Exception as exc:  # reported to every sender in the group as retryable; nothing was written
            logger.exception("agl store: writing %d spans failed", len(rows))
            error = as_store_error(exc)
            for _, done in items:
                done.set_exception(error)
        else:
            for batch, done in items:
                done.set_result(len(batch.rows))
        finally:
            with self._pending_lock:
                self._pending -= size

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then stop the writer (and the parse workers)."""
        if self._pool is not None:
            self._pool.shutdown()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            self._thread = None
