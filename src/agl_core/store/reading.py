"""Opening a store by what names it (:func:`connect`), and reading its spans incrementally
(:class:`SpanReader`): the one way the trainer's stored-traces job, ``agl improve``'s watcher, the
dashboard, ``agl inspect`` and ``agl reward`` reach a store."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..records import Rollout, Span
from .base import NotFoundError, Store, StoreError
from .client import StoreClient
from .sqlite import SqliteStore

__all__ = ["SpanReader", "connect", "is_store_url", "open_store", "rollout_record"]

_URL_SCHEMES = ("http://", "https://")
_POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_store_url(target: str) -> bool:
    """Whether ``target`` names a running store (``http://`` or ``https://``) rather than a database."""
    return target.startswith(_URL_SCHEMES)


def connect(target: str, token: str | None = None, *, must_exist: bool = False) -> Store | StoreClient:
    """The store ``target`` names: a running store's URL (``http://`` or ``https://``; ``token`` is its
    bearer token), a PostgreSQL DSN (``postgresql://``), or a SQLite file (a path, or ``sqlite:///path``).

    ``must_exist``: a SQLite file must be there already (for reading a store an earlier run left: a
    mistyped path is an error, not a new empty store). Raises :class:`StoreError` saying which forms a
    target can take. The caller closes what it gets.
    """
    if not isinstance(target, str) or not target.strip():
        raise StoreError("no store named: give a store URL (http://...), a PostgreSQL DSN or a SQLite file")
    if is_store_url(target):
        return StoreClient(target, token=token)
    if target.startswith(_POSTGRES_SCHEMES):
        return open_store(target)
    path = target.removeprefix("sqlite:///")
    if must_exist and not Path(path).is_file():
        raise StoreError(
            f"{target} is neither a store URL (http://...), a PostgreSQL DSN (postgresql://...) nor an"
            " existing SQLite file"
        )
    return open_store(path)


def open_store(db: str) -> Store:
    """Open the backend named by ``db``: ``postgresql://...`` for PostgreSQL, otherwise a SQLite file path
    (``sqlite:///path`` also works)."""
    if db.startswith(_POSTGRES_SCHEMES):
        from .postgres import PostgresStore

        try:
            return PostgresStore(db)
        except ImportError:
            raise
        except Exception as exc:
            raise StoreError(f"cannot open PostgreSQL at {db}: {exc}") from None
    if db.startswith("sqlite:///"):
        db = db[len("sqlite:///") :]
    return SqliteStore(db)


def rollout_record(backend: Any, rollout_id: str) -> list[Rollout]:
    """The record of ``rollout_id`` in ``backend`` as a list of one, or empty when it has none."""
    try:
        return list(backend.get_rollouts([rollout_id]))
    except NotFoundError:
        return []


class SpanReader:
    """A store's spans, read page by page in the order it stored them (their ``seq``) and kept, with the
    records of the rollouts they name. Each :meth:`read` goes on from where the last one stopped, so a
    watcher reads only what is new; a read that fails (the store went away) loses nothing already read,
    and the next one goes on from the last page it kept."""

    def __init__(self, *, page: int = 10_000) -> None:
        self.page = page
        self.spans: list[Span] = []
        self.records: dict[str, Rollout] = {}
        #: The highest ``seq`` read so far.
        self.cursor = 0

    def read(self, backend: Store | StoreClient) -> int:
        """Read the spans stored since the last read, and the records of rollouts still without one;
        how many new spans came."""
        new = 0
        while True:
            page: Sequence[Span] = backend.query_spans(after_seq=self.cursor, limit=self.page)
            if page:
                self.spans.extend(page)  # with the cursor, page by page: a later failure loses neither
                self.cursor = max(self.cursor, max(s.seq or 0 for s in page))
                new += len(page)
            if len(page) < self.page:
                break
        missing = sorted({s.rollout_id for s in self.spans if s.rollout_id} - set(self.records))
        for i in range(0, len(missing), 500):
            chunk = missing[i : i + 500]
            try:
                found = backend.get_rollouts(chunk)
            except NotFoundError:  # some have no record (a session no runner registered): one by one
                found = [r for rid in chunk for r in rollout_record(backend, rid)]
            self.records.update((r.rollout_id, r) for r in found)
        return new
