"""SQLite backend of the collector-store: one file, WAL journal, the embedded default.

Ingest is acknowledged only after its transaction commits, so a crash of the server process loses no
acknowledged span. ``synchronous=NORMAL`` in WAL mode survives process crashes; a power loss may drop the
last commits (``synchronous="FULL"`` rules that out too, at some cost in throughput).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._otlp import SpanRow
from ._sql import _SPAN_COLUMNS, SqlStore

__all__ = ["SqliteStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS spans (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    trace_id BLOB NOT NULL,
    span_id BLOB NOT NULL,
    parent_span_id BLOB,
    name TEXT NOT NULL,
    start_ns INTEGER NOT NULL,
    end_ns INTEGER NOT NULL,
    status_code INTEGER NOT NULL,
    rollout_id TEXT,
    attempt_id TEXT,
    scope_key BLOB NOT NULL,
    body BLOB NOT NULL,
    UNIQUE (trace_id, span_id)
);
CREATE INDEX IF NOT EXISTS spans_by_rollout ON spans (rollout_id, seq);
CREATE INDEX IF NOT EXISTS spans_by_attempt ON spans (attempt_id) WHERE attempt_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS spans_by_start ON spans (start_ns);
CREATE TABLE IF NOT EXISTS span_scopes (
    scope_key BLOB PRIMARY KEY,
    resource BLOB NOT NULL,
    scope BLOB NOT NULL
);
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
    max_attempts INTEGER NOT NULL,
    consumed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS rollouts_by_status ON rollouts (status, seq);
CREATE TABLE IF NOT EXISTS attempts (
    attempt_id TEXT PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    number INTEGER NOT NULL,
    status TEXT NOT NULL,
    worker_id TEXT,
    started_at REAL,
    heartbeat_at REAL,
    lease_expires_at REAL,
    ended_at REAL,
    error TEXT
);
CREATE INDEX IF NOT EXISTS attempts_by_rollout ON attempts (rollout_id, number);
CREATE INDEX IF NOT EXISTS attempts_by_status ON attempts (status, lease_expires_at);
CREATE TABLE IF NOT EXISTS resources (
    name TEXT NOT NULL,
    version INTEGER NOT NULL,
    value TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (name, version)
);
"""


class SqliteStore(SqlStore):
    """The :class:`~agl_core.store.base.Store` on one SQLite file."""

    def __init__(self, path: str | Path, *, synchronous: str = "NORMAL") -> None:
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}")
        if str(path) == ":memory:":
            raise ValueError("SqliteStore needs a file path (readers and the writer share it); use a temporary file")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._synchronous = synchronous.upper()
        super().__init__()
        self._writer.executescript(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self._synchronous}")
        conn.execute("PRAGMA busy_timeout=30000")
        return conn

    def _begin(self, conn: Any) -> None:
        conn.execute("BEGIN IMMEDIATE")

    def _insert_spans(self, conn: Any, rows: Sequence[SpanRow]) -> int:
        before = conn.total_changes
        conn.executemany(
            f"INSERT INTO spans ({_SPAN_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT DO NOTHING", rows
        )
        return conn.total_changes - before
