"""``agl run --ray ADDRESS``: the runner's workers as actors on a Ray cluster (the engine verl uses).

Each of ``--actors`` actors is a :class:`~agl_core.runner.Runner` in a Ray worker process with its share of
``--workers``, taking rollouts from the store like any ``agl run``: the store stays the only coordinator.
An actor that dies (its node lost, the process killed) is restarted by Ray; the store reclaims the attempts
it held when their lease runs out, and they run again while the rollout's ``max_attempts`` allows.

Ray is imported only here (``pip install 'agl[ray]'``); the actors import the agent from ``--path``
directories, which must hold the same code on every node (a shared file system, or Ray's
``runtime_env``).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._types import RunnerCounts

__all__ = ["RayFleet", "split_workers"]


def split_workers(workers: int, actors: int) -> list[int]:
    """``workers`` spread over ``actors`` as evenly as can be (the first ones take the remainder)."""
    if actors < 1 or workers < actors:
        raise ValueError(f"--actors must be between 1 and --workers ({workers}), got {actors}")
    base, extra = divmod(workers, actors)
    return [base + (1 if i < extra else 0) for i in range(actors)]


class _RunnerActor:
    """A runner inside a Ray actor (the class Ray wraps with ``ray.remote``)."""

    def __init__(
        self,
        agent: str,
        store_url: str,
        token: str | None,
        workers: int,
        mode: str,
        rollout_timeout_s: float | None,
        lease_s: float,
        paths: Sequence[str],
    ) -> None:
        from ..store import StoreClient
        from ..tracing import setup_tracing
        from ._runner import Runner, load_agent, resolve_mode

        for path in reversed(paths):
            if path not in sys.path:
                sys.path.insert(0, path)
        fn = load_agent(agent, search_paths=[Path(p) for p in paths])
        client = StoreClient(store_url, token=token, timeout_s=30.0)
        provider = setup_tracing(store_url, token=token, service_name="agl-agent")
        self.runner = Runner(
            fn,
            client,
            provider,
            workers=workers,
            mode=resolve_mode(fn, mode),
            rollout_timeout_s=rollout_timeout_s,
            lease_s=lease_s,
            otlp_endpoint=store_url,
            token=token,
        ).start()

    def counts(self) -> dict[str, int]:
        return dataclasses.asdict(self.runner.counts)

    def stop(self, grace_s: float) -> dict[str, int]:
        self.runner.stop(timeout_s=grace_s)
        return dataclasses.asdict(self.runner.counts)


class RayFleet:
    """Runner actors on the Ray cluster at ``address`` (``local``: a cluster started here for this fleet;
    ``auto``: the one ``ray start`` made on this machine). ``actor_cpus``: the CPUs Ray reserves per actor
    (0: place as many as asked on any node)."""

    def __init__(
        self,
        address: str,
        *,
        agent: str,
        store_url: str,
        token: str | None,
        workers: int,
        actors: int,
        mode: str,
        rollout_timeout_s: float | None,
        lease_s: float,
        paths: Sequence[str],
        actor_cpus: float = 0.0,
    ) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("--ray needs Ray here and on the cluster: pip install 'agl[ray]'") from None
        self._ray: Any = ray
        shares = split_workers(workers, actors)
        options: dict[str, Any] = {"ignore_reinit_error": True, "log_to_driver": True}
        if address == "local":  # a cluster of this machine only, for this fleet
            options.update(include_dashboard=False, num_cpus=max(1, int(actor_cpus * actors) + 1))
        else:
            options["address"] = address
        ray.init(**options)
        remote: Any = ray.remote(_RunnerActor).options(  # a dead actor is started again, without limit
            num_cpus=actor_cpus, max_restarts=-1, max_task_retries=0
        )
        self.actors: list[Any] = [
            remote.remote(agent, store_url, token, share, mode, rollout_timeout_s, lease_s, list(paths))
            for share in shares
        ]
        self.shares = shares
        self._lock = threading.Lock()

    def counts(self, timeout_s: float = 10.0) -> RunnerCounts:
        """The actors' counts added up (an actor being restarted counts nothing)."""
        total = RunnerCounts()
        for actor in self.actors:
            try:
                got = self._ray.get(actor.counts.remote(), timeout=timeout_s)
            except Exception:  # dead, restarting, or slow to answer: left out of this report
                continue
            total = _plus(total, got)
        return total

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until every actor has started its runner (raises the first actor's error)."""
        self._ray.get([actor.counts.remote() for actor in self.actors], timeout=timeout_s)

    def stop(self, grace_s: float) -> RunnerCounts:
        """Stop every actor's runner (running rollouts get ``grace_s`` to finish), then the actors."""
        total = RunnerCounts()
        pending = [actor.stop.remote(grace_s) for actor in self.actors]
        deadline = time.monotonic() + grace_s + 30.0
        for ref in pending:
            try:
                got: dict[str, Any] = self._ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except Exception:
                continue
            total = _plus(total, got)
        for actor in self.actors:
            self._ray.kill(actor, no_restart=True)
        self._ray.shutdown()
        return total


def _plus(total: RunnerCounts, got: dict[str, Any]) -> RunnerCounts:
    """``total`` with an actor's counts (a :class:`RunnerCounts` as a dict) added."""
    return RunnerCounts(**{k: getattr(total, k) + int(v) for k, v in got.items()})
