"""OpenAI-compatible LLM gateway recording exact token ids on spans."""

from .app import create_gateway_app, rollout_base_url
from .backend import Backend, BackendError, ChatRequest, Completion, ContextTooLongError

__all__ = [
    "Backend",
    "BackendError",
    "ChatRequest",
    "Completion",
    "ContextTooLongError",
    "create_gateway_app",
    "rollout_base_url",
]
