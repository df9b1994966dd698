"""OpenAI-compatible LLM gateway recording exact token ids on spans."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..urls import rollout_base_url
from .assemble import TextAssembler
from .backend import (
    Backend,
    BackendError,
    BackendUnavailableError,
    ChatRequest,
    ChoiceDelta,
    Completion,
    ContextTooLongError,
    Event,
    PolicyUpdate,
    UpstreamError,
)
from .metrics import GatewayMetrics
from .render import TemplateRenderer, load_renderer

if TYPE_CHECKING:
    from .app import create_gateway_app

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailableError",
    "ChatRequest",
    "ChoiceDelta",
    "Completion",
    "ContextTooLongError",
    "Event",
    "GatewayMetrics",
    "PolicyUpdate",
    "TemplateRenderer",
    "TextAssembler",
    "UpstreamError",
    "create_gateway_app",
    "load_renderer",
    "rollout_base_url",
]


def __getattr__(name: str) -> Any:
    # The web app (Starlette) loads on first use of ``create_gateway_app``: the runner imports
    # ``agl_core.urls`` for rollout URLs and must not pull in a web framework with it.
    if name == "create_gateway_app":
        from .app import create_gateway_app

        globals()[name] = create_gateway_app
        return create_gateway_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
