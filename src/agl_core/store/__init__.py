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
from .reading import SpanReader, connect, is_store_url, open_store, rollout_record
from .sqlite import SqliteStore

__all__ = [
    "AsyncStoreClient",
    "NotFoundError",
    "RolloutFilter",
    "RolloutPage",
    "RolloutRequest",
    "SpanReader",
    "SqliteStore",
    "Store",
    "StoreClient",
    "StoreError",
    "StoreUnavailableError",
    "connect",
    "is_store_url",
    "open_store",
    "rollout_record",
]
