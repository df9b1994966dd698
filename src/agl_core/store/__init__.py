"""The collector-store: OTLP span ingest plus the task / rollout / resource API."""

from .base import NotFoundError, RolloutRequest, Store, StoreError
from .client import StoreClient
from .sqlite import SqliteStore

__all__ = ["NotFoundError", "RolloutRequest", "SqliteStore", "Store", "StoreClient", "StoreError", "open_store"]


def open_store(db: str) -> Store:
    """Open the backend named by ``db``: a SQLite file path (or ``sqlite:///path``)."""
    if db.startswith(("postgresql://", "postgres://")):
        raise StoreError("the PostgreSQL backend is not available in this version; use a SQLite file path")
    if db.startswith("sqlite:///"):
        db = db[len("sqlite:///"):]
    return SqliteStore(db)
