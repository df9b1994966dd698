"""The runner: pulls queued rollouts from the store and runs the user's agent on them (the modes are
described in the :mod:`agl_core.runner` docstring)."""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import pickle
import shlex
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._async import AsyncEngine
from ._engine import Engine
from ._outcome import logger
from ._procs import ProcessEngine
from ._state import RunnerStore, RunState
from ._threads import ThreadEngine
from ._types import MODES, AgentFn, RunnerCounts

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = ["Runner", "is_async_agent", "load_agent", "resolve_mode", "run_command"]


def is_async_agent(agent: Callable[..., Any]) -> bool:
    """True for ``async def`` functions (and objects whose ``__call__`` is one)."""
    call = getattr(agent, "__call__", None)  # noqa: B004 - the method itself, to ask if it is a coroutine
    return inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(call)


def _agent_name(agent: Callable[..., Any]) -> str:
    return f"{getattr(agent, '__module__', '?')}:{getattr(agent, '__qualname__', type(agent).__name__)}"


def resolve_mode(agent: Callable[..., Any], mode: str = "auto") -> str:
    """The mode ``agent`` runs in: ``mode`` itself, or for ``auto`` ``async`` when the agent is an
    ``async def`` function and ``thread`` otherwise. Raises ``ValueError`` for a mode that cannot run it."""
    if mode not in MODES:
        raise ValueError(f"unknown runner mode {mode!r}; choose one of {', '.join(MODES)}")
    is_async = is_async_agent(agent)
    if mode == "auto":
        return "async" if is_async else "thread"
    if mode == "async" and not is_async:
        raise ValueError(
            f"mode 'async' runs 'async def' agents, but {_agent_name(agent)} is a plain function; "
            "use mode 'thread' or 'process' (or 'auto', which picks thread for it)"
        )
    if mode == "thread" and is_async:
        raise ValueError(
            f"{_agent_name(agent)} is an 'async def' agent; run it in mode 'async' (or 'auto'), or in mode "
            "'process', where each worker process runs it in an event loop of its own"
        )
    if mode == "process":
        problem = _spawn_problem(agent)
        if problem is not None:
            other = "async" if is_async else "thread"
            raise ValueError(
                f"mode 'process' imports the agent by name in each worker process, but {_agent_name(agent)} "
                f"cannot be found that way ({problem}); define it at the top level of an importable module,"
                f" or run it in mode '{other}' (in this process)"
            )
    return mode


def _spawn_problem(agent: Callable[..., Any]) -> str | None:
    """Why a spawned worker process could not rebuild ``agent``, or ``None`` when it can.

    The agent travels pickled: every function and class it refers to is looked up by module and
    qualified name in the new process. That fails for what pickle refuses (a function defined inside
    another, a lambda), for a module a new process cannot import, and for ``__main__`` when it is no file
    (a notebook, ``python -c``, stdin) or binds the name only under ``if __name__ == "__main__":``.
    """
    found: list[Any] = []

    class _Lookups(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, (types.FunctionType, type)):
                found.append(obj)
            return NotImplemented

    try:
        _Lookups(io.BytesIO()).dump(agent)
    except Exception as exc:
        return str(exc)
    for obj in found:
        module_name = getattr(obj, "__module__", None)
        name = str(getattr(obj, "__qualname__", "")).split(".")[0]
        if module_name == "__main__":
            problem = _main_problem(name)
            if problem is not None:
                return problem
        elif module_name and getattr(sys.modules.get(module_name), "__spec__", None) is None:
            return f"its module {module_name!r} was not imported from a file"
    return None


