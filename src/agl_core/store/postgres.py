"""PostgreSQL backend of the collector-store, for stores shared by several machines.

Same tables and state machine as SQLite. Spans are written with one ``INSERT ... SELECT FROM unnest``
statement per batch; dequeue uses ``FOR UPDATE SKIP LOCKED`` so several store servers may share one
database (``seq`` then orders spans per server commit, not globally).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._otlp import SpanRow
from ._sql import _SPAN_COLUMNS, SqlStore

__all__ = ["PostgresStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS spans (
    seq BIGSERIAL PRIMARY KEY,
    trace_id BYTEA NOT NULL,
    span_id BYTEA NOT NULL,
    parent_span_id BYTEA,
    name TEXT NOT NULL,
    start_ns BIGINT NOT NULL,
    end_ns BIGINT NOT NULL,
    status_code INTEGER NOT NULL,
    rollout_id TEXT,
    attempt_id TEXT,
    scope_key BYTEA NOT NULL,
    body BYTEA NOT NULL,
    UNIQUE (trace_id, span_id)
);
CREATE INDEX IF NOT EXISTS spans_by_rollout ON spans (rollout_id, seq);
CREATE INDEX IF NOT EXISTS spans_by_attempt ON spans (attempt_id) WHERE attempt_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS spans_by_start ON spans (start_ns);
CREATE TABLE IF NOT EXISTS span_scopes (
    scope_key BYTEA PRIMARY KEY,
    resource BYTEA NOT NULL,
    scope BYTEA NOT NULL
);
CREATE TABLE IF NOT EXISTS rollouts (
    seq BIGSERIAL PRIMARY KEY,
    rollout_id TEXT NOT NULL UNIQUE,
    task_id TEXT NOT NULL,
    input TEXT NOT NULL,
    group_id TEXT,
    status TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    reward DOUBLE PRECISION,
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
    started_at DOUBLE PRECISION,
    heartbeat_at DOUBLE PRECISION,
    lease_expires_at DOUBLE PRECISION,
    ended_at DOUBLE PRECISION,
    error TEXT
);
CREATE INDEX IF NOT EXISTS attempts_by_rollout ON attempts (rollout_id, number);
CREATE INDEX IF NOT EXISTS attempts_by_status ON attempts (status, lease_expires_at);
CREATE TABLE IF NOT EXISTS resources (
    name TEXT NOT NULL,
    version INTEGER NOT NULL,
    value TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (name, version)
);
"""


def _no_nul(value: Any) -> Any:
    # PostgreSQL text cannot hold NUL characters; they are dropped from text columns.
    return value.replace("\x00", "") if isinstance(value, str) and "\x00" in value else value


class _Conn:
    """A psycopg connection with sqlite3's ``execute`` / ``executemany`` shape and ``?`` placeholders."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any:
        return self.raw.execute(sql.replace("?", "%s"), [_no_nul(a) for a in args])

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self.raw.cursor() as cur:
            cur.executemany(sql.replace("?", "%s"), [[_no_nul(a) for a in row] for row in rows])

    def close(self) -> None:
        self.raw.close()


class PostgresStore(SqlStore):
    """The :class:`~agl_core.store.base.Store` on PostgreSQL (``postgresql://user@host:port/db``).

    ``schema`` keeps agl's tables in their own schema (created if missing).
    """

    _lock_rows = " FOR UPDATE SKIP LOCKED"

    def __init__(self, dsn: str, *, schema: str | None = None) -> None:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise ImportError("the PostgreSQL backend needs psycopg: pip install 'agl[postgres]'") from None
        if schema is not None and not schema.replace("_", "").isalnum():
            raise ValueError(f"schema must be letters, digits and underscores, got {schema!r}")
        self.dsn = dsn
        self.schema = schema
        super().__init__()
        with self._write_lock:
            self._writer.raw.execute(_SCHEMA)

    def _connect(self) -> _Conn:
        import psycopg

        raw = psycopg.connect(self.dsn, autocommit=True)
        if self.schema:
            raw.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
            raw.execute(f'SET search_path TO "{self.schema}"')
        return _Conn(raw)

    def _begin(self, conn: Any) -> None:
        conn.raw.execute("BEGIN")

    def _in(self, column: str, values: Sequence[Any]) -> tuple[str, list[Any]]:
        return f"{column} = ANY(?)", [list(values)]

    def _insert_spans(self, conn: Any, rows: Sequence[SpanRow]) -> int:
        columns = list(zip(*rows))
        cursor = conn.raw.execute(
            f"INSERT INTO spans ({_SPAN_COLUMNS}) SELECT * FROM unnest("
            "%s::bytea[], %s::bytea[], %s::bytea[], %s::text[], %s::bigint[], %s::bigint[], %s::int[],"
            " %s::text[], %s::text[], %s::bytea[], %s::bytea[]) ON CONFLICT DO NOTHING",
            [list(c) for c in columns],
        )
        return cursor.rowcount
