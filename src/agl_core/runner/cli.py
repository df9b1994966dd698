"""``agl run``: runners on any machine, serving the rollouts a trainer queues in a running store."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import settings
from ..tracing import setup_tracing
from ._types import LLM_RESOURCE, MODES

__all__ = ["add_run_arguments", "run_agents"]

if TYPE_CHECKING:
    from ._runner import Runner


def _seconds(*, allow_zero: bool = False) -> Any:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
        if value != value or value == float("inf") or value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise argparse.ArgumentTypeError(f"must be {bound} seconds, got {text!r}")
        return value

    return parse


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if not 1 <= value <= 1024:
        raise argparse.ArgumentTypeError(f"must be between 1 and 1024, got {value}")
    return value


def _store_url(text: str) -> str:
    parts = urllib.parse.urlsplit(text)
    try:
        port_ok = parts.port is None or 0 < parts.port
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise argparse.ArgumentTypeError(
            "must be the store's http(s) URL, like http://127.0.0.1:4318 (what 'agl store serve' prints), "
            f"got {text!r}"
        )
    return text.rstrip("/")


def _directory(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return path.resolve()


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "agent",
        metavar="MODULE:FUNCTION",
        help="the agent function, e.g. my_agent:run (looked up in --path dirs, the current dir, sys.path)",
    )
    parser.add_argument(
        "--store",
        type=_store_url,
        default=None,
        help=f"store URL (default: $AGL_STORE_URL or {settings.DEFAULT_STORE_URL})",
    )
    parser.add_argument(
        "--workers", type=_workers, default=1, help="rollouts run at once (default: %(default)s)"
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="auto",
        help="thread, process (a hung agent is killed at its timeout), async (for 'async def' "
        "agents); auto picks async or thread (default: %(default)s)",
    )
    parser.add_argument(
        "--rollout-timeout",
        type=_seconds(),
        default=None,
        metavar="S",
        help="seconds one rollout may run before its attempt ends as timed out (default: no limit)",
    )
    parser.add_argument("--token", default=None, help="the store's bearer token (default: $AGL_STORE_TOKEN)")
    parser.add_argument(
        "--lease",
        type=_seconds(),
        default=60.0,
        metavar="S",
        help="attempt lease in seconds, renewed by heartbeats every third of it (default: %(default)s)",
    )
    parser.add_argument(
        "--path",
        type=_directory,
        action="append",
        default=[],
        metavar="DIR",
        help="directory to import the agent's module from (repeatable)",
    )
    parser.add_argument(
        "--grace",
        type=_seconds(allow_zero=True),
        default=30.0,
        metavar="S",
        help="on SIGINT/SIGTERM, seconds running rollouts may take to finish (default: %(default)s)",
    )
    parser.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run the workers as actors on the Ray cluster at ADDRESS ('auto': the one 'ray start' made"
        " here; 'local': start one for this run); needs pip install 'agl[ray]'",
    )
    parser.add_argument(
        "--actors",
        type=_workers,
        default=None,
        help="with --ray, how many runner actors share --workers (default: one per worker)",
    )
    parser.add_argument(
        "--actor-cpus",
        type=_seconds(allow_zero=True),
        default=0.0,
        metavar="N",
        help="with --ray, CPUs Ray reserves for each actor (default: %(default)s, place them anywhere)",
    )
    parser.add_argument(
        "--report-every",
        type=_seconds(allow_zero=True),
        default=60.0,
        metavar="S",
        help="print counts this often when they changed; 0: only at exit (default: %(default)s)",
    )


def _run_on_ray(
    args: argparse.Namespace, url: str, token: str | None, mode: str, search: list[Path], *, waiting: bool
) -> int:
    """``agl run --ray``: the workers as runner actors on a Ray cluster, until SIGINT/SIGTERM."""
    from ._ray import RayFleet

    actors = args.actors or args.workers
    if actors > args.workers:
        return _fail(f"--actors ({actors}) may not exceed --workers ({args.workers})", 2)
    stop = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            fleet = RayFleet(
                args.ray,
                agent=args.agent,
                store_url=url,
                token=token,
                workers=args.workers,
                actors=actors,
                mode=mode,
                rollout_timeout_s=args.rollout_timeout,
                lease_s=args.lease,
                paths=[str(p) for p in search],
                actor_cpus=args.actor_cpus,
            )
            fleet.wait_ready()
            # after ray.init, which puts in handlers of its own that end the process at once
            for sig in previous:
                signal.signal(sig, lambda signum, frame: stop.set())
        except ValueError as exc:
            return _fail(str(exc), 2)
        except Exception as exc:  # Ray's own errors: no cluster there, an actor that cannot start
            return _fail(f"Ray at {args.ray!r}: {type(exc).__name__}: {exc}", 1)
        print(
            f"agl run: {args.agent} on {url}, {args.workers} worker(s) in {actors} Ray actor(s) at"
            f" {args.ray} ({', '.join(map(str, fleet.shares))} each)"
            + ("; waiting for a trainer" if waiting else "")
            + "; Ctrl-C or SIGTERM stops it",
            flush=True,
        )
        last = None
        next_report = time.monotonic() + args.report_every
        while not stop.wait(0.5):
            if args.report_every and time.monotonic() >= next_report:
                next_report = time.monotonic() + args.report_every
                counts = fleet.counts()
                if counts != last:
                    print(f"agl run: {counts.summary()}", flush=True)
                    last = counts
        print(f"agl run: stopping the actors; up to {args.grace:g} s for running rollouts", flush=True)
        print(f"agl run: stopped; {fleet.stop(args.grace).summary()}", flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _fail(message: str, code: int) -> int:
    print(f"agl run: {message}", file=sys.stderr, flush=True)
    return code


def _run_until_stopped(
    args: argparse.Namespace, runner: Runner, url: str, mode: str, *, waiting: bool
) -> None:
    """Run ``runner`` until SIGINT/SIGTERM, reporting its counts every ``--report-every`` seconds; the first
    signal stops it gracefully (``--grace``), a second exits the process at once."""
    stop = threading.Event()
    signals: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        signals.append(signum)
        if len(signals) == 1:
            stop.set()
            return
        print(f"agl run: second {signal.Signals(signum).name}; exiting now", file=sys.stderr, flush=True)
        runner.kill()
        os._exit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        runner.start()
        timeout = f"{args.rollout_timeout:g} s" if args.rollout_timeout is not None else "none"
        note = "; waiting for a trainer to publish the LLM endpoint" if waiting else ""
        print(
            f"agl run: {args.agent} on {url}, {args.workers} worker(s) in {mode} mode,"
            f" rollout timeout {timeout}, lease {args.lease:g} s{note}; Ctrl-C or SIGTERM stops it",
            flush=True,
        )
        last = runner.counts
        next_report = time.monotonic() + args.report_every
        while not stop.wait(0.2):
            if args.report_every and time.monotonic() >= next_report:
                next_report = time.monotonic() + args.report_every
                counts = runner.counts
                if counts != last:
                    print(f"agl run: {counts.summary()}", flush=True)
                    last = counts
        name = signal.Signals(signals[0]).name if signals else "stop"
        print(
            f"agl run: {name}: taking no more rollouts; waiting up to {args.grace:g} s for"
            f" {runner.counts.running} running; signal again to exit now",
            flush=True,
        )
        runner.stop(timeout_s=args.grace)
        print(f"agl run: stopped; {runner.counts.summary()}", flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_agents(args: argparse.Namespace) -> int:
    """Run ``args.agent`` against the store until SIGINT/SIGTERM. Returns the exit status: 0 after a
    graceful stop, 1 when the store cannot be used, 2 for a bad agent or flag. A second signal exits at
    once with 128 + the signal number."""
    # Loaded here, not when the parser of every ``agl`` command is built: the runner's machinery and the
    # store's HTTP client (httpx) are needed only once a run starts.
    from ..store import StoreClient, StoreError, StoreUnavailableError
    from ._runner import Runner, load_agent, resolve_mode

    if args.store is None:
        try:
            args.store = _store_url(settings.store_url())
        except argparse.ArgumentTypeError as exc:
            return _fail(f"AGL_STORE_URL {exc}", 2)
    url = args.store
    token = settings.store_token(args.token)
    search = [*args.path, Path.cwd()]
    try:
        agent = load_agent(args.agent, search_paths=search)
        mode = resolve_mode(agent, args.mode)
    except ValueError as exc:
        module = args.agent.partition(":")[0]
        hint = ""
        if "import" in str(exc):
            hint = (
                f"\n  agl run looks for {module!r} in {', '.join(str(p) for p in search)}, then on sys.path;"
                f" pass --path DIR with the directory that holds {module.replace('.', '/')}.py"
                " (or its package)"
            )
        return _fail(f"{exc}{hint}", 2)

    client = StoreClient(url, token=token, timeout_s=30.0)
    try:
        published = client.get_resource(LLM_RESOURCE)
    except StoreUnavailableError as exc:
        client.close()
        return _fail(
            f"{exc}\n  start a store with 'agl store serve', or point --store (or AGL_STORE_URL) at one", 1
        )
    except StoreError as exc:
        client.close()
        return _fail(
            f"the store at {url} refused the request: {exc}\n  pass the store's token with --token or "
            "AGL_STORE_TOKEN",
            1,
        )

    if args.ray is not None:
        client.close()
        return _run_on_ray(args, url, token, mode, search, waiting=published is None)
    if args.actors is not None:
        client.close()
        return _fail("--actors applies with --ray; remove it, or add --ray ADDRESS", 2)
    provider = setup_tracing(url, token=token, service_name="agl-agent")
    try:
        runner = Runner(
            agent,
            client,
            provider,
            workers=args.workers,
            mode=mode,
            rollout_timeout_s=args.rollout_timeout,
            lease_s=args.lease,
            otlp_endpoint=url,
            token=token,
        )
    except ValueError as exc:
        client.close()
        return _fail(str(exc), 2)

    try:
        _run_until_stopped(args, runner, url, mode, waiting=published is None)
    finally:
        client.close()
    return 0
