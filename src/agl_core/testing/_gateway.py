"""The real gateway app in front of a backend, on a free local port, for tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette

from .. import semconv
from ..gateway import GatewayMetrics, TemplateRenderer, rollout_base_url
from ..gateway.backend import Backend
from ..server import BackgroundServer
from ..tracing import make_otlp_exporter

if TYPE_CHECKING:
    from ..gateway.capture import Capture

__all__ = ["GatewayServer"]


class GatewayServer:
    """:func:`~agl_core.gateway.create_gateway_app` over ``backend``, served on ``127.0.0.1:<free port>``
    on a background thread.

    The gateway's spans go through a tracer provider of its own: always to memory (:meth:`spans`), and,
    with ``export_to`` (a store URL, such as a :class:`~agl_core.testing.Collector`'s ``url``), also to
    that store over real OTLP/HTTP, each span exported before the response that ended it is sent.
    ``renderer``, ``metrics``, ``admin_token`` and ``capture`` are passed to the app. The backend is not
    closed on :meth:`stop`, a ``capture`` is. Use it as a context manager, or call :meth:`start` and
    :meth:`stop`.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        export_to: str | None = None,
        token: str | None = None,
        renderer: TemplateRenderer | None = None,
        metrics: GatewayMetrics | None = None,
        admin_token: str | None = None,
        capture: Capture | None = None,
        client_token: str | None = None,
    ) -> None:
        from ..gateway.app import create_gateway_app

        self.backend = backend
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        if export_to is not None:
            self.tracer_provider.add_span_processor(
                SimpleSpanProcessor(make_otlp_exporter(export_to, token=token))
            )
        self.app: Starlette = create_gateway_app(
            backend,
            tracer_provider=self.tracer_provider,
            renderer=renderer,
            metrics=metrics,
            admin_token=admin_token,
            capture=capture,
            client_token=client_token,
        )
        self.capture = capture
        self._server = BackgroundServer(self.app)
        #: The gateway's base URL (``http://127.0.0.1:<port>``).
        self.url = self._server.url

    @property
    def v1(self) -> str:
        """The OpenAI ``base_url`` of calls attributed to no rollout: ``url + "/v1"``."""
        return self.url + "/v1"

    def base_url(self, rollout_id: str, attempt_id: str | None = None) -> str:
        """The OpenAI ``base_url`` attributing every call made through it to ``rollout_id``."""
        return rollout_base_url(self.url, rollout_id, attempt_id)

    @property
    def metrics(self) -> GatewayMetrics:
        metrics: GatewayMetrics = self.app.state.metrics
        return metrics

    def spans(self, response_id: str | None = None) -> list[ReadableSpan]:
        """The gateway's finished LLM call spans (one per choice), only those of the response
        ``response_id`` (the ``id`` the client got) when given; ordered by choice index, then end."""
        found: Sequence[ReadableSpan] = [
            s
            for s in self.exporter.get_finished_spans()
            if s.attributes is not None
            and s.attributes.get(semconv.SOURCE) == semconv.SOURCE_GATEWAY
            and (response_id is None or s.attributes.get(semconv.GEN_AI_RESPONSE_ID) == response_id)
        ]
        return sorted(found, key=_choice_index)

    def start(self) -> GatewayServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()
        if self.capture is not None:
            self.capture.close()
        self.tracer_provider.shutdown()

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _choice_index(span: ReadableSpan) -> int:
    value = span.attributes.get(semconv.CHOICE_INDEX, 0) if span.attributes else 0
    return value if isinstance(value, int) else 0
