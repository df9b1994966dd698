"""agl core: records, span vocabulary, tracing, the collector-store, the gateway and the runner.

``import agl_core`` stays light: it never imports torch or an agent framework.
"""

from .capture.user_spans import Tool, ToolCall, agent_span, current_tool_call, tool, tool_call
from .records import Attempt, Resource, Rollout, RolloutStatus, Span, Task, Transition
from .rollout_ids import session_rollout_id, trace_rollout_id
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
    "Tool",
    "ToolCall",
    "Transition",
    "agent_span",
    "current_rollout",
    "current_tool_call",
    "emit_error",
    "emit_reward",
    "rollout_scope",
    "session_rollout_id",
    "setup_tracing",
    "tool",
    "tool_call",
    "trace_rollout_id",
]
