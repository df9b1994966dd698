"""The services a training or evaluation job runs on: the store (embedded SQLite, or ``store.url``), the
policy's serving backend, the gateway in front of it with its tracer provider, and the runner's workers.

:func:`start_store`, :func:`start_services` and :func:`start_runners` start them in that order and return
frozen records of what they started; every service is stopped by the :class:`~contextlib.ExitStack` it
was given, in reverse order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from agl_core.gateway import create_gateway_app
from agl_core.runner import LLM, LLM_RESOURCE, Runner, run_command
from agl_core.server import BackgroundServer
from agl_core.settings import gateway_token, masked_config
from agl_core.store import SqliteStore, StoreClient
from agl_core.store.service import StoreService
from agl_core.tracing import make_otlp_exporter, setup_tracing

from ..config import StoreConfig, TrainerConfig
from ..cpu import size_torch_threads
from .rollouts import wait_for_store
from .serving import HFServing, VLLMServing, start_serving

__all__ = [
    "AgentFn",
    "Services",
    "StoreConnection",
    "load_served_model",
    "remote_agent",
    "start_runners",
    "start_services",
    "start_store",
    "tracer_provider",
]

#: An agent as the runner calls it: ``agent(task_input, llm) -> reward | None`` (or ``async def``).
AgentFn = Callable[[Any, LLM], Any]


def tracer_provider(store_url: str, service: str) -> TracerProvider:
    """A tracer provider of its own exporting to the store at ``store_url`` (batched every 200 ms)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(make_otlp_exporter(store_url), schedule_delay_millis=200))
    return provider


@dataclasses.dataclass(frozen=True)
class StoreConnection:
    """The store a job uses, and a client of it."""

    #: Where runners and exporters reach the store.
    url: str
    #: The embedded store's SQLite file; ``None`` when ``store.url`` names a running store.
    file: Path | None
    client: StoreClient


@dataclasses.dataclass(frozen=True)
class Services:
    """A job's started services (see the module docstring)."""

    store: StoreConnection
    serving: HFServing | VLLMServing
    gateway: BackgroundServer
    #: The gateway's spans go through this provider: flush it before reading a round's spans.
    gateway_provider: TracerProvider
    #: The model name agents send in their requests.
    served_name: str
    #: The gateway's URL as runners are told it (``gateway.advertise_url``, else where it listens).
    runner_url: str = ""
    #: The token the gateway asks of model requests (``gateway.token``), handed to runners; ``None``: none.
    token: str | None = None

    @property
    def client(self) -> StoreClient:
        return self.store.client

    def publish(self, patience_s: float = 300.0) -> None:
        """Tell the runners (the store's ``llm`` resource) where the policy is served and its version;
        a store that is unreachable (restarting) is waited for up to ``patience_s`` seconds."""
        value = {
            "base_url": self.runner_url or self.gateway.url,
            "model": self.served_name,
            "policy_version": self.serving.policy_version,
            **({"api_key": self.token} if self.token is not None else {}),
        }
        wait_for_store(lambda: self.client.put_resource(LLM_RESOURCE, value), patience_s=patience_s)

    def flush(self) -> None:
        """Export the gateway's buffered spans to the store."""
        self.gateway_provider.force_flush()


def start_store(
    section: StoreConfig, stack: ExitStack, *, file: Path | None, echo: Callable[[str], None]
) -> StoreConnection:
    """Connect to the ``store`` section's ``url``, or start the embedded store on the SQLite ``file``
    (stopped by ``stack``)."""
    if section.url:
        url, file = section.url, None
    else:
        if file is None:
            raise ValueError("the embedded store needs a file (or set store.url)")
        store = SqliteStore(file)
        stack.callback(store.close)
        # as `agl store serve` runs it: the attempts of runners that stopped sending heartbeats (an
        # `agl run` killed mid-rollout) are reclaimed, so their rollouts run again
        service = StoreService(store, maintenance_interval_s=2.0)
        url = service.start_http_background()
        service.start_maintenance()
        stack.callback(service.close)
    echo(f"store: {masked_config(url)} ({'remote' if file is None else file})")
    client = StoreClient(url)
    stack.callback(client.close)
    return StoreConnection(url, file, client)


def start_run_dashboard(config: TrainerConfig, stack: ExitStack, store: StoreConnection) -> str:
    """Serve the dashboard over this run and its store until ``stack`` closes; returns the URL to open.
    The token is ``logging.dashboard_token``, else ``AGL_DASHBOARD_TOKEN``, else the store's."""
    from agl_core.dashboard import start_dashboard
    from agl_core.settings import dashboard_token, store_token

    log = config.logging
    token = dashboard_token(log.dashboard_token)
    client = StoreClient(store.url, token=store_token())
    stack.callback(client.close)
    return start_dashboard(
        stack, client, [config.output_dir], host=log.dashboard_host, port=log.dashboard_port, token=token
    )


