"""agl core: records, span vocabulary, tracing, the collector-store, the gateway and the runner.

``import agl_core`` stays light: it never imports torch or an agent framework.
"""

from .records import Attempt, Resource, Rollout, RolloutStatus, Span, Task, Transition
from .runner import LLM, RolloutTimeout
from .tracing import (
    RolloutContext,
    current_rollout,
    emit_error,
    emit_reward,
    rollout_scope,
    setup_tracing,
)

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "Attempt",
    "Resource",
    "Rollout",
    "RolloutContext",
    "RolloutStatus",
    "RolloutTimeout",
    "Span",
    "Task",
    "Transition",
    "current_rollout",
    "emit_error",
    "emit_reward",
    "rollout_scope",
    "setup_tracing",
]
