"""The real collector-store (SQLite + the OTLP/HTTP receiver) on a free local port, for tests."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter

from ..records import Span
from ..server import BackgroundServer
from ..store import SqliteStore, Store, StoreClient
from ..store.server import create_store_app
from ..tracing import make_otlp_exporter
from ._tracing import otlp_tracer_provider

__all__ = ["Collector"]


class Collector:
    """The collector-store's HTTP server (OTLP/HTTP span ingest and the store API) on
    ``127.0.0.1:<free port>``, on a background thread.

    Without ``store`` it opens a :class:`~agl_core.store.SqliteStore` on ``path`` (default: a file in a new
    temporary directory, removed on :meth:`stop`) and closes it on :meth:`stop`; a given ``store`` is
    served as it is and left open. ``token`` makes the server require ``Authorization: Bearer <token>``.

    Spans are acknowledged to an OTLP exporter only once committed, so after a span processor exported
    them (``SimpleSpanProcessor``, or ``force_flush()``) :meth:`spans` returns them. Use it as a context
    manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self, store: Store | None = None, *, path: str | Path | None = None, token: str | None = None
    ) -> None:
        if store is not None and path is not None:
            raise ValueError("Collector: give a store or a path for a new SQLite store, not both")
        self._tempdir: str | None = None
        if store is None:
            if path is None:
                self._tempdir = tempfile.mkdtemp(prefix="agl-test-store-")
                path = Path(self._tempdir) / "store.sqlite"
            store = SqliteStore(path)
            self._owns_store = True
        else:
            self._owns_store = False
        self.store: Store = store
        self.token = token
        app = create_store_app(store, token=token)
        self._pipeline = app.state.pipeline
        self._server = BackgroundServer(app)
        self._client: StoreClient | None = None
        self._providers: list[TracerProvider] = []
        #: The store's base URL (``http://127.0.0.1:<port>``); OTLP exporters post to ``url + "/v1/traces"``.
        self.url = self._server.url

    @property
    def otlp_endpoint(self) -> str:
        """The OTLP/HTTP traces endpoint: ``url + "/v1/traces"``."""
        return self.url + "/v1/traces"

    @property
    def client(self) -> StoreClient:
        """A :class:`~agl_core.store.StoreClient` of this collector (made on first use, closed on stop)."""
        if self._client is None:
            self._client = StoreClient(self.url, token=self.token)
        return self._client

    def start(self) -> Collector:
        self._server.start()
        return self

    def stop(self) -> None:
        """Shut down the tracer providers made by :meth:`tracer_provider` (flushing them), then the
        server, then the store and temporary directory this collector made."""
        for provider in self._providers:
            provider.shutdown()
        self._providers.clear()
        if self._client is not None:
            self._client.close()
            self._client = None
        self._server.stop()
        self._pipeline.close()
        if self._owns_store:
            self.store.close()
        if self._tempdir is not None:
            shutil.rmtree(self._tempdir, ignore_errors=True)
            self._tempdir = None

    def __enter__(self) -> Collector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def exporter(self) -> SpanExporter:
        """A new real OTLP/HTTP span exporter aimed at this collector."""
        return make_otlp_exporter(self.url, token=self.token)

    def tracer_provider(self, *, batch: bool = False, rollout_spans: bool = True) -> TracerProvider:
        """A new tracer provider exporting here (see :func:`~agl_core.testing.otlp_tracer_provider`);
        :meth:`stop` shuts it down."""
        provider = otlp_tracer_provider(self.url, batch=batch, rollout_spans=rollout_spans, token=self.token)
        self._providers.append(provider)
        return provider

    def spans(
        self, rollout_id: str | None = None, *, trace_id: str | None = None, attempt_id: str | None = None
    ) -> list[Span]:
        """The stored spans matching every given filter (all spans when none is given), in arrival order."""
        return self.store.query_spans(
            rollout_ids=[rollout_id] if rollout_id is not None else None,
            trace_id=trace_id,
            attempt_id=attempt_id,
        )

    def wait_for_spans(
        self,
        count: int,
        rollout_id: str | None = None,
        *,
        trace_id: str | None = None,
        attempt_id: str | None = None,
        timeout_s: float = 10.0,
    ) -> list[Span]:
        """:meth:`spans` once at least ``count`` of them arrived; TimeoutError after ``timeout_s`` seconds
        (the message says how many did)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.spans(rollout_id, trace_id=trace_id, attempt_id=attempt_id)
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(found)} of {count} spans arrived within {timeout_s} s"
                    f" (rollout_id={rollout_id!r}, trace_id={trace_id!r}, attempt_id={attempt_id!r});"
                    " flush the tracer provider that exports them (force_flush()) or wait longer"
                )
            time.sleep(0.02)
