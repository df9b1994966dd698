"""``agl dashboard``: serve the dashboard over a store and run directories until SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .. import settings
from ._runs import find_runs, read_info

__all__ = ["add_dashboard_arguments", "run_dashboard"]


def add_dashboard_arguments(parser: argparse.ArgumentParser, port_type: Any) -> None:
    parser.add_argument(
        "--store",
        default=None,
        help="store URL (http://...), SQLite file or postgresql://... DSN (default: the store of the first"
        f" run in --runs, else $AGL_STORE_URL or {settings.DEFAULT_STORE_URL})",
    )
    parser.add_argument(
        "--runs",
        action="append",
        default=[],
        metavar="DIR",
        help="a training run's output_dir, or a folder of them (repeatable)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument(
        "--port", type=port_type, default=8765, help="port (default: %(default)s; 0 picks one)"
    )
    parser.add_argument(
        "--token",
        default=None,
        help="require this token of every visitor (default: $AGL_DASHBOARD_TOKEN, else the store's token;"
        " required when --host is not a loopback address)",
    )
    parser.add_argument(
        "--store-token", default=None, help="the store's bearer token (default: $AGL_STORE_TOKEN)"
    )


def _run_store(runs: dict[str, Path]) -> str | None:
    """The store the first run trained with: its ``store.url``, or its embedded SQLite file."""
    for path in runs.values():
        config = read_info(path).get("config")
        store = config.get("store") if isinstance(config, dict) else None
        if isinstance(store, dict) and isinstance(store.get("url"), str):
            return str(store["url"])
        name = store.get("path") if isinstance(store, dict) else None
        file = path / (name if isinstance(name, str) else "store.sqlite")
        if file.is_file():
            return str(file)
    return None


def _open(target: str, token: str | None) -> Any:
    from ..store import connect

    return connect(target, token, must_exist=True)


def run_dashboard(args: argparse.Namespace) -> int:
    from ..server import serve_forever
    from ..store import StoreError
    from ._app import DashboardError, check_listen, create_dashboard_app, dashboard_url

    def fail(message: str) -> int:
        print(f"agl dashboard: {message}", file=sys.stderr)
        return 2

    run_dirs = [Path(d) for d in args.runs]
    missing = [str(d) for d in run_dirs if not d.is_dir()]
    if missing:
        return fail(
            f"--runs {missing[0]} is not a directory; pass a training run's output_dir or a folder of runs"
        )
    runs = find_runs(run_dirs)
    if run_dirs and not runs:
        print(
            f"agl dashboard: no run under {', '.join(map(str, run_dirs))} yet (it will show when one starts)"
        )
    store_token = settings.store_token(args.store_token)
    token = settings.dashboard_token(args.token, args.store_token)
    try:
        check_listen(args.host, token)
    except DashboardError as exc:
        return fail(str(exc))
    target = args.store or _run_store(runs) or settings.store_url()
    try:
        store = _open(target, store_token)
    except (StoreError, OSError, ImportError) as exc:
        return fail(settings.masked_url(f"cannot open the store {target}: {exc}"))
    try:
        app = create_dashboard_app(store, run_dirs, token=token)
        print(f"agl dashboard: store {settings.masked_url(target)}; {len(runs)} run(s)", flush=True)
        host = f"[{args.host}]" if ":" in args.host else args.host

        def bound(port: int) -> None:
            print(f"agl dashboard: open {dashboard_url(f'http://{host}:{port}', token)}", flush=True)

        try:
            serve_forever(app, args.host, args.port, log_level="warning", on_bound=bound)
        except OSError as exc:
            return fail(f"cannot listen: {exc} (choose another --port)")
    finally:
        store.close()
    return 0
