"""SQLite backend of the collector-store: one file, WAL journal, the embedded default.

Ingest is acknowledged only after its transaction commits, so a crash of the server process loses no
acknowledged span. ``synchronous=NORMAL`` in WAL mode survives process crashes; a power loss may drop the
last commits (``synchronous="FULL"`` rules that out too, at some cost in throughput).

Checkpoints (copying the WAL into the database file, and its fsyncs) run on a thread of their own with its
own connection, beside the writer, instead of inside the commit that crossed SQLite's auto-checkpoint
threshold: that took two thirds of a commit's time. A commit is as durable as before (it is in the WAL
either way). When the writer outruns the checkpointer, the WAL is checkpointed with writes held off once
it passes :data:`WAL_LIMIT_BYTES`, so it cannot grow without bound. New database files get
:data:`PAGE_SIZE` pages.
"""

from __future__ import annotations

import itertools
import logging
import os
import sqlite3
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from ._schema import _SPAN_COLUMNS, schema
from ._sql import SqlStore
from .formats.otlp import SpanRow

__all__ = ["SqliteStore"]

logger = logging.getLogger(__name__)

#: Span rows bound to one INSERT statement (fewer where SQLite allows fewer variables): Python's sqlite3
#: gives up the interpreter lock around every statement step, and while another thread runs Python the
#: writer waits up to the switch interval (5 ms) to take it back, so one row per step let a busy thread
#: (the server's event loop, an import's decoding) slow the writer down a hundredfold. Powers of two, so
#: that any batch is written with at most a handful of distinct (cached) statements.
ROWS_PER_INSERT = 256

#: WAL size past which the checkpointer holds writes off to catch up (SQLite's own default is 1000 pages).
WAL_LIMIT_BYTES = 32 * 1024 * 1024

#: Page size of the database files the store creates (see :meth:`SqliteStore._connect`).
PAGE_SIZE = 16384

_SPAN_FIELDS = len(_SPAN_COLUMNS.split(","))
_SCHEMA = schema(serial="INTEGER PRIMARY KEY AUTOINCREMENT", blob="BLOB", real="REAL", bigint="INTEGER")


def _variable_limit(conn: sqlite3.Connection) -> int:
    """How many ``?`` one statement may bind on ``conn``."""
    if sys.version_info >= (3, 11):
        return conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    return 32_766 if sqlite3.sqlite_version_info >= (3, 32, 0) else 999  # SQLite's compiled-in defaults


