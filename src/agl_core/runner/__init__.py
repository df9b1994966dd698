"""The runner: pulls queued rollouts from the store and runs the user's agent on them.

An agent is a function ``agent(task, llm) -> float | None`` (or ``async def``): ``task`` is the task's
input (what the dataset holds), ``llm`` tells it which OpenAI-compatible endpoint and model to use.
Returning a number records it as the episode reward; an agent may instead call
:func:`agl_core.emit_reward` itself. An exception fails the attempt (with its traceback) and never stops
the runner.

Workers run in one of three modes:

``thread``
    N threads in this process. A rollout that runs past its timeout is recorded as timed out on time, but
    its thread cannot be stopped: it runs on detached and its late result is dropped.
``process``
    N worker processes (spawned). A rollout past its timeout is stopped for real: its worker process is
    killed and replaced. A crashing worker (segfault, ``os._exit``) fails the attempt.
``async``
    N concurrent tasks on one event loop, for ``async def`` agents; a timeout cancels the task.

``auto`` picks ``async`` for ``async def`` agents and ``thread`` otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._types import LLM, LLM_RESOURCE, MODES, RolloutTimeout, RunnerCounts

if TYPE_CHECKING:
    from ._runner import Runner, is_async_agent, load_agent, resolve_mode, run_command

__all__ = [
    "LLM",
    "LLM_RESOURCE",
    "MODES",
    "RolloutTimeout",
    "Runner",
    "RunnerCounts",
    "is_async_agent",
    "load_agent",
    "resolve_mode",
    "run_command",
]

# The names from ``_runner`` load on first use: they bring in the store, the engines and multiprocessing,
# while ``import agl_core`` (for ``LLM``) and every process-mode worker process (which imports this package
# on its way to ``_worker``) need only the value types.
_FROM_RUNNER = frozenset({"Runner", "is_async_agent", "load_agent", "resolve_mode", "run_command"})


def __getattr__(name: str) -> Any:
    if name in _FROM_RUNNER:
        from . import _runner

        value = getattr(_runner, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
