"""The tables the SQL backends share and the database connection they need: the schema's DDL, the span
columns, the DB-API shape of a connection, and the JSON the tables hold."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeVar

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from .. import semconv
from ..records import Attempt, Rollout, RolloutStatus

#: Attributes that name the agent a span belongs to, as :meth:`SqlStore.list_rollouts` looks for them.
AGENT_NAME_KEYS = (semconv.GEN_AI_AGENT_NAME, semconv.OI_AGENT_NAME)


def agent_attribute_bytes(key: str, name: str) -> bytes:
    """The bytes of attribute ``key = name`` (a string) inside an encoded span."""
    return KeyValue(key=key, value=AnyValue(string_value=name)).SerializeToString()


_SPAN_COLUMNS = (
    "trace_id, span_id, parent_span_id, name, start_ns, end_ns, status_code, rollout_id, attempt_id,"
    " scope_key, body"
)


#: The tables of every SQL backend; each fills in its column types (``schema(**types)``).
_SCHEMA_TEMPLATE = """
CREATE TABLE IF NOT EXISTS spans (
    seq {serial},
    trace_id {blob} NOT NULL,
    span_id {blob} NOT NULL,
    parent_span_id {blob},
    name TEXT NOT NULL,
    start_ns {bigint} NOT NULL,
    end_ns {bigint} NOT NULL,
    status_code INTEGER NOT NULL,
    rollout_id TEXT,
    attempt_id TEXT,
    scope_key {blob} NOT NULL,
    body {blob} NOT NULL,
    UNIQUE (trace_id, span_id)
);
CREATE INDEX IF NOT EXISTS spans_by_rollout ON spans (rollout_id, seq);
CREATE INDEX IF NOT EXISTS spans_by_attempt ON spans (attempt_id) WHERE attempt_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS spans_by_start ON spans (start_ns);
CREATE TABLE IF NOT EXISTS span_scopes (
    scope_key {blob} PRIMARY KEY,
    resource {blob} NOT NULL,
    scope {blob} NOT NULL
);
CREATE TABLE IF NOT EXISTS rollouts (
    seq {serial},
    rollout_id TEXT NOT NULL UNIQUE,
    task_id TEXT NOT NULL,
    input TEXT NOT NULL,
    group_id TEXT,
    status TEXT NOT NULL,
    created_at {real} NOT NULL,
    reward {real},
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
    started_at {real},
    heartbeat_at {real},
    lease_expires_at {real},
    ended_at {real},
    error TEXT
);
CREATE INDEX IF NOT EXISTS attempts_by_rollout ON attempts (rollout_id, number);
CREATE INDEX IF NOT EXISTS attempts_by_status ON attempts (status, lease_expires_at);
CREATE TABLE IF NOT EXISTS resources (
    name TEXT NOT NULL,
    version INTEGER NOT NULL,
    value TEXT NOT NULL,
    created_at {real} NOT NULL,
    PRIMARY KEY (name, version)
);
CREATE TABLE IF NOT EXISTS reward_ids (
    reward_id TEXT PRIMARY KEY,
    request TEXT NOT NULL,
    rollout_id TEXT,
    trace_id {blob} NOT NULL,
    span_id {blob} NOT NULL,
    parent_span_id {blob},
    time_ns {bigint} NOT NULL,
    created_at {real} NOT NULL
);
"""


class Cursor(Protocol):
    """The part of a DB-API cursor the store uses (``sqlite3.Cursor`` and ``psycopg.Cursor`` both fit).
    Rows are the driver's own row objects (tuples), hence ``Any``."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Connection(Protocol):
    """The part of a connection the store uses: sqlite3's ``execute`` / ``executemany`` with ``?``
    placeholders (the PostgreSQL backend wraps psycopg to this shape)."""

    def execute(self, sql: str, parameters: Sequence[Any] = ..., /) -> Cursor: ...

    def executemany(self, sql: str, seq_of_parameters: Iterable[Sequence[Any]], /) -> object: ...

    def close(self) -> None: ...


_C = TypeVar("_C", bound=Connection)


def schema(*, serial: str, blob: str, real: str, bigint: str) -> str:
    """The DDL for a backend whose auto-increment key, byte, float and 64-bit integer types are given."""
    return _SCHEMA_TEMPLATE.format(serial=serial, blob=blob, real=real, bigint=bigint)


def _json(value: Any, what: str = "") -> str:
    """``value`` as the JSON text a table holds; ``what`` names it in the errors (``input``)."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise ValueError(
            "NaN and Infinity cannot be stored (JSON has no such numbers); send finite numbers or null"
        ) from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        where = lone_surrogate_at(value, what) or what or "the value"
        raise ValueError(
            f"{where} holds a lone UTF-16 surrogate, which is not text; send valid Unicode"
        ) from None
    return text


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The path (``a.b.0``) of the first string or key in ``value`` that holds a lone UTF-16 surrogate
    (which no UTF-8 database can store), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "the value"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and lone_surrogate_at(key) is not None:
                return f"a key in {path or 'the object'} ({key.encode('utf-8', 'backslashreplace')!r})"
            found = lone_surrogate_at(item, here)
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for n, item in enumerate(value):
            found = lone_surrogate_at(item, f"{path}.{n}" if path else str(n))
            if found is not None:
                return found
    return None


#: The columns :func:`attempt_from_row` and :func:`rollout_from_row` read, in their order.
ATTEMPT_COLUMNS = "attempt_id, rollout_id, number, status, worker_id, started_at, ended_at, error"
ROLLOUT_COLUMNS = "rollout_id, task_id, input, group_id, status, created_at, reward, metadata"


def attempt_from_row(a: Sequence[Any]) -> Attempt:
    return Attempt(a[0], a[1], a[2], RolloutStatus(a[3]), a[4], a[5], a[6], a[7])


def rollout_from_row(r: Sequence[Any], attempts: Iterable[Attempt]) -> Rollout:
    return Rollout(
        rollout_id=r[0],
        task_id=r[1],
        input=json.loads(r[2]),
        group_id=r[3],
        status=RolloutStatus(r[4]),
        created_at=r[5],
        reward=r[6],
        metadata=json.loads(r[7]),
        attempts=tuple(attempts),
    )