def start_services(
    config: TrainerConfig,
    stack: ExitStack,
    store: StoreConnection,
    *,
    model: Any,
    tokenizer: Any,
    echo: Callable[[str], None],
) -> Services:
    """Start the serving backend for ``model`` (see :func:`~agl_trainer.run.serving.start_serving`) and the
    gateway in front of it, exporting its spans to ``store``; each is stopped by ``stack``. ``echo`` gets a
    line saying where the gateway listens."""
    serving = start_serving(config, model, tokenizer)
    stack.callback(serving.close)
    provider = tracer_provider(store.url, "agl-gateway")
    stack.callback(provider.shutdown)
    token = gateway_token(config.gateway.token)
    gateway = BackgroundServer(
        create_gateway_app(
            serving.backend, tracer_provider=provider, renderer=serving.renderer, client_token=token
        ),
        config.gateway.host,
        config.gateway.port,
    ).start()
    stack.callback(gateway.stop)
    runner_url = advertised_url(config.gateway.advertise_url, gateway.url)
    echo(
        f"gateway: {runner_url}/v1 serving {config.model.served_name!r} ({serving.kind} backend"
        + (", token required)" if token is not None else ")")
    )
    return Services(store, serving, gateway, provider, config.model.served_name, runner_url, token)


def advertised_url(advertise: str | None, bound: str) -> str:
    """The URL runners are told: ``advertise`` (its port, when it names none, the bound one's), else
    ``bound``, the URL of the listening socket."""
    if advertise is None:
        return bound
    from urllib.parse import urlsplit

    if urlsplit(advertise).port is None:
        return f"{advertise.rstrip('/')}:{urlsplit(bound).port}"
    return advertise.rstrip("/")


def load_served_model(config: TrainerConfig, *, echo: Callable[[str], None]) -> tuple[Any, Any]:
    """The base model to serve without training it (``None`` when vLLM serves it) and its tokenizer;
    ``echo`` gets a line saying where the model was put. Imports torch when serving with ``hf``."""
    from ..model import load_policy, load_tokenizer, torch_device

    if config.serving.backend != "hf":
        return None, load_tokenizer(config.model.source, chat_template=config.model.chat_template_text())
    import warnings

    size_torch_threads(config.train.threads)
    # peft asks transformers a deprecated question when it wraps a model; not actionable for a user.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    model, tokenizer = load_policy(
        config.model.source, seed=config.model.seed, chat_template=config.model.chat_template_text()
    )
    model = model.to(torch_device(config.update.device))
    model.eval()
    echo(f"model: {config.model.source} on {next(model.parameters()).device}")
    return model, tokenizer


def remote_agent(agent: str | None) -> str:
    """The ``module:function`` that runners started elsewhere import (``runner.workers: 0``).

    Raises ``ValueError`` when the config names none (the agent was given as a function object).
    """
    if agent is None:
        raise ValueError(
            "runner.workers: 0 leaves the rollouts to runners started elsewhere with 'agl run"
            " MODULE:FUNCTION', which import the agent by name, and this job was given the agent as a"
            " function; set runner.workers to 1 or more to run it here, or name it in the config"
            " ('agent: module:function')"
        )
    return agent


def start_runners(
    config: TrainerConfig,
    services: Services,
    agent: AgentFn,
    stack: ExitStack,
    *,
    echo: Callable[[str], None],
) -> Runner | None:
    """Publish the policy to the runners and start ``runner.workers`` of them on ``agent`` (stopped by
    ``stack``); with ``runner.workers: 0``, print the ``agl run`` command that starts them elsewhere and
    return ``None``."""
    # The agent's own spans (its framework callback, rewards) go through the global provider, which is
    # what an adapter uses by default.
    agent_provider = setup_tracing(services.store.url, service_name="agl-agent")
    stack.callback(agent_provider.force_flush)
    services.publish()
    if not config.runner.workers:
        command = run_command(
            remote_agent(config.agent),
            services.store.url,
            workers=1,
            mode=config.runner.mode,
            rollout_timeout_s=config.runner.rollout_timeout_s,
            paths=[config.base_dir],
        )
        echo(f"runner: none started (runner.workers: 0); start runners with:\n  {command}")
        return None
    runner = Runner(
        agent,
        services.client,
        agent_provider,
        workers=config.runner.workers,
        mode=config.runner.mode,
        rollout_timeout_s=config.runner.rollout_timeout_s,
        otlp_endpoint=services.store.url,
    ).start()
    # Rollouts still running when the run ends (async training draws ahead) are not needed any more.
    stack.callback(lambda: runner.stop(timeout_s=10.0, reason="the training run is over"))
    timeout = f", {config.runner.rollout_timeout_s:g}s per rollout" if config.runner.rollout_timeout_s else ""
    echo(f"runner: {runner.workers} worker(s) in {runner.mode} mode{timeout}")
    return runner
