"""SQLite backend of the collector-store: one file, WAL journal, the embedded default.

Ingest is acknowledged only after its transaction commits, so a crash of the server process loses no
acknowledged span. ``synchronous=NORMAL`` in WAL mode survives process crashes; a power loss may drop the
last commits (``synchronous="FULL"`` rules that out too, at some cost in throughput).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path

from ._otlp import SpanRow
from ._sql import _SPAN_COLUMNS, SqlStore, schema

__all__ = ["SqliteStore"]

_SCHEMA = schema(serial="INTEGER PRIMARY KEY AUTOINCREMENT", blob="BLOB", real="REAL", bigint="INTEGER")


class SqliteStore(SqlStore[sqlite3.Connection]):
    """The :class:`~agl_core.store.base.Store` on one SQLite file."""

    def __init__(self, path: str | Path, *, synchronous: str = "NORMAL") -> None:
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}")
        if str(path) == ":memory:":
            raise ValueError(
                "SqliteStore needs a file path (readers and the writer share it); use a temporary file"
            )
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
        # deleted rows are overwritten with zeros, not left in free pages (retention, redaction promises)
        conn.execute("PRAGMA secure_delete=ON")
        return conn

    _purge_on_close = True

    def _unavailable(self, exc: BaseException) -> bool:
        # disk full, I/O error, locked past the busy timeout: the write may succeed when retried
        return isinstance(exc, sqlite3.OperationalError) and any(
            words in str(exc).lower() for words in ("disk is full", "disk i/o", "locked", "unable to open")
        )

    def _purge(self, conn: sqlite3.Connection) -> None:
        # copy the WAL into the database and truncate it, so no deleted row survives in the WAL file
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _begin(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")

    def _insert_spans(self, conn: sqlite3.Connection, rows: Sequence[SpanRow]) -> int:
        before = conn.total_changes
        conn.executemany(
            f"INSERT INTO spans ({_SPAN_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT DO NOTHING", rows
        )
        return conn.total_changes - before
