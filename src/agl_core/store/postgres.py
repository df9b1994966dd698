"""PostgreSQL backend of the collector-store, for stores shared by several machines.

Same tables and state machine as SQLite. Spans are written with one ``INSERT ... SELECT FROM unnest``
statement per batch; dequeue uses ``FOR UPDATE SKIP LOCKED`` so several store servers may share one
database (``seq`` then orders spans per server commit, not globally).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ._schema import _SPAN_COLUMNS, schema
from ._sql import SqlStore
from .formats.otlp import SpanRow

if TYPE_CHECKING:  # psycopg is an optional dependency, imported where a store is opened
    import psycopg
    from psycopg.rows import TupleRow

__all__ = ["PostgresStore"]

_SCHEMA = schema(serial="BIGSERIAL PRIMARY KEY", blob="BYTEA", real="DOUBLE PRECISION", bigint="BIGINT")


def _no_nul(value: Any) -> Any:
    # PostgreSQL text cannot hold NUL characters; they are dropped from text columns (and from the lists
    # bound to "= ANY(?)").
    if isinstance(value, str):
        return value.replace("\x00", "") if "\x00" in value else value
    if isinstance(value, list):
        return [_no_nul(v) for v in value]
    return value


class _Conn:
    """A psycopg connection with sqlite3's ``execute`` / ``executemany`` shape and ``?`` placeholders.

    A connection the server cut while it sat idle (PostgreSQL restarted) is only found dead when next
    used. When that use is a ``BEGIN`` or a read outside a transaction, which nothing depends on, it is
    made again once on a new connection (from ``connect``) instead of failing while the server is back.
    """

    def __init__(self, connect: Callable[[], psycopg.Connection[TupleRow]]) -> None:
        import psycopg
        from psycopg.pq import TransactionStatus

        self._connect = connect
        self._lost: type[Exception] = psycopg.OperationalError
        self._idle = TransactionStatus.IDLE
        self.raw = connect()

    def execute(self, sql: str, args: Sequence[Any] = ()) -> psycopg.Cursor[TupleRow]:
        query, params = sql.replace("?", "%s"), [_no_nul(a) for a in args]
        idle = self.raw.info.transaction_status == self._idle
        try:
            return self.raw.execute(query, params)
        except self._lost:
            if not (idle and self.raw.broken and sql.lstrip().upper().startswith(("BEGIN", "SELECT"))):
                raise
        self.raw.close()
        self.raw = self._connect()  # fails (-> 503) if the server is still down
        return self.raw.execute(query, params)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        with self.raw.cursor() as cur:
            cur.executemany(sql.replace("?", "%s"), [[_no_nul(a) for a in row] for row in rows])

    def close(self) -> None:
        self.raw.close()


class PostgresStore(SqlStore[_Conn]):
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
        return _Conn(self._connect_raw)

    def _connect_raw(self) -> psycopg.Connection[TupleRow]:
        import psycopg

        raw = psycopg.connect(self.dsn, autocommit=True)
        if self.schema:
            raw.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
            raw.execute(f'SET search_path TO "{self.schema}"')
        return raw

    def _begin(self, conn: _Conn) -> None:
        conn.execute("BEGIN")

    def _alive(self, conn: _Conn) -> bool:
        return not (conn.raw.closed or conn.raw.broken)

    def _unavailable(self, exc: BaseException) -> bool:
        import psycopg

        # connection lost, server shutting down or starting, too many connections, disk full (53100)
        return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError) or (
            isinstance(exc, psycopg.Error) and (exc.sqlstate or "").startswith(("08", "53", "57P"))
        )

    def _purge(self, conn: _Conn) -> None:
        # Dead rows stay in the table files until VACUUM marks their space free for reuse; their bytes
        # (and PostgreSQL's own WAL segments) may remain on disk until overwritten (docs/security.md).
        conn.raw.execute("VACUUM spans")

    def _in(self, column: str, values: Sequence[Any]) -> tuple[str, list[Any]]:
        return f"{column} = ANY(?)", [list(values)]

    def _metadata_is(self, key: str, value: Any) -> tuple[str, list[Any]]:
        return f"(metadata::jsonb -> '{key}') = ?::jsonb", [json.dumps(value)]

    def _contains_bytes(self, column: str) -> str:
        return f"position(?::bytea in {column}) > 0"

    def _insert_spans(self, conn: _Conn, rows: Sequence[SpanRow]) -> int:
        columns = list(zip(*rows, strict=True))  # every row has the same 11 columns
        cursor = conn.raw.execute(
            f"INSERT INTO spans ({_SPAN_COLUMNS}) SELECT * FROM unnest("
            "%s::bytea[], %s::bytea[], %s::bytea[], %s::text[], %s::bigint[], %s::bigint[], %s::int[],"
            " %s::text[], %s::text[], %s::bytea[], %s::bytea[]) ON CONFLICT DO NOTHING",
            [list(c) for c in columns],
        )
        return cursor.rowcount
