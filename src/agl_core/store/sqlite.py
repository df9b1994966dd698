"""SQLite backend of the collector-store: one file, WAL journal, the embedded default.

A span export is acknowledged only after its transaction commits, so a crash of the server process loses
no acknowledged span. ``synchronous=NORMAL`` in WAL mode survives process crashes; a power loss may drop
the last commits (use ``synchronous="FULL"`` to rule that out too).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..records import Attempt, Resource, Rollout, RolloutStatus, Span
from .base import NotFoundError, RolloutRequest, StoreError

__all__ = ["SqliteStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS spans (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    trace_id TEXT NOT NULL,
    span_id TEXT NOT NULL,
    parent_span_id TEXT,
    rollout_id TEXT,
    attempt_id TEXT,
    name TEXT NOT NULL,
    start_ns INTEGER NOT NULL,
    end_ns INTEGER NOT NULL,
    status_code TEXT NOT NULL,
    status_message TEXT NOT NULL,
    attributes TEXT NOT NULL,
    events TEXT NOT NULL,
    resource TEXT NOT NULL,
    ingested_at REAL NOT NULL,
    UNIQUE (trace_id, span_id)
);
CREATE INDEX IF NOT EXISTS spans_by_rollout ON spans (rollout_id, seq);
CREATE INDEX IF NOT EXISTS spans_by_trace ON spans (trace_id);
CREATE TABLE IF NOT EXISTS rollouts (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id TEXT NOT NULL UNIQUE,
    task_id TEXT NOT NULL,
    input TEXT NOT NULL,
    group_id TEXT,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    reward REAL,
    metadata TEXT NOT NULL,
    max_attempts INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS rollouts_by_status ON rollouts (status, seq);
CREATE TABLE IF NOT EXISTS attempts (
    attempt_id TEXT PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    number INTEGER NOT NULL,
    status TEXT NOT NULL,
    worker_id TEXT,
    started_at REAL,
    ended_at REAL,
    error TEXT
);
CREATE INDEX IF NOT EXISTS attempts_by_rollout ON attempts (rollout_id, number);
CREATE TABLE IF NOT EXISTS resources (
    name TEXT NOT NULL,
    version INTEGER NOT NULL,
    value TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (name, version)
);
"""


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class SqliteStore:
    """The :class:`~agl_core.store.base.Store` on one SQLite file (``":memory:"`` for tests)."""

    def __init__(self, path: str | Path, *, synchronous: str = "NORMAL") -> None:
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}")
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
        self._conn.execute("PRAGMA busy_timeout=10000")
        self._conn.executescript(_SCHEMA)

    # --- spans ---------------------------------------------------------------------------------------
    def add_spans(self, spans: Sequence[Span]) -> int:
        now = time.time()
        rows = [
            (
                s.trace_id,
                s.span_id,
                s.parent_span_id,
                s.rollout_id,
                s.attempt_id,
                s.name,
                s.start_ns,
                s.end_ns,
                s.status_code,
                s.status_message,
                _json(dict(s.attributes)),
                _json(list(s.events)),
                _json(dict(s.resource)),
                now,
            )
            for s in spans
        ]
        with self._lock:
            before = self._conn.total_changes
            with self._transaction():
                self._conn.executemany(
                    "INSERT OR IGNORE INTO spans (trace_id, span_id, parent_span_id, rollout_id, attempt_id,"
                    " name, start_ns, end_ns, status_code, status_message, attributes, events, resource,"
                    " ingested_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    rows,
                )
            return self._conn.total_changes - before

    def query_spans(
        self,
        *,
        rollout_ids: Sequence[str] | None = None,
        trace_id: str | None = None,
        after_seq: int = 0,
        limit: int = 10_000,
    ) -> list[Span]:
        where = ["seq > ?"]
        args: list[Any] = [after_seq]
        if rollout_ids is not None:
            if not rollout_ids:
                return []
            where.append(f"rollout_id IN ({','.join('?' * len(rollout_ids))})")
            args.extend(rollout_ids)
        if trace_id is not None:
            where.append("trace_id = ?")
            args.append(trace_id)
        args.append(limit)
        sql = (
            "SELECT seq, trace_id, span_id, parent_span_id, name, start_ns, end_ns, status_code,"
            f" status_message, attributes, events, resource FROM spans WHERE {' AND '.join(where)}"
            " ORDER BY seq LIMIT ?"
        )
        with self._lock:
            rows = self._conn.execute(sql, args).fetchall()
        return [
            Span(
                seq=r[0],
                trace_id=r[1],
                span_id=r[2],
                parent_span_id=r[3],
                name=r[4],
                start_ns=r[5],
                end_ns=r[6],
                status_code=r[7],
                status_message=r[8],
                attributes=json.loads(r[9]),
                events=tuple(json.loads(r[10])),
                resource=json.loads(r[11]),
            )
            for r in rows
        ]

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
                    _json(req.get("input")),
                    req.get("group_id"),
                    RolloutStatus.QUEUED.value,
                    now,
                    _json(dict(req.get("metadata") or {})),
                    max_attempts,
                )
            )
        with self._lock, self._transaction():
            try:
                self._conn.executemany(
                    "INSERT INTO rollouts (rollout_id, task_id, input, group_id, status, created_at, metadata,"
                    " max_attempts) VALUES (?,?,?,?,?,?,?,?)",
                    rows,
                )
            except sqlite3.IntegrityError as exc:
                raise StoreError(f"a rollout with that id already exists: {exc}") from None
            return self._load_rollouts([r[0] for r in rows])

    def dequeue_rollout(self, worker_id: str) -> tuple[Rollout, Attempt] | None:
        now = time.time()
        with self._lock, self._transaction():
            row = self._conn.execute(
                "SELECT rollout_id FROM rollouts WHERE status = ? ORDER BY seq LIMIT 1",
                (RolloutStatus.QUEUED.value,),
            ).fetchone()
            if row is None:
                return None
            rollout_id = row[0]
            (number,) = self._conn.execute(
                "SELECT COUNT(*) FROM attempts WHERE rollout_id = ?", (rollout_id,)
            ).fetchone()
            attempt_id = f"at-{uuid.uuid4().hex[:16]}"
            self._conn.execute(
                "INSERT INTO attempts (attempt_id, rollout_id, number, status, worker_id, started_at)"
                " VALUES (?,?,?,?,?,?)",
                (attempt_id, rollout_id, number + 1, RolloutStatus.RUNNING.value, worker_id, now),
            )
            self._conn.execute(
                "UPDATE rollouts SET status = ? WHERE rollout_id = ?", (RolloutStatus.RUNNING.value, rollout_id)
            )
            rollout = self._load_rollouts([rollout_id])[0]
        attempt = next(a for a in rollout.attempts if a.attempt_id == attempt_id)
        return rollout, attempt

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
        with self._lock, self._transaction():
            row = self._conn.execute(
                "SELECT a.rollout_id, a.status, a.number, r.max_attempts FROM attempts a"
                " JOIN rollouts r ON r.rollout_id = a.rollout_id WHERE a.attempt_id = ?",
                (attempt_id,),
            ).fetchone()
            if row is None:
                raise NotFoundError(f"no attempt {attempt_id!r}")
            rollout_id, current, number, max_attempts = row
            if RolloutStatus(current).finished:
                raise StoreError(f"attempt {attempt_id!r} already finished as {current!r}")
            self._conn.execute(
                "UPDATE attempts SET status = ?, ended_at = ?, error = ? WHERE attempt_id = ?",
                (status.value, time.time(), error, attempt_id),
            )
            retry = status in (RolloutStatus.FAILED, RolloutStatus.TIMED_OUT) and number < max_attempts
            new_status = RolloutStatus.QUEUED if retry else status
            self._conn.execute(
                "UPDATE rollouts SET status = ?, reward = COALESCE(?, reward) WHERE rollout_id = ?",
                (new_status.value, reward, rollout_id),
            )
            return self._load_rollouts([rollout_id])[0]

    def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        with self._lock:
            found = self._load_rollouts(list(rollout_ids))
        missing = set(rollout_ids) - {r.rollout_id for r in found}
        if missing:
            raise NotFoundError(f"no rollout(s) {sorted(missing)!r}")
        return found

    def _load_rollouts(self, rollout_ids: list[str]) -> list[Rollout]:
        if not rollout_ids:
            return []
        marks = ",".join("?" * len(rollout_ids))
        attempts: dict[str, list[Attempt]] = {}
        for a in self._conn.execute(
            "SELECT attempt_id, rollout_id, number, status, worker_id, started_at, ended_at, error"
            f" FROM attempts WHERE rollout_id IN ({marks}) ORDER BY number",
            rollout_ids,
        ):
            attempts.setdefault(a[1], []).append(
                Attempt(a[0], a[1], a[2], RolloutStatus(a[3]), a[4], a[5], a[6], a[7])
            )
        order = {rid: i for i, rid in enumerate(rollout_ids)}
        rollouts = [
            Rollout(
                rollout_id=r[0],
                task_id=r[1],
                input=json.loads(r[2]),
                group_id=r[3],
                status=RolloutStatus(r[4]),
                created_at=r[5],
                reward=r[6],
                metadata=json.loads(r[7]),
                attempts=tuple(attempts.get(r[0], ())),
            )
            for r in self._conn.execute(
                "SELECT rollout_id, task_id, input, group_id, status, created_at, reward, metadata"
                f" FROM rollouts WHERE rollout_id IN ({marks})",
                rollout_ids,
            )
        ]
        return sorted(rollouts, key=lambda r: order[r.rollout_id])

    # --- resources -----------------------------------------------------------------------------------
    def put_resource(self, name: str, value: Any) -> Resource:
        with self._lock, self._transaction():
            (latest,) = self._conn.execute(
                "SELECT COALESCE(MAX(version), 0) FROM resources WHERE name = ?", (name,)
            ).fetchone()
            self._conn.execute(
                "INSERT INTO resources (name, version, value, created_at) VALUES (?,?,?,?)",
                (name, latest + 1, _json(value), time.time()),
            )
        return Resource(name, latest + 1, value)

    def get_resource(self, name: str) -> Resource | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT version, value FROM resources WHERE name = ? ORDER BY version DESC LIMIT 1", (name,)
            ).fetchone()
        return Resource(name, row[0], json.loads(row[1])) if row else None

    # --- misc ----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {
                "spans": self._conn.execute("SELECT COUNT(*) FROM spans").fetchone()[0],
                "rollouts": self._conn.execute("SELECT COUNT(*) FROM rollouts").fetchone()[0],
                "attempts": self._conn.execute("SELECT COUNT(*) FROM attempts").fetchone()[0],
            }
            for status, count in self._conn.execute("SELECT status, COUNT(*) FROM rollouts GROUP BY status"):
                out[f"rollouts_{status}"] = count
        return out

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _transaction(self) -> _Transaction:
        return _Transaction(self._conn)


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on error); the caller holds the store lock."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __enter__(self) -> None:
        self._conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._conn.execute("COMMIT" if exc_type is None else "ROLLBACK")