def _main_problem(name: str) -> str | None:
    """Why ``name`` in ``__main__`` is missing in a spawned process, which runs the main module's file
    again without its ``if __name__ == "__main__":`` blocks (as :mod:`multiprocessing` does)."""
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    path = getattr(main, "__file__", None)
    if spec_name is not None and spec_name.endswith("__main__"):
        return (
            f"{name!r} is defined in the package entry point {spec_name}, which worker processes do not run"
        )
    if not path or not Path(path).is_file():
        return f"{name!r} is defined in an interactive session (a notebook, python -c or stdin)"
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None  # cannot tell: let the worker process try
    if name not in _bound_when_imported(tree.body):
        return f"{name!r} is bound only under 'if __name__ == \"__main__\":' in {path}"
    return None


def _bound_when_imported(body: list[ast.stmt]) -> set[str]:
    """Names a module body binds when imported (skipping its ``if __name__ == "__main__":`` blocks)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If) and _is_main_guard(node.test):
            names |= _bound_when_imported(node.orelse)
        else:
            for block in ("body", "orelse", "finalbody"):
                names |= _bound_when_imported(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                names |= _bound_when_imported(handler.body)
    return names


def _is_main_guard(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and any(
        isinstance(x, ast.Constant) and x.value == "__main__" for x in sides
    )


def load_agent(spec: str, *, search_paths: Sequence[Path] = ()) -> AgentFn:
    """Import ``module:function``. ``search_paths`` are tried before ``sys.path``.

    Raises ``ValueError`` naming the module when it cannot be imported or lacks the function.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"agent must be given as 'module:function', got {spec!r}")
    for path in reversed(list(search_paths)):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import agent module {module_name!r}: {exc}") from exc
    except Exception as exc:
        raise ValueError(
            f"importing agent module {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ValueError(f"module {module_name!r} has no callable {attr!r}")
    agent: AgentFn = fn
    return agent


def run_command(
    agent: str,
    store_url: str,
    *,
    workers: int = 1,
    mode: str = "auto",
    rollout_timeout_s: float | None = None,
    paths: Sequence[Path | str] = (),
) -> str:
    """The ``agl run`` command line that starts runners for ``agent`` against the store at ``store_url``
    (quoted for a POSIX shell). A store token is not included: pass it with ``AGL_STORE_TOKEN``."""
    parts = ["agl", "run", agent, "--store", store_url, "--workers", str(workers)]
    if mode != "auto":
        parts += ["--mode", mode]
    if rollout_timeout_s is not None:
        parts += ["--rollout-timeout", f"{rollout_timeout_s:g}"]
    for path in paths:
        parts += ["--path", str(path)]
    return shlex.join(parts)


class Runner:
    """Runs ``agent`` on queued rollouts in ``workers`` workers until :meth:`stop`.

    ``mode``: see :mod:`agl_core.runner`. ``rollout_timeout_s``: how long one rollout may run before its
    attempt ends as ``timed_out`` (``None``: no limit). ``lease_s``: the attempt lease kept alive by
    heartbeats; a runner that stops sending them loses its attempts to the store. ``max_abandoned_threads``
    (thread mode): how many timed-out agent threads may still be running before workers wait for one to
    end (default: ``workers``, at least 8).

    Agent spans go through ``tracer_provider``; it is flushed before each attempt is completed, so by the
    time the store reports a rollout finished, its spans are stored. In process mode each worker process
    sends its spans over OTLP to ``otlp_endpoint`` (default: the URL of ``store`` when it is a
    :class:`~agl_core.store.StoreClient`), with bearer ``token`` (default: ``AGL_STORE_TOKEN``).

    When the store cannot be reached, workers back off and retry; nothing the agent does stops the runner.

    Process mode spawns its worker processes: the agent must be importable by name (a module-level
    function), and a script that starts such a runner must guard its entry point with
    ``if __name__ == "__main__":``, since each worker process imports the main module again.
    """

    def __init__(
        self,
        agent: AgentFn,
        store: RunnerStore,
        tracer_provider: TracerProvider,
        *,
        workers: int = 1,
        mode: str = "auto",
        rollout_timeout_s: float | None = None,
        poll_s: float = 0.05,
        lease_s: float = 60.0,
        max_abandoned_threads: int | None = None,
        otlp_endpoint: str | None = None,
        token: str | None = None,
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        if rollout_timeout_s is not None and not rollout_timeout_s > 0:
            raise ValueError(
                f"rollout_timeout_s must be > 0 seconds or None (no limit), got {rollout_timeout_s}"
            )
        if max_abandoned_threads is not None and max_abandoned_threads < 0:
            raise ValueError(f"max_abandoned_threads must be >= 0, got {max_abandoned_threads}")
        self.mode = resolve_mode(agent, mode)
        self.agent = agent
        self.store = store
        self.tracer_provider = tracer_provider
        self.workers = workers
        self.rollout_timeout_s = rollout_timeout_s
        self.lease_s = lease_s
        if self.mode == "process":
            otlp_endpoint = otlp_endpoint or getattr(store, "url", None)
            if not otlp_endpoint:
                raise ValueError(
                    "mode 'process' needs the store's URL for the worker processes' spans: pass a "
                    "StoreClient as the store, or otlp_endpoint"
                )
        self._state = RunState(
            agent,
            store,
            tracer_provider,
            workers=workers,
            rollout_timeout_s=rollout_timeout_s,
            poll_s=poll_s,
            lease_s=lease_s,
        )
        self._engine: Engine | None = None
        self._max_abandoned = max(workers, 8) if max_abandoned_threads is None else max_abandoned_threads
        self._otlp_endpoint = otlp_endpoint
        self._token = token
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def counts(self) -> RunnerCounts:
        return self._state.counts()

    def start(self) -> Runner:
        with self._lock:
            if self._engine is not None:
                raise RuntimeError("this runner was already started")
            self._state.heartbeats.start()
            engine: Engine
            if self.mode == "thread":
                engine = ThreadEngine(self._state, max_abandoned=self._max_abandoned)
            elif self.mode == "process":
                assert self._otlp_endpoint is not None  # checked in __init__
                engine = ProcessEngine(self._state, otlp_endpoint=self._otlp_endpoint, token=self._token)
            else:
                engine = AsyncEngine(self._state)
            self._engine = engine
            engine.start()
        return self

    def request_stop(self) -> None:
        """Stop taking new rollouts; rollouts already running go on (see :meth:`stop`)."""
        self._state.stopping.set()

    def stop(self, timeout_s: float = 30.0, *, reason: str | None = None) -> None:
        """Stop taking new rollouts, let the running ones finish for up to ``timeout_s`` seconds, then end
        those still running as failed (process mode kills their workers, async mode cancels them, thread
        mode leaves their threads detached) and release everything. Safe to call more than once.

        ``reason`` says the stop is on purpose and why (``"the training run is over"``): rollouts still
        running are then cancelled rather than failed, and that is logged as information, not a warning."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            engine = self._engine
        self._state.stop_reason = reason
        self._state.stopping.set()
        if engine is not None:
            if not engine.join(time.monotonic() + max(timeout_s, 0.0)):
                running = self._state.counts().running
                if running and reason is not None:
                    logger.info("agl runner: cancelling %d rollout(s) still running: %s", running, reason)
                elif running:
                    logger.warning(
                        "agl runner: %d rollout(s) still running after the %g s grace period; ending them"
                        " as failed",
                        running,
                        timeout_s,
                    )
                self._state.halt.set()
                if not engine.join(time.monotonic() + 15.0):
                    logger.warning("agl runner: some workers did not stop in time; leaving them behind")
            engine.close()
        self._state.heartbeats.close()
        self._state.flush()

    def kill(self) -> None:
        """Stop at once: worker processes are killed; nothing more is reported to the store (attempts
        still running are timed out by the store when their lease runs out)."""
        self._state.stopping.set()
        self._state.halt.set()
        if self._engine is not None:
            self._engine.kill()
