"""Collector, gateway and agent-side tracer provider, started and stopped together."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider

from ..gateway import GatewayMetrics, TemplateRenderer
from ..gateway.backend import Backend
from ..records import Span
from ..store import Store, StoreClient
from ._collector import Collector
from ._gateway import GatewayServer
from ._scripted import ChatTokenizer, Script, ScriptedBackend, echo

__all__ = ["AglTestStack"]


class AglTestStack:
    """A :class:`Collector`, a :class:`GatewayServer` exporting its spans to it, and an agent-side tracer
    provider (:attr:`provider`) exporting there too, all real and local.

    The gateway serves ``backend``, else a :class:`ScriptedBackend` built from ``script``, ``tokenizer``
    and ``model_name`` (default: :func:`echo`). ``store`` / ``path`` choose the collector's store (see
    :class:`Collector`). ``batch=True`` gives the agent-side provider a batching span processor
    (:meth:`spans` flushes it). ``renderer``, ``metrics`` and ``admin_token`` go to the gateway app.

    Point the code under test at :meth:`base_url` (an OpenAI ``base_url`` that attributes its calls to a
    rollout), instrument it with :attr:`provider`, then read everything back with :meth:`spans`.
    """

    def __init__(
        self,
        backend: Backend | None = None,
        *,
        script: Script | Sequence[str] | None = None,
        tokenizer: ChatTokenizer | None = None,
        model_name: str = "scripted",
        store: Store | None = None,
        path: str | Path | None = None,
        batch: bool = False,
        renderer: TemplateRenderer | None = None,
        metrics: GatewayMetrics | None = None,
        admin_token: str | None = None,
    ) -> None:
        if backend is not None and (script is not None or tokenizer is not None):
            raise ValueError("AglTestStack: give a backend, or a script (and tokenizer) for a scripted one")
        if backend is None:
            backend = ScriptedBackend(
                script if script is not None else echo, tokenizer=tokenizer, model_name=model_name
            )
        self.backend: Backend = backend
        self.collector = Collector(store, path=path)
        self.gateway = GatewayServer(
            backend,
            export_to=self.collector.url,
            renderer=renderer,
            metrics=metrics,
            admin_token=admin_token,
        )
        self._batch = batch
        self._provider: TracerProvider | None = None

    @property
    def provider(self) -> TracerProvider:
        """The agent-side tracer provider: a :class:`~agl_core.tracing.RolloutSpanProcessor`, then real
        OTLP/HTTP export to the collector. Shut down on :meth:`stop`."""
        if self._provider is None:
            raise RuntimeError("AglTestStack is not started: use it as a context manager or call start()")
        return self._provider

    @property
    def client(self) -> StoreClient:
        """A store client of the collector."""
        return self.collector.client

    @property
    def gateway_url(self) -> str:
        return self.gateway.url

    def base_url(self, rollout_id: str, attempt_id: str | None = None) -> str:
        """The OpenAI ``base_url`` attributing every call made through it to ``rollout_id``."""
        return self.gateway.base_url(rollout_id, attempt_id)

    def spans(self, rollout_id: str | None = None, *, trace_id: str | None = None) -> list[Span]:
        """Flush :attr:`provider`, then the collected spans of ``rollout_id`` / ``trace_id`` (all without
        either), in arrival order."""
        self.provider.force_flush()
        return self.collector.spans(rollout_id, trace_id=trace_id)

    def wait_for_spans(
        self, count: int, rollout_id: str | None = None, *, timeout_s: float = 10.0
    ) -> list[Span]:
        """Flush :attr:`provider`, then :meth:`Collector.wait_for_spans`."""
        self.provider.force_flush()
        return self.collector.wait_for_spans(count, rollout_id, timeout_s=timeout_s)

    def decode(self, ids: Sequence[int]) -> str:
        """``ids`` as text, special tokens left out, with the backend's ``tokenizer``."""
        tokenizer: ChatTokenizer | None = getattr(self.backend, "tokenizer", None)
        if tokenizer is None:
            raise TypeError(f"{type(self.backend).__name__} has no tokenizer to decode with")
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    def start(self) -> AglTestStack:
        self.collector.start()
        try:
            self.gateway.start()
        except BaseException:
            self.collector.stop()
            raise
        self._provider = self.collector.tracer_provider(batch=self._batch)
        return self

    def stop(self) -> None:
        """Stop the gateway, then the collector (which flushes and shuts down :attr:`provider` first)."""
        self.gateway.stop()
        self.collector.stop()
        self._provider = None

    def __enter__(self) -> AglTestStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
