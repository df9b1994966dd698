"""What the SQLite and PostgreSQL backends share: the span queries and the rollout state machine.

SQL here is written with ``?`` placeholders; a backend whose driver wants another style rewrites them
(:meth:`SqlStore._sql`). Writes go through one connection under a lock, so the store assigns ``seq``
in commit order; reads use one connection per thread.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic

from .. import semconv
from ..pipeline.rewards import DEFAULT_REWARD_RANGE, EPISODE, Reward, RewardRange, StoredReward
from ..pipeline.transitions import episode_rewards
from ..records import Attempt, Resource, Rollout, RolloutStatus, Span
from ._loose import SOURCE as LOOSE_SOURCE
from ._loose import LooseSpans, rollout_for_trace
from ._rewards import LEDGER_COLUMNS, RewardPlacer, ledger_row
from ._schema import (
    _C,
    AGENT_NAME_KEYS,
    ATTEMPT_COLUMNS,
    ROLLOUT_COLUMNS,
    Cursor,
    _json,
    agent_attribute_bytes,
    attempt_from_row,
    rollout_from_row,
)
from .base import (
    AGENT_COUNT_CAP,
    COUNT_CAP,
    MAX_PAGE,
    NotFoundError,
    RolloutFilter,
    RolloutPage,
    RolloutRequest,
    StoreError,
    StoreUnavailableError,
    validate_merge,
)
from .formats.otlp import (
    SpanRow,
    extract_rows,
    records_to_request,
    resource_attributes,
    row_to_span,
    span_shows_text,
    with_rollout_id,
)

__all__ = ["SqlStore"]

#: Rollouts a merge (or traces a grouping pass) looks up in one statement.
_MERGE_CHUNK = 500
#: A grouping pass of loose spans reads new spans' ids in pages of this many, at most this many pages.
_LOOSE_PAGE, _LOOSE_PAGES = 20_000, 10
_Q, _R = RolloutStatus.QUEUED.value, RolloutStatus.RUNNING.value


class SqlStore(Generic[_C]):
    """Base of :class:`SqliteStore` and :class:`PostgresStore`; subclasses supply connections of type
    ``_C``."""

    #: appended to the dequeue SELECT (PostgreSQL: ``FOR UPDATE SKIP LOCKED``)
    _lock_rows = ""
    #: Rewards (late ones, and ``agl.reward`` spans) outside it are refused (``--reward-range``).
    reward_range: RewardRange = DEFAULT_REWARD_RANGE

    def __init__(self) -> None:
        self._write_lock = threading.Lock()
        self._local = threading.local()
        self._readers: list[_C] = []
        self._readers_lock = threading.Lock()
        self._known_scopes: set[bytes] = set()
        self._resources: dict[bytes, dict[str, Any]] = {}
        self._writer = self._connect()
        self._closed = False

    # --- subclass hooks ------------------------------------------------------------------------------
    def _connect(self) -> _C:
        raise NotImplementedError

    #: run :meth:`_purge` when the store closes too
    _purge_on_close = False

    def _purge(self, conn: _C) -> None:
        """After rows were deleted: make their bytes leave the database files where the engine allows."""

    def _begin(self, conn: _C) -> None:
        raise NotImplementedError

    def _alive(self, conn: _C) -> bool:
        """Whether ``conn`` can still be used (a server connection may have been cut)."""
        return True

    def _unavailable(self, exc: BaseException) -> bool:
        """Whether ``exc`` means the database cannot serve now (connection lost, disk full) rather than
        that the request was wrong: such failures are retryable."""
        return False

    def _commit(self, conn: _C) -> None:
        conn.execute("COMMIT")

    def _rollback(self, conn: _C) -> None:
        conn.execute("ROLLBACK")

    def _insert_spans(self, conn: _C, rows: Sequence[SpanRow]) -> int:
        raise NotImplementedError

    def _sql(self, sql: str) -> str:
        return sql

    def _in(self, column: str, values: Sequence[Any]) -> tuple[str, list[Any]]:
        return f"{column} IN ({','.join('?' * len(values))})", list(values)

    def _metadata_is(self, key: str, value: Any) -> tuple[str, list[Any]]:
        """SQL true when the rollout's JSON ``metadata[key]`` equals ``value`` (``key`` is a constant)."""
        return f"json_extract(metadata, '$.{key}') = ?", [value]

    def _contains_bytes(self, column: str) -> str:
        """SQL true when the blob ``column`` contains the bytes of one parameter."""
        return f"instr({column}, ?) > 0"

    # --- plumbing ------------------------------------------------------------------------------------
    def _exec(self, conn: _C, sql: str, args: Sequence[Any] = ()) -> Cursor:
        return conn.execute(self._sql(sql), args)

    def _retryable(self, exc: BaseException, what: str) -> StoreUnavailableError:
        return StoreUnavailableError(f"the database could not {what}: {type(exc).__name__}: {exc}".strip())

    def _hold_writers(self) -> None:
        """Keep writers in other processes out until :meth:`_let_writers_in` (called with the write lock
        held, before the transaction begins); a backend whose database does that itself does nothing."""

    def _let_writers_in(self) -> None:
        """Undo :meth:`_hold_writers` once the transaction has ended."""

    @contextlib.contextmanager
    def _writing_alone(self) -> Iterator[None]:
        """The write lock, and writers in other processes held off (:meth:`_hold_writers`)."""
        with self._write_lock:
            self._hold_writers()
            try:
                yield
            finally:
                self._let_writers_in()

    @contextlib.contextmanager
    def _write(self) -> Iterator[_C]:
        with self._writing_alone():
            if self._closed:
                raise StoreError("the store is closed")
            try:
                if not self._alive(self._writer):  # cut (server restarted): reconnect, then go on
                    with contextlib.suppress(Exception):
                        self._writer.close()
                    self._writer = self._connect()
                self._begin(self._writer)
            except Exception as exc:
                if self._unavailable(exc):
                    raise self._retryable(exc, "start a write") from exc
                raise
            try:
                yield self._writer
                self._commit(self._writer)
            except BaseException as exc:
                with contextlib.suppress(Exception):  # a cut connection cannot roll back; nothing was kept
                    self._rollback(self._writer)
                if isinstance(exc, Exception) and self._unavailable(exc):
                    raise self._retryable(exc, "write") from exc
                raise

    def _reader(self) -> _C:
        conn: _C | None = getattr(self._local, "conn", None)
        if conn is not None and not self._alive(conn):
            with self._readers_lock:
                if conn in self._readers:
                    self._readers.remove(conn)
            with contextlib.suppress(Exception):
                conn.close()
            conn = None
        if conn is None:
            try:
                conn = self._connect()
            except Exception as exc:
                if self._unavailable(exc):
                    raise self._retryable(exc, "be reached") from exc
                raise
            self._local.conn = conn
            with self._readers_lock:
                self._readers.append(conn)
        return conn

    @contextlib.contextmanager
    def _reading(self) -> Iterator[_C]:
        """A reader connection; a failure that means the database cannot serve now becomes the retryable
        :class:`StoreUnavailableError`."""
        if self._closed:
            raise StoreError("the store is closed")
        try:
            yield self._reader()
        except StoreError:
            raise
        except Exception as exc:
            if self._unavailable(exc):
                raise self._retryable(exc, "read") from exc
            raise

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        with self._reading() as conn:
            rows: list[Any] = self._exec(conn, sql, args).fetchall()
        return rows

    def close(self) -> None:
        with self._writing_alone():
            if not self._closed and self._purge_on_close:
                with contextlib.suppress(Exception):
                    self._purge(self._writer)
            self._closed = True
            with self._readers_lock:
                for conn in [self._writer, *self._readers]:
                    with contextlib.suppress(Exception):
                        conn.close()
                self._readers.clear()

    # --- spans ---------------------------------------------------------------------------------------
    def add_span_rows(self, rows: Sequence[SpanRow], scopes: dict[bytes, tuple[bytes, bytes]]) -> int:
        """Write decoded spans in one transaction; spans already stored are skipped. Returns how many
        were new. Nothing is acknowledged before the commit."""
        new_scopes = [(k, r, s) for k, (r, s) in scopes.items() if k not in self._known_scopes]
        with self._write() as conn:
            if new_scopes:
                conn.executemany(
                    self._sql(
                        "INSERT INTO span_scopes (scope_key, resource, scope) VALUES (?,?,?)"
                        " ON CONFLICT DO NOTHING"
                    ),
                    new_scopes,
                )
            added = self._insert_spans(conn, rows) if rows else 0
        self._known_scopes.update(k for k, _, _ in new_scopes)
        return added

    def add_spans(self, spans: Sequence[Span]) -> int:
        batch = extract_rows(records_to_request(list(spans)), rewards=self.reward_range)
        if batch.rejected:
            raise StoreError(f"invalid span: {batch.error_message}")
        return self.add_span_rows(batch.rows, batch.scopes)

    def _resource(self, scope_key: bytes) -> dict[str, Any]:
        cached = self._resources.get(scope_key)
        if cached is None:
            rows = self._read("SELECT resource FROM span_scopes WHERE scope_key = ?", [scope_key])
            cached = resource_attributes(bytes(rows[0][0])) if rows else {}
            self._resources[scope_key] = cached
        return cached

    def query_spans(
        self,
        *,
        rollout_ids: Sequence[str] | None = None,
        attempt_id: str | None = None,
        trace_id: str | None = None,
        start_after_ns: int | None = None,
        start_before_ns: int | None = None,
        after_seq: int = 0,
        limit: int = 10_000,
    ) -> list[Span]:
        return self.span_page(
            rollout_ids=rollout_ids,
            attempt_id=attempt_id,
            trace_id=trace_id,
            start_after_ns=start_after_ns,
            start_before_ns=start_before_ns,
            after_seq=after_seq,
            limit=limit,
        )[0]

    def span_page(
        self,
        *,
        rollout_ids: Sequence[str] | None = None,
        attempt_id: str | None = None,
        trace_id: str | None = None,
        start_after_ns: int | None = None,
        start_before_ns: int | None = None,
        after_seq: int = 0,
        limit: int = 10_000,
        max_bytes: int | None = None,
    ) -> tuple[list[Span], bool]:
        """:meth:`query_spans` holding at most ``max_bytes`` of stored span data (always at least one span),
        and whether it stopped short of ``limit`` for that (more spans follow the last one's ``seq``).
        The sizes are read first, without the spans, so a page never loads more than its bound."""
        where = ["seq > ?"]
        args: list[Any] = [after_seq]
        if rollout_ids is not None:
            if not rollout_ids:
                return [], False
            clause, values = self._in("rollout_id", list(rollout_ids))
            where.append(clause)
            args.extend(values)
        if attempt_id is not None:
            where.append("attempt_id = ?")
            args.append(attempt_id)
        if trace_id is not None:
            try:
                raw = bytes.fromhex(trace_id)
            except ValueError:
                raise StoreError(f"trace_id must be 32 hex characters, got {trace_id!r}") from None
            where.append("trace_id = ?")
            args.append(raw)
        if start_after_ns is not None:
            where.append("start_ns >= ?")
            args.append(start_after_ns)
        if start_before_ns is not None:
            where.append("start_ns < ?")
            args.append(start_before_ns)
        cut = False
        if max_bytes is not None:
            sizes = self._read(
                f"SELECT seq, length(body) FROM spans WHERE {' AND '.join(where)} ORDER BY seq LIMIT ?",
                [*args, limit],
            )
            total = 0
            for n, (seq, size) in enumerate(sizes):
                total += int(size or 0)
                if total > max_bytes and n > 0:
                    where.append("seq < ?")
                    args.append(seq)
                    cut = True
                    break
        rows = self._read(
            f"SELECT seq, scope_key, body FROM spans WHERE {' AND '.join(where)} ORDER BY seq LIMIT ?",
            [*args, limit],
        )
        return [row_to_span(seq, bytes(body), self._resource(bytes(key))) for seq, key, body in rows], cut

    # --- rollouts ------------------------------------------------------------------------------------
    def enqueue_rollouts(self, requests: Iterable[RolloutRequest]) -> list[Rollout]:
        now = time.time()
        rows = []
        for req in requests:
            max_attempts = int(req.get("max_attempts", 1))
            if max_attempts < 1:
                raise StoreError(f"max_attempts must be >= 1, got {max_attempts}")
            rows.append(
                (
                    req.get("rollout_id") or f"ro-{uuid.uuid4().hex[:16]}",
                    str(req["task_id"]),
                    _json(req.get("input"), "input"),
                    req.get("group_id"),
                    _Q,
                    now,
                    _json(dict(req.get("metadata") or {}), "metadata"),
                    max_attempts,
                )
            )
        ids = [r[0] for r in rows]
        if len(set(ids)) != len(ids):
            raise StoreError("rollout ids in one request must be unique")
        with self._write() as conn:
            clause, values = self._in("rollout_id", ids)
            taken = self._exec(conn, f"SELECT rollout_id FROM rollouts WHERE {clause}", values).fetchall()
            if taken:
                raise StoreError(f"rollout id(s) already exist: {sorted(r[0] for r in taken)[:5]}")
            conn.executemany(
                self._sql(
                    "INSERT INTO rollouts (rollout_id, task_id, input, group_id, status, created_at,"
                    " metadata, max_attempts) VALUES (?,?,?,?,?,?,?,?)"
                ),
                rows,
            )
            return self._load_rollouts(conn, ids)

    def add_observed_rollouts(self, requests: Iterable[RolloutRequest]) -> list[Rollout]:
        """Record finished rollouts that ran outside the queue (``succeeded``, no attempt); ids already
        stored are left as they are. Returns the requested rollouts as stored."""
        now = time.time()
        rows = {}
        for req in requests:
            rollout_id = req.get("rollout_id")
            if not rollout_id:
                raise StoreError("an observed rollout needs its rollout_id")
            rows[rollout_id] = (
                rollout_id,
                str(req.get("task_id") or rollout_id),
                _json(req.get("input"), "input"),
                req.get("group_id"),
                RolloutStatus.SUCCEEDED.value,
                now,
                _json(dict(req.get("metadata") or {}), "metadata"),
                1,
            )
        if not rows:
            return []
        with self._write() as conn:
            conn.executemany(
                self._sql(
                    "INSERT INTO rollouts (rollout_id, task_id, input, group_id, status, created_at,"
                    " metadata, max_attempts) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT DO NOTHING"
                ),
                list(rows.values()),
            )
            return self._load_rollouts(conn, list(rows))

    def dequeue_rollout(self, worker_id: str, *, lease_s: float = 60.0) -> tuple[Rollout, Attempt] | None:
        """Claim the oldest queued rollout and start an attempt holding a lease of ``lease_s`` seconds;
        a runner keeps the lease with :meth:`heartbeat`, or the attempt is reclaimed as timed out."""
        now = time.time()
        with self._write() as conn:
            row = self._exec(
                conn,
                f"SELECT rollout_id FROM rollouts WHERE status = ? ORDER BY seq LIMIT 1{self._lock_rows}",
                [_Q],
            ).fetchone()
            if row is None:
                return None
            rollout_id = row[0]
            (number,) = self._exec(
                conn, "SELECT COUNT(*) FROM attempts WHERE rollout_id = ?", [rollout_id]
            ).fetchone()
            attempt_id = f"at-{uuid.uuid4().hex[:16]}"
            self._exec(
                conn,
                "INSERT INTO attempts (attempt_id, rollout_id, number, status, worker_id, started_at,"
                " heartbeat_at, lease_expires_at) VALUES (?,?,?,?,?,?,?,?)",
                [attempt_id, rollout_id, number + 1, _R, worker_id, now, now, now + lease_s],
            )
            self._exec(conn, "UPDATE rollouts SET status = ? WHERE rollout_id = ?", [_R, rollout_id])
            rollout = self._load_rollouts(conn, [rollout_id])[0]
        return rollout, next(a for a in rollout.attempts if a.attempt_id == attempt_id)

    def heartbeat(self, attempt_id: str, *, lease_s: float = 60.0) -> Attempt:
        """Extend a running attempt's lease. Returns the attempt; a status other than ``running`` (it was
        cancelled, or reclaimed after its lease ran out) tells the runner to stop working on it."""
        now = time.time()
        with self._write() as conn:
            row = self._exec(
                conn, "SELECT status FROM attempts WHERE attempt_id = ?", [attempt_id]
            ).fetchone()
            if row is None:
                raise NotFoundError(f"no attempt {attempt_id!r}")
            if row[0] == _R:
                self._exec(
                    conn,
                    "UPDATE attempts SET heartbeat_at = ?, lease_expires_at = ? WHERE attempt_id = ?",
                    [now, now + lease_s, attempt_id],
                )
            return self._load_attempt(conn, attempt_id)

    def complete_attempt(
        self,
        attempt_id: str,
        status: RolloutStatus,
        *,
        reward: float | None = None,
        error: str | None = None,
    ) -> Rollout:
        status = RolloutStatus(status)
        if not status.finished:
            raise StoreError(f"an attempt can only be completed with a final status, not {status.value!r}")
        with self._write() as conn:
            row = self._exec(
                conn,
                "SELECT a.rollout_id, a.status, a.number, r.max_attempts FROM attempts a"
                " JOIN rollouts r ON r.rollout_id = a.rollout_id WHERE a.attempt_id = ?",
                [attempt_id],
            ).fetchone()
            if row is None:
                raise NotFoundError(f"no attempt {attempt_id!r}")
            rollout_id, current, number, max_attempts = row
            if RolloutStatus(current).finished:
                raise StoreError(
                    f"attempt {attempt_id!r} already finished as {current!r}; its result is not recorded"
                )
            self._finish_attempt(conn, attempt_id, rollout_id, number, max_attempts, status, error, reward)
            return self._load_rollouts(conn, [rollout_id])[0]

    def _finish_attempt(
        self,
        conn: _C,
        attempt_id: str,
        rollout_id: str,
        number: int,
        max_attempts: int,
        status: RolloutStatus,
        error: str | None,
        reward: float | None,
    ) -> None:
        self._exec(
            conn,
            "UPDATE attempts SET status = ?, ended_at = ?, error = ? WHERE attempt_id = ?",
            [status.value, time.time(), error, attempt_id],
        )
        retry = status in (RolloutStatus.FAILED, RolloutStatus.TIMED_OUT) and number < max_attempts
        self._exec(
            conn,
            "UPDATE rollouts SET status = ?, reward = COALESCE(?, reward)"
            " WHERE rollout_id = ? AND status = ?",
            [_Q if retry else status.value, reward, rollout_id, _R],
        )

    def reclaim_expired(self, now: float | None = None) -> int:
        """Time out running attempts whose lease ran out (their runner died or hung); their rollouts are
        queued again while tries are left. Returns how many attempts were reclaimed."""
        now = time.time() if now is None else now
        with self._write() as conn:
            expired = self._exec(
                conn,
                "SELECT a.attempt_id, a.rollout_id, a.number, r.max_attempts, a.worker_id FROM attempts a"
                " JOIN rollouts r ON r.rollout_id = a.rollout_id"
                " WHERE a.status = ? AND a.lease_expires_at < ?",
                [_R, now],
            ).fetchall()
            for attempt_id, rollout_id, number, max_attempts, worker in expired:
                self._finish_attempt(
                    conn,
                    attempt_id,
                    rollout_id,
                    number,
                    max_attempts,
                    RolloutStatus.TIMED_OUT,
                    f"lease expired: runner {worker!r} stopped sending heartbeats",
                    None,
                )
        return len(expired)

    def cancel_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        """Cancel queued or running rollouts (a running attempt sees it on its next heartbeat)."""
        if not rollout_ids:
            return []
        now = time.time()
        clause, values = self._in("rollout_id", list(rollout_ids))
        with self._write() as conn:
            found = self._load_rollouts(conn, list(rollout_ids))
            missing = set(rollout_ids) - {r.rollout_id for r in found}
            if missing:
                raise NotFoundError(f"no rollout(s) {sorted(missing)[:5]!r}")
            self._exec(
                conn,
                f"UPDATE attempts SET status = ?, ended_at = ?, error = ? WHERE status = ? AND {clause}",
                [RolloutStatus.CANCELLED.value, now, "cancelled", _R, *values],
            )
            self._exec(
                conn,
                f"UPDATE rollouts SET status = ? WHERE status IN (?, ?) AND {clause}",
                [RolloutStatus.CANCELLED.value, _Q, _R, *values],
            )
            return self._load_rollouts(conn, list(rollout_ids))

    def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        with self._reading() as conn:
            found = self._load_rollouts(conn, list(rollout_ids))
        missing = set(rollout_ids) - {r.rollout_id for r in found}
        if missing:
            raise NotFoundError(f"no rollout(s) {sorted(missing)[:5]!r}")
        return found

    def list_rollouts(
        self, where: RolloutFilter | None = None, *, before: int | None = None, limit: int = 50
    ) -> RolloutPage:
        where = where or RolloutFilter()
        limit = max(1, min(int(limit), MAX_PAGE))
        clauses: list[str] = []
        args: list[Any] = []
        if where.statuses:
            clause, values = self._in("status", list(where.statuses))
            clauses.append(clause)
            args += values
        for column, value in (("task_id", where.task_id), ("group_id", where.group_id)):
            if value is not None:
                clauses.append(f"{column} = ?")
                args.append(value)
        metadata: list[tuple[str, Any]] = [("step", where.step), ("split", where.split), ("run", where.run)]
        for key, value in metadata:
            if value is not None:
                clause, values = self._metadata_is(key, value)
                clauses.append(clause)
                args += values
        if where.reward_min is not None:
            clauses.append("reward >= ?")
            args.append(float(where.reward_min))
        if where.reward_max is not None:
            clauses.append("reward <= ?")
            args.append(float(where.reward_max))
        if where.agent is not None:
            # the span's own encoding holds each attribute as its encoded KeyValue; look for those bytes
            contains = self._contains_bytes("s.body")
            clauses.append(
                "EXISTS (SELECT 1 FROM spans s WHERE s.rollout_id = rollouts.rollout_id"
                f" AND ({contains} OR {contains}))"
            )
            args += [agent_attribute_bytes(key, where.agent) for key in AGENT_NAME_KEYS]
        if where.text is not None:
            # names and text values sit in a span's encoding as their UTF-8 bytes
            clauses.append(
                "EXISTS (SELECT 1 FROM spans s WHERE s.rollout_id = rollouts.rollout_id"
                f" AND {self._contains_bytes('s.body')})"
            )
            args.append(where.text.encode("utf-8", "surrogatepass"))
        matched = " AND ".join(clauses) or "1 = 1"
        cap = COUNT_CAP if where.agent is None and where.text is None else AGENT_COUNT_CAP
        with self._reading() as conn:
            if where.text is not None:
                rows, total = self._text_matches(conn, matched, args, where.text, before, limit, cap)
            else:
                page_where, page_args = matched, list(args)
                if before is not None:
                    page_where += " AND seq < ?"
                    page_args.append(int(before))
                rows = self._exec(
                    conn,
                    f"SELECT seq, rollout_id FROM rollouts WHERE {page_where} ORDER BY seq DESC LIMIT ?",
                    [*page_args, limit + 1],
                ).fetchall()
                total = self._exec(
                    conn,
                    f"SELECT COUNT(*) FROM (SELECT 1 FROM rollouts WHERE {matched} LIMIT ?) AS m",
                    [*args, cap + 1],
                ).fetchone()[0]
            more = len(rows) > limit
            rows = rows[:limit]
            ids = [r[1] for r in rows]
            counts: dict[str, int] = {}
            if ids:
                clause, values = self._in("rollout_id", ids)
                counts = {
                    r[0]: int(r[1])
                    for r in self._exec(
                        conn,
                        f"SELECT rollout_id, COUNT(*) FROM spans WHERE {clause} GROUP BY rollout_id",
                        values,
                    ).fetchall()
                }
            rollouts = self._load_rollouts(conn, ids)
        return RolloutPage(
            rollouts=rollouts,
            seqs=[int(r[0]) for r in rows],
            span_counts=counts,
            before=int(rows[-1][0]) if more else None,
            total=min(int(total), cap),
            total_capped=int(total) > cap,
        )

    def _text_matches(
        self,
        conn: _C,
        matched: str,
        args: list[Any],
        text: str,
        before: int | None,
        limit: int,
        cap: int,
    ) -> tuple[list[Any], int]:
        """Rollouts matching ``matched`` (whose last clause finds ``text``'s bytes anywhere in a span's
        encoding) that have a span showing ``text`` where a user reads it (:func:`span_shows_text`):
        the page (``seq < before``, newest first, up to ``limit + 1``) and the count up to ``cap + 1``.
        The bytes narrow the candidates in SQL; each candidate's spans are decoded to confirm."""
        needle = text.encode("utf-8", "surrogatepass")
        contains = self._contains_bytes("body")
        page: list[Any] = []
        total = 0
        after: int | None = None  # candidates are read newest first, in chunks below this seq
        while total <= cap or len(page) <= limit:
            chunk_where, chunk_args = matched, list(args)
            if after is not None:
                chunk_where += " AND seq < ?"
                chunk_args.append(after)
            candidates = self._exec(
                conn,
                f"SELECT seq, rollout_id FROM rollouts WHERE {chunk_where} ORDER BY seq DESC LIMIT ?",
                [*chunk_args, _MERGE_CHUNK],
            ).fetchall()
            if not candidates:
                break
            after = int(candidates[-1][0])
            clause, values = self._in("rollout_id", [r[1] for r in candidates])
            shown: set[str] = set()
            for rollout_id, body in self._exec(
                conn,
                f"SELECT rollout_id, body FROM spans WHERE {clause} AND {contains}",
                [*values, needle],
            ).fetchall():
                if rollout_id not in shown and span_shows_text(bytes(body), text):
                    shown.add(rollout_id)
            for seq, rollout_id in candidates:
                if rollout_id in shown:
                    total += 1
                    if (before is None or seq < before) and len(page) <= limit:
                        page.append((seq, rollout_id))
            if len(candidates) < _MERGE_CHUNK:
                break
        return page, total

    def _load_attempt(self, conn: _C, attempt_id: str) -> Attempt:
        a = self._exec(
            conn,
            f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE attempt_id = ?",
            [attempt_id],
        ).fetchone()
        return attempt_from_row(a)

    def _load_rollouts(self, conn: _C, rollout_ids: list[str]) -> list[Rollout]:
        if not rollout_ids:
            return []
        clause, values = self._in("rollout_id", rollout_ids)
        # Rollouts first, then their attempts: outside a transaction the two reads may see different
        # commits, and an attempt ends in the same commit as its rollout, so a rollout read as ended
        # comes with its ended attempt (read the other way round, an ended rollout could come with its
        # attempt still running and no error yet).
        rows = self._exec(conn, f"SELECT {ROLLOUT_COLUMNS} FROM rollouts WHERE {clause}", values).fetchall()
        attempts: dict[str, list[Attempt]] = {}
        for a in self._exec(
            conn, f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE {clause} ORDER BY number", values
        ).fetchall():
            attempts.setdefault(a[1], []).append(attempt_from_row(a))
        order = {rid: i for i, rid in enumerate(rollout_ids)}
        rollouts = [rollout_from_row(r, attempts.get(r[0], ())) for r in rows]
        return sorted(rollouts, key=lambda r: order[r.rollout_id])

    # --- late rewards --------------------------------------------------------------------------------
    def add_rewards(self, rewards: Sequence[Reward]) -> list[StoredReward]:
        """Attach rewards to rollouts, traces or spans after the fact (:mod:`agl_core.pipeline.rewards`), in
        one transaction: all are stored, or none. A reward id stored before with the same reward is answered
        as stored (``created=False``); with a different one, :class:`StoreError` (409) names the id. An
        unknown target raises :class:`NotFoundError`. A rollout's recorded reward becomes its latest episode
        reward by time."""
        if not rewards:
            return []
        for n, reward in enumerate(rewards):
            problem = self.reward_range.problem(reward.value)
            if problem:
                raise ValueError(f"rewards.{n}.value: {problem}")
        now_ns = time.time_ns()
        with self._write() as conn:
            placer = RewardPlacer(lambda sql, args: self._exec(conn, sql, args).fetchall(), now_ns)
            out: list[StoredReward] = []
            spans: list[Span] = []
            for reward in rewards:
                stored, span = placer.place(reward)
                out.append(stored)
                if span is not None:
                    spans.append(span)
            if not spans:
                return out
            batch = extract_rows(records_to_request(spans), rewards=self.reward_range)
            if batch.rejected:
                raise StoreError(f"invalid reward span: {batch.error_message}")
            conn.executemany(
                self._sql(
                    "INSERT INTO span_scopes (scope_key, resource, scope) VALUES (?,?,?)"
                    " ON CONFLICT DO NOTHING"
                ),
                [(k, r, sc) for k, (r, sc) in batch.scopes.items()],
            )
            self._insert_spans(conn, batch.rows)
            created = {s.reward_id: s for s in out if s.created}
            conn.executemany(
                self._sql(f"INSERT INTO reward_ids ({LEDGER_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)"),
                [ledger_row(s, now_ns / 1e9) for s in created.values()],
            )
            episodes = {s.rollout_id for s in created.values() if s.name == EPISODE and s.rollout_id}
            for rollout_id in sorted(episodes):
                rows = self._exec(
                    conn,
                    "SELECT seq, body FROM spans WHERE rollout_id = ? AND name = ?",
                    [rollout_id, semconv.SPAN_REWARD],
                ).fetchall()
                latest = episode_rewards(row_to_span(seq, bytes(body), {}) for seq, body in rows)
                if rollout_id in latest:
                    self._exec(
                        conn,
                        "UPDATE rollouts SET reward = ? WHERE rollout_id = ?",
                        [latest[rollout_id], rollout_id],
                    )
        return out

    # --- resources -----------------------------------------------------------------------------------
    def put_resource(self, name: str, value: Any, *, keep: int | None = None) -> Resource:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (the version being written), got {keep}")
        text = _json(value, "value")
        with self._write() as conn:
            (latest,) = self._exec(
                conn, "SELECT COALESCE(MAX(version), 0) FROM resources WHERE name = ?", [name]
            ).fetchone()
            self._exec(
                conn,
                "INSERT INTO resources (name, version, value, created_at) VALUES (?,?,?,?)",
                [name, latest + 1, text, time.time()],
            )
            if keep is not None:
                self._exec(
                    conn, "DELETE FROM resources WHERE name = ? AND version <= ?", [name, latest + 1 - keep]
                )
        return Resource(name, latest + 1, value)

    def get_resource(self, name: str) -> Resource | None:
        rows = self._read(
            "SELECT version, value FROM resources WHERE name = ? ORDER BY version DESC LIMIT 1", [name]
        )
        return Resource(name, rows[0][0], json.loads(rows[0][1])) if rows else None

    # --- retention -----------------------------------------------------------------------------------
    def mark_consumed(self, rollout_ids: Sequence[str]) -> int:
        """Record that a training step used these rollouts (retention may then delete their spans)."""
        if not rollout_ids:
            return 0
        clause, values = self._in("rollout_id", list(rollout_ids))
        with self._write() as conn:
            return self._exec(conn, f"UPDATE rollouts SET consumed = 1 WHERE {clause}", values).rowcount

    def merge_rollouts(self, moves: Mapping[str, str]) -> int:
        """Move the spans of each rollout ``old`` of ``moves`` into rollout ``new`` (the indexed rollout id
        and the ``agl.rollout.id`` attribute each span carries), the ids of late rewards with them, and
        delete the record of ``old``; all in one transaction. Only rollouts that never ran under the queue
        (no attempt: observed, imported) can be merged; one that did raises :class:`StoreError` and
        nothing changes. Rollouts with no span stored are left alone. Returns how many spans moved."""
        pairs = validate_merge(moves)
        if not pairs:
            return 0
        olds = list(pairs)
        moved = 0
        with self._write() as conn:
            for start in range(0, len(olds), _MERGE_CHUNK):
                clause, values = self._in("rollout_id", olds[start : start + _MERGE_CHUNK])
                ran = self._exec(conn, f"SELECT DISTINCT rollout_id FROM attempts WHERE {clause}", values)
                queued = sorted(row[0] for row in ran.fetchall())
                if queued:
                    raise StoreError(
                        f"rollout {queued[0]!r} ran under the queue (it has attempts): only observed or"
                        " imported rollouts can be merged into another"
                    )
                present = self._exec(conn, f"SELECT DISTINCT rollout_id FROM spans WHERE {clause}", values)
                for (old,) in present.fetchall():
                    new = pairs[old]
                    rows = self._exec(
                        conn, "SELECT seq, body FROM spans WHERE rollout_id = ?", [old]
                    ).fetchall()
                    conn.executemany(
                        self._sql("UPDATE spans SET rollout_id = ?, body = ? WHERE seq = ?"),
                        [(new, with_rollout_id(bytes(body), new), seq) for seq, body in rows],
                    )
                    self._exec(conn, "UPDATE reward_ids SET rollout_id = ? WHERE rollout_id = ?", [new, old])
                    self._exec(conn, "DELETE FROM rollouts WHERE rollout_id = ?", [old])
                    moved += len(rows)
        return moved

    def group_loose_spans(self, loose: LooseSpans, now: float | None = None) -> tuple[int, int]:
        """One pass of grouping the spans stored without a rollout (:mod:`._loose`): note the spans
        stored since the last pass, then give the loose spans of each trace quiet for ``loose.quiet_s``
        their rollout (the indexed id and the span's ``agl.rollout.id``) and the rollout an observed
        record, as rollout ids that spans name without one. ``now``: monotonic seconds. Returns (spans
        given a rollout, the rollouts they were given)."""
        now = time.monotonic() if now is None else now
        if loose.after_seq is None:
            first = self._read("SELECT MIN(seq) FROM spans WHERE rollout_id IS NULL")[0][0]
            last = self._read("SELECT MAX(seq) FROM spans")[0][0]
            loose.after_seq = int(first) - 1 if first is not None else int(last or 0)
            # spans stored before this pass (an exporter's backlog in the store's first seconds, or before
            # a restart) that name a rollout with no record: each gets its observed record now
            for (orphan,) in self._read(
                "SELECT DISTINCT s.rollout_id FROM spans s WHERE s.rollout_id IS NOT NULL AND NOT EXISTS"
                " (SELECT 1 FROM rollouts r WHERE r.rollout_id = s.rollout_id)"
            ):
                loose.saw_rollout(orphan, now - loose.quiet_s)
        for _ in range(_LOOSE_PAGES):
            rows = self._read(
                "SELECT seq, trace_id, rollout_id FROM spans WHERE seq > ? ORDER BY seq LIMIT ?",
                [loose.after_seq, _LOOSE_PAGE],
            )
            for _seq, trace_id, rollout_id in rows:
                if rollout_id is None:
                    loose.saw_trace(bytes(trace_id), now)
                else:
                    loose.saw_rollout(rollout_id, now)
            if rows:
                loose.after_seq = int(rows[-1][0])
            if len(rows) < _LOOSE_PAGE:
                break
        grouped = 0
        records: dict[str, dict[str, Any]] = {}
        given: set[str] = set()
        ready = loose.ready_traces(now)
        for start in range(0, len(ready), _MERGE_CHUNK):
            clause, values = self._in("trace_id", ready[start : start + _MERGE_CHUNK])
            with self._write() as conn:
                spans: dict[bytes, list[tuple[int, str | None, bytes | None]]] = {}
                for seq, trace_id, rollout_id, body in self._exec(
                    conn,
                    "SELECT seq, trace_id, rollout_id, CASE WHEN rollout_id IS NULL THEN body END FROM spans"
                    f" WHERE {clause} ORDER BY seq",
                    values,
                ).fetchall():
                    spans.setdefault(bytes(trace_id), []).append(
                        (seq, rollout_id, None if body is None else bytes(body))
                    )
                updates = []
                for trace_id, rows_ in spans.items():
                    if all(rollout_id is not None for _, rollout_id, _ in rows_):
                        continue
                    rollout_id, grouped_by = rollout_for_trace(trace_id, [(r, b) for _, r, b in rows_])
                    updates += [
                        (rollout_id, with_rollout_id(body, rollout_id), seq)
                        for seq, r, body in rows_
                        if r is None and body is not None
                    ]
                    records.setdefault(rollout_id, grouped_by)
                    given.add(rollout_id)
                conn.executemany(
                    self._sql(
                        "UPDATE spans SET rollout_id = ?, body = ? WHERE seq = ? AND rollout_id IS NULL"
                    ),
                    updates,
                )
                grouped += len(updates)
        for rollout_id in loose.ready_rollouts(now):
            records.setdefault(rollout_id, {})
        requests = [
            {"rollout_id": rid, "task_id": rid, "metadata": {"source": LOOSE_SOURCE, **by}}
            for rid, by in records.items()
        ]
        for start in range(0, len(requests), 10_000):
            self.add_observed_rollouts(requests[start : start + 10_000])
        return grouped, len(given)

    def apply_retention(
        self, *, max_age_s: float | None = None, consumed: bool = False, now: float | None = None
    ) -> int:
        """Delete spans that started more than ``max_age_s`` ago, and (``consumed``) the spans of rollouts
        marked consumed. Returns how many spans were deleted."""
        deleted = 0
        now = time.time() if now is None else now
        with self._write() as conn:
            if max_age_s is not None:
                cutoff = int((now - max_age_s) * 1e9)
                deleted += self._exec(conn, "DELETE FROM spans WHERE start_ns < ?", [cutoff]).rowcount
            if consumed:
                deleted += self._exec(
                    conn,
                    "DELETE FROM spans WHERE rollout_id IN"
                    " (SELECT rollout_id FROM rollouts WHERE consumed = 1)",
                ).rowcount
            if deleted:  # a late reward's id goes with its span
                self._exec(
                    conn,
                    "DELETE FROM reward_ids WHERE NOT EXISTS (SELECT 1 FROM spans s"
                    " WHERE s.trace_id = reward_ids.trace_id AND s.span_id = reward_ids.span_id)",
                )
        if deleted:
            with self._writing_alone():
                if not self._closed:
                    self._purge(self._writer)
        return deleted

    def stats(self) -> dict[str, int]:
        out = {
            "spans": self._read("SELECT COUNT(*) FROM spans")[0][0],
            "rollouts": self._read("SELECT COUNT(*) FROM rollouts")[0][0],
            "attempts": self._read("SELECT COUNT(*) FROM attempts")[0][0],
        }
        for status, count in self._read("SELECT status, COUNT(*) FROM rollouts GROUP BY status"):
            out[f"rollouts_{status}"] = count
        return out
