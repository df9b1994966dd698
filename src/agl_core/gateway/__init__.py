"""OpenAI-compatible LLM gateway recording exact token ids on spans."""

from .app import create_gateway_app, rollout_base_url
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
    "UpstreamError",
    "create_gateway_app",
    "load_renderer",
    "rollout_base_url",
]