class SqliteStore(SqlStore[sqlite3.Connection]):
    """The :class:`~agl_core.store.base.Store` on one SQLite file."""

    def __init__(self, path: str | Path, *, synchronous: str = "NORMAL", checkpoints: bool = True) -> None:
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}")
        if str(path) == ":memory:":
            raise ValueError(
                "SqliteStore needs a file path (readers and the writer share it); use a temporary file"
            )
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._synchronous = synchronous.upper()
        self._checkpoints: threading.Thread | None = None
        #: whether this store checkpoints the WAL (not a writer process beside the one that does)
        self._checkpointing = checkpoints
        #: the lock file writers in several processes take turns on (:meth:`share_writes`)
        self._turns: int | None = None
        self._checkpoint_due = threading.Event()
        self._checkpoints_lock = threading.Lock()
        self._stopping = False
        super().__init__()
        self._writer.executescript(_SCHEMA)
        # the checkpointer thread checkpoints instead (started with the first write)
        self._writer.execute("PRAGMA wal_autocheckpoint=0")
        self._insert_sql: dict[int, str] = {}

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        # A new database file gets 16 KiB pages (SQLite's default is 4): a 512-span commit writes about a
        # quarter as many WAL frames (two writes each) and checkpoints copy a quarter as many pages, which
        # took a fifth off the store's CPU per request and kept ingest at 75k spans/s past 1M spans where
        # 4 KiB pages fell to 56-59k (bench/RESULTS.md). A file that exists keeps its page size.
        conn.execute(f"PRAGMA page_size={PAGE_SIZE}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self._synchronous}")
        conn.execute("PRAGMA busy_timeout=30000")
        # deleted rows are overwritten with zeros, not left in free pages (retention, redaction promises)
        conn.execute("PRAGMA secure_delete=ON")
        return conn

    @property
    def synchronous(self) -> str:
        """The ``PRAGMA synchronous`` level of its connections."""
        return self._synchronous

    @property
    def _purge_on_close(self) -> bool:  # type: ignore[override]
        return self._checkpointing

    def share_writes(self) -> None:
        """Take turns with writers of the same file in other processes that called this too (ingest
        workers, :mod:`agl_core.store.ingest`): each transaction is begun holding an exclusive
        ``flock`` on ``<file>-agl-write.lock``, so a writer waiting for another is woken the moment it
        commits, instead of SQLite's busy handler polling with sleeps of 1-100 ms. The kernel drops the
        lock of a process that dies."""
        if self._turns is not None:
            return
        import fcntl  # noqa: F401  (POSIX only: say so here, not at the first write)

        lock = self.path.with_name(self.path.name + "-agl-write.lock")
        self._turns = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def _hold_writers(self) -> None:
        if self._turns is not None:
            import fcntl

            fcntl.flock(self._turns, fcntl.LOCK_EX)

    def _let_writers_in(self) -> None:
        if self._turns is not None:
            import fcntl

            fcntl.flock(self._turns, fcntl.LOCK_UN)

    def checkpoint_soon(self) -> None:
        """Tell the checkpointer that another process committed to the WAL."""
        if self._checkpointing:
            self._start_checkpoints()
            self._checkpoint_due.set()

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

    def _commit(self, conn: sqlite3.Connection) -> None:
        conn.execute("COMMIT")
        self.checkpoint_soon()

    def _start_checkpoints(self) -> None:
        if self._checkpoints is None:
            with self._checkpoints_lock:
                if self._checkpoints is None:
                    self._checkpoints = threading.Thread(
                        target=self._checkpoint_loop, name="agl-sqlite-checkpoint", daemon=True
                    )
                    self._checkpoints.start()

    def _checkpoint_loop(self) -> None:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        try:
            conn.execute("PRAGMA busy_timeout=30000")
            (page_size,) = conn.execute("PRAGMA page_size").fetchone()
            limit_pages = max(1, WAL_LIMIT_BYTES // page_size)
            while True:
                self._checkpoint_due.wait()
                self._checkpoint_due.clear()
                if self._stopping:
                    return
                try:
                    # copies what is committed, alongside the writer; returns (busy, WAL pages, copied)
                    _, pages, _ = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    if pages >= limit_pages:
                        # the writer kept appending meanwhile: finish with writes held off, so that the
                        # next write starts the WAL over
                        with self._writing_alone():
                            if self._closed:
                                return
                            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except sqlite3.Error as exc:
                    # disk full, say: the WAL keeps the data, and the next commit tries again
                    logger.debug("agl store: checkpoint failed: %s", exc)
        finally:
            conn.close()

    def close(self) -> None:
        thread = self._checkpoints
        if thread is not None:
            self._stopping = True
            self._checkpoint_due.set()
            thread.join(60)
        super().close()
        with self._write_lock:
            if self._turns is not None:
                os.close(self._turns)
                self._turns = None

    def _insert_spans(self, conn: sqlite3.Connection, rows: Sequence[SpanRow]) -> int:
        before = conn.total_changes
        per, variables = ROWS_PER_INSERT, _variable_limit(conn)
        while per > 1 and per * _SPAN_FIELDS > variables:
            per //= 2
        start, count = 0, len(rows)
        while start < count:
            left = count - start
            size = per if left >= per else 1 << (left.bit_length() - 1)  # the rest in powers of two
            sql = self._insert_sql.get(size)
            if sql is None:
                places = ",".join(["(" + ",".join("?" * _SPAN_FIELDS) + ")"] * size)
                sql = self._insert_sql[size] = (
                    f"INSERT INTO spans ({_SPAN_COLUMNS}) VALUES {places} ON CONFLICT DO NOTHING"
                )
            values = list(itertools.chain.from_iterable(rows[start : start + size]))
            if len(values) != size * _SPAN_FIELDS:
                raise ValueError(f"every span row must have {_SPAN_FIELDS} fields")
            conn.execute(sql, values)
            start += size
        return conn.total_changes - before
