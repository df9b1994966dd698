"""The whole collector-store service: OTLP/HTTP + API, OTLP/gRPC, and the maintenance loop
(reclaiming attempts whose runner died, retention)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from ..pipeline.rewards import DEFAULT_REWARD_RANGE, RewardRange
from ..server import BackgroundServer
from ._grpc import start_grpc_server
from ._loose import LooseSpans
from ._sql import SqlStore
from .base import Store
from .ingest import IngestPipeline
from .redact import Redactor
from .server import create_store_app
from .sqlite import SqliteStore

__all__ = ["RetentionPolicy", "StoreService", "parse_duration"]

logger = logging.getLogger(__name__)

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """Seconds in ``"90s"``, ``"15m"``, ``"12h"``, ``"7d"`` or ``"2w"``."""
    text = text.strip().lower()
    if len(text) >= 2 and text[-1] in _UNITS:
        try:
            value = float(text[:-1])
        except ValueError:
            value = -1
        if value > 0:
            return value * _UNITS[text[-1]]
    raise ValueError(f"{text!r} is not a duration like 90s, 15m, 12h, 7d or 2w")


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    #: delete spans that started longer ago than this
    max_age_s: float | None = None
    #: delete the spans of rollouts a training step marked consumed
    consumed: bool = False

    @classmethod
    def parse(cls, rules: list[str]) -> RetentionPolicy | None:
        """From ``--retention`` values: a duration (``7d``) and/or ``consumed``."""
        max_age, consumed = None, False
        for rule in rules:
            if rule == "consumed":
                consumed = True
            else:
                try:
                    max_age = parse_duration(rule)
                except ValueError as exc:
                    raise ValueError(
                        f"--retention {rule!r}: give a duration (7d, 12h) or 'consumed' ({exc})"
                    ) from None
        return cls(max_age, consumed) if (max_age or consumed) else None


class StoreService:
    """Serves one store over HTTP (OTLP + API) and, optionally, OTLP/gRPC."""

    def __init__(
        self,
        store: Store,
        *,
        token: str | None = None,
        redactor: Redactor | None = None,
        retention: RetentionPolicy | None = None,
        max_pending_spans: int = 200_000,
        maintenance_interval_s: float = 5.0,
        parse_workers: int = 0,
        group_wait_s: float | None = None,
        reward_range: RewardRange = DEFAULT_REWARD_RANGE,
    ) -> None:
        self.store = store
        if isinstance(store, SqlStore):  # late rewards written through the store's own API
            store.reward_range = reward_range
        self.token = token
        self.retention = retention
        self.pipeline = IngestPipeline(
            store,
            redactor=redactor,
            reward_range=reward_range,
            max_pending_spans=max_pending_spans,
            parse_workers=parse_workers,
            workers_write=isinstance(store, SqliteStore),
        )
        self.app = create_store_app(store, token=token, pipeline=self.pipeline, redactor=redactor)
        self.maintenance_interval_s = maintenance_interval_s
        #: Spans stored without a rollout, grouped into rollouts once their trace is quiet for
        #: ``group_wait_s`` (:mod:`._loose`; SQL stores, ``None``: off).
        self.loose = (
            LooseSpans(quiet_s=group_wait_s) if group_wait_s and isinstance(store, SqlStore) else None
        )
        self._grpc: Any = None
        self._http: BackgroundServer | None = None
        self._stop = threading.Event()
        self._maintenance: threading.Thread | None = None
        self.grpc_port: int | None = None

    def start_grpc(self, host: str = "127.0.0.1", port: int = 4317) -> int:
        self._grpc, self.grpc_port = start_grpc_server(self.pipeline, host, port, token=self.token)
        return self.grpc_port

    def start_http_background(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._http = BackgroundServer(self.app, host, port).start()
        return self._http.url

    def start_maintenance(self) -> None:
        self._maintenance = threading.Thread(target=self._maintain, name="agl-store-maintenance", daemon=True)
        self._maintenance.start()

    def maintain_once(self) -> None:
        reclaimed = self.store.reclaim_expired()
        if reclaimed:
            logger.warning(
                "agl store: reclaimed %d attempts whose runner stopped sending heartbeats", reclaimed
            )
        if self.loose is not None:
            assert isinstance(self.store, SqlStore)
            grouped, rollouts = self.store.group_loose_spans(self.loose)
            if grouped:
                logger.info(
                    "agl store: %d span(s) sent without a rollout grouped into %d rollout(s)",
                    grouped,
                    rollouts,
                )
        if self.retention is not None:
            deleted = self.store.apply_retention(
                max_age_s=self.retention.max_age_s, consumed=self.retention.consumed
            )
            if deleted:
                logger.info("agl store: retention deleted %d spans", deleted)

    def _maintain(self) -> None:
        while not self._stop.wait(self.maintenance_interval_s):
            try:
                self.maintain_once()
            except Exception:  # keep serving; try again next round
                logger.exception("agl store: maintenance failed")

    def close(self) -> None:
        self._stop.set()
        if self._grpc is not None:
            self._grpc.stop(grace=5).wait()
        if self._http is not None:
            self._http.stop()
        self.pipeline.close()
        if self._maintenance is not None:
            self._maintenance.join(10)
