"""The collector-store: OTLP span ingest plus the task / rollout / resource API."""

from __future__ import annotations

from .base import (
    NotFoundError,
    RolloutFilter,
    RolloutPage,
    RolloutRequest,
    Store,
    StoreError,
    StoreUnavailableError,
)
from .client import AsyncStoreClient, StoreClient
from .sqlite import SqliteStore

__all__ = [
    "AsyncStoreClient",
    "NotFoundError",
    "RolloutFilter",
    "RolloutPage",
    "RolloutRequest",
    "SqliteStore",
    "Store",
    "StoreClient",
    "StoreError",
    "StoreUnavailableError",
    "open_store",
]


def open_store(db: str) -> Store:
    """Open the backend named by ``db``: ``postgresql://...`` for PostgreSQL, otherwise a SQLite file path
    (``sqlite:///path`` also works)."""
    if db.startswith(("postgresql://", "postgres://")):
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
