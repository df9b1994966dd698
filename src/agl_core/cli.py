"""The ``agl`` command line.

``agl store serve``   run the collector-store (OTLP/HTTP + coordination API)
``agl store stats``   counts of what a store holds
``agl gateway serve`` run the OpenAI-compatible LLM gateway in front of a model backend
``agl run M:F``       runners: run the agent function on the rollouts queued in a store, until SIGTERM
``agl inspect ID``    a rollout's span tree, its transitions, and why any LLM call made none
``agl import PATH``   import OTLP trace files (the Collector's file exporter) into a store, as rollouts
``agl reward ID V``   attach a reward to a rollout (or one of its traces or spans) after the fact
``agl dashboard``     the web dashboard over a store and training runs

Other packages add commands through the ``agl.commands`` entry-point group (:mod:`agl_core.plugins`);
agl's trainer adds ``agl train CONFIG``, ``agl eval CONFIG`` and ``agl dev CONFIG`` that way (they need the
``trainer`` extra).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from . import plugins, settings
from ._store_reader import StoreReader, add_store_arguments
from .pipeline.rewards import DEFAULT_REWARD_RANGE, RewardRange


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 0-65535")
    return value


_BUILT_IN_COMMANDS = frozenset(
    {"store", "gateway", "run", "inspect", "reward", "import", "dashboard", "rollouts"}
)


def _checked_arguments(command: plugins.CliCommand) -> plugins.CliCommand:
    """``command``, or a stand-in saying why when its ``add_arguments`` fails (tried on a scratch parser)."""
    try:
        command.add_arguments(argparse.ArgumentParser(prog=f"agl {command.name}", add_help=False))
    except Exception as exc:  # a broken plugin must not break the other commands
        problem = f"{type(exc).__name__}: {exc}"
        reason = f"agl {command.name} is unavailable: its arguments cannot be defined ({problem})"
        note = f"(unavailable; 'agl {command.name}' says why)"
        return plugins.UnavailableCommand(command.name, note, command.extra, reason)
    return command


class _Parser(argparse.ArgumentParser):
    """argparse, with a suggestion for a mistyped command (``agl trian`` -> did you mean 'train'?)."""

    def error(self, message: str) -> NoReturn:
        import difflib
        import re

        found = re.match(r"argument \S+: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if found:
            choices = re.findall(r"'([^']*)'", found.group(2)) or [
                c.strip() for c in found.group(2).split(",")
            ]
            close = difflib.get_close_matches(found.group(1), choices, n=1)
            if close:
                message += f"; did you mean '{close[0]}'?"
        super().error(message)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agl")
    except PackageNotFoundError:
        return "unknown (not installed as a package)"


def _reward_range(text: str) -> RewardRange:
    try:
        return RewardRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: The options of ``agl store serve``: (flags, keyword arguments of ``add_argument``).
_STORE_SERVE_OPTIONS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (
        ("--db",),
        dict(
            default="agl-store.sqlite",
            help="SQLite file, or postgresql://user@host:port/db (default: %(default)s)",
        ),
    ),
    (("--host",), dict(default="127.0.0.1", help="address to listen on (default: %(default)s)")),
    (("--http-port",), dict(type=_port, default=4318, help="OTLP/HTTP and API port (default: %(default)s)")),
    (("--grpc-port",), dict(type=_port, default=4317, help="OTLP/gRPC port (default: %(default)s)")),
    (("--no-grpc",), dict(action="store_true", help="do not start the OTLP/gRPC receiver")),
    (
        ("--token",),
        dict(
            default=None,
            help="require 'Authorization: Bearer TOKEN' on every request (default: $AGL_STORE_TOKEN; required"
            " when --host is not a loopback address)",
        ),
    ),
    (
        ("--insecure-no-token",),
        dict(
            action="store_true",
            help="listen beyond localhost with no token: anyone who reaches the ports can read and write"
            " spans",
        ),
    ),
    (
        ("--redact",),
        dict(
            action="append",
            default=[],
            metavar="RULE",
            help="redact at ingest (repeatable): key:GLOB, regex:PATTERN, email, api-key",
        ),
    ),
    (
        ("--retention",),
        dict(
            action="append",
            default=[],
            metavar="RULE",
            help="delete old spans (repeatable): a duration like 7d or 12h, and/or 'consumed'",
        ),
    ),
    (
        ("--parse-workers",),
        dict(
            type=int,
            default=2,
            help="processes decoding OTLP beside the server; on a SQLite file they also write what they"
            " decode, taking turns; 0 decodes and writes in the server process (default: %(default)s)",
        ),
    ),
    (
        ("--max-pending-spans",),
        dict(
            type=int,
            default=200_000,
            help="write backlog above which ingest answers 'retry later' (default: %(default)s)",
        ),
    ),
    (
        ("--group-wait",),
        dict(
            type=float,
            default=10.0,
            metavar="SECONDS",
            help="spans that arrive without a rollout (an agent run outside agl's runner) become rollouts,"
            " grouped by rollout id, session or trace, once their trace has had no new span for SECONDS;"
            " 0 leaves them loose (default: %(default)s)",
        ),
    ),
    (
        ("--reward-range",),
        dict(
            type=_reward_range,
            default=DEFAULT_REWARD_RANGE,
            metavar="MIN:MAX",
            help="rewards outside MIN:MAX (late rewards, and agl.reward spans over OTLP) are refused, and"
            " so are NaN and infinities; a negative MIN needs the = form, --reward-range=-5:5"
            " (default: %(default)s)",
        ),
    ),
)


def _add_store_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """The options of ``agl store serve``."""
    for flags, options in _STORE_SERVE_OPTIONS:
        serve.add_argument(*flags, **options)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="agl", description="Train any LLM agent with reinforcement learning.")
    parser.add_argument("--version", action="version", version=f"agl {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    store = commands.add_parser("store", help="the collector-store").add_subparsers(
        dest="store_command", required=True, metavar="SUBCOMMAND"
    )
    _add_store_serve_arguments(store.add_parser("serve", help="run the collector-store"))
    add_store_arguments(store.add_parser("stats", help="print what a running store holds"))

    gateway = commands.add_parser("gateway", help="the LLM gateway").add_subparsers(
        dest="gateway_command", required=True, metavar="SUBCOMMAND"
    )
    from .gateway.cli import add_serve_arguments

    add_serve_arguments(
        gateway.add_parser("serve", help="serve a model behind the OpenAI-compatible gateway"), _port
    )
    from .runner.cli import add_run_arguments

    add_run_arguments(
        commands.add_parser(
            "run",
            help="run an agent on the rollouts queued in a store (runners on any machine)",
            description="Run MODULE:FUNCTION on the rollouts a trainer queues in a running store, until"
            " SIGINT/SIGTERM (the first lets running rollouts finish, a second exits at once).",
        )
    )
    from ._rollouts_cli import add_rollouts_arguments

    add_rollouts_arguments(commands.add_parser("rollouts", help="list the rollouts a store holds"))
    inspect = commands.add_parser(
        "inspect",
        help="print a rollout's span tree, transitions and problems",
        description="Print one rollout as the trainer sees it: its span tree, the transitions its LLM calls"
        " make, and why a call makes none. Rollout ids: `agl rollouts list`.",
    )
    inspect.add_argument("rollout_id", metavar="ROLLOUT_ID", help="the rollout (see `agl rollouts list`)")
    add_store_arguments(inspect)
    from .importer.cli import add_import_arguments

    add_import_arguments(
        commands.add_parser(
            "import",
            help="import OTLP trace files into a store, grouped into rollouts",
            description="Import trace files as the OpenTelemetry Collector's file exporter writes them (OTLP"
            " JSON lines or protobuf, gzip or not) into a store, one rollout per agl.rollout.id, session or"
            " trace. Exit status: 0 all imported, 1 some lines skipped (the rest imported), 2 stopped.",
        )
    )
    _add_reward_arguments(
        commands.add_parser(
            "reward",
            help="attach a reward to a rollout, one of its traces or one of its spans, after the fact",
            description="Attach a reward to a finished rollout (or to one of its traces or spans) as an"
            " agl.reward span; credit reads it exactly as a reward emitted during the rollout.",
        )
    )
    from .dashboard.cli import add_dashboard_arguments

    add_dashboard_arguments(
        commands.add_parser(
            "dashboard",
            help="the web dashboard: runs, live curves, rollouts and what one rollout did",
            description="Serve the dashboard over a store and training run directories until SIGINT/SIGTERM.",
        ),
        _port,
    )

    for command in plugins.command_plugins(reserved=_BUILT_IN_COMMANDS):
        command = _checked_arguments(command)
        reason = command.reason if isinstance(command, plugins.UnavailableCommand) else None
        sub = commands.add_parser(command.name, help=command.help, description=reason)
        command.add_arguments(sub)
        sub.set_defaults(plugin=command)
    return parser


def _store_serve(args: argparse.Namespace) -> int:
    from .server import StopSignals, serve_forever
    from .store import StoreError, open_store
    from .store.redact import parse_rules
    from .store.service import RetentionPolicy, StoreService

    def fail(message: str) -> int:
        print(f"agl store serve: {message}", file=sys.stderr)
        return 2

    token = settings.store_token(args.token)
    if args.token is not None and not args.token.strip():
        return fail('--token is empty; pass a secret, e.g. --token "$(openssl rand -hex 16)"')
    if token is None and not settings.is_loopback(args.host):
        if not args.insecure_no_token:
            return fail(
                f"--host {args.host} is reachable from other machines, and without a token anyone there could"
                " read every span and queue rollouts; pass --token TOKEN or set AGL_STORE_TOKEN (or"
                " --insecure-no-token to accept that)"
            )
        print(
            f"agl store serve: WARNING: --insecure-no-token: anyone who can reach {args.host} can read and"
            " write this store",
            file=sys.stderr,
        )
    if args.max_pending_spans < 1:
        return fail("--max-pending-spans must be >= 1")
    if not 0 <= args.parse_workers <= 64:
        return fail("--parse-workers must be between 0 and 64")
    if not 0 <= args.group_wait <= 86_400:  # NaN fails too
        return fail(f"--group-wait {args.group_wait}: give seconds from 0 (off) to 86400")
    try:
        redactor = parse_rules(args.redact)
        retention = RetentionPolicy.parse(args.retention)
    except ValueError as exc:
        return fail(str(exc))
    try:
        store = open_store(args.db)
    except (StoreError, OSError, ImportError) as exc:
        return fail(settings.masked_url(f"cannot open {args.db}: {exc}"))
    service = StoreService(
        store,
        token=token,
        redactor=redactor,
        retention=retention,
        max_pending_spans=args.max_pending_spans,
        parse_workers=args.parse_workers,
        group_wait_s=args.group_wait or None,
        reward_range=args.reward_range,
    )
    try:
        grpc_note = "off"
        if not args.no_grpc:
            try:
                grpc_note = f"{args.host}:{service.start_grpc(args.host, args.grpc_port)}"
            except OSError as exc:
                raise OSError(f"{exc} (OTLP/gRPC: --grpc-port PORT, or --no-grpc)") from None
        service.start_maintenance()
        print(
            f"agl store: {settings.masked_url(args.db)}; OTLP/HTTP + API on http://{args.host}:{args.http_port},"
            f" OTLP/gRPC {grpc_note}"
            + (f"; redacting {len(args.redact)} rule(s)" if args.redact else "")
            + (f"; retention {', '.join(args.retention)}" if retention else ""),
            flush=True,
        )
        # uvicorn stops on SIGINT / SIGTERM, then re-raises the signal to the handler it found; one that
        # returns lets the finally below run (parse workers stopped, the database closed cleanly).
        stop = StopSignals()
        try:
            serve_forever(service.app, args.host, args.http_port)
        except OSError as exc:
            raise OSError(f"{exc} (OTLP/HTTP and the API: --http-port PORT)") from None
    except (OSError, ImportError) as exc:
        return fail(settings.masked_url(str(exc)))
    finally:
        service.close()
        store.close()
    if stop.received is not None:
        print(
            f"agl store serve: stopped by {stop.name}; every span and rollout it acknowledged is in"
            f" {settings.masked_url(args.db)}",
            file=sys.stderr,
        )
    return stop.exit_code


def _add_reward_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rollout_id", metavar="ROLLOUT_ID", nargs="?", help="the rollout the reward is for")
    parser.add_argument("value", metavar="VALUE", nargs="?", help="the reward, a finite number")
    parser.add_argument(
        "--file",
        default=None,
        metavar="PATH",
        help="many rewards from a JSON-lines file ('-': stdin), one object per line: 'value' and"
        " 'rollout_id', 'trace_id' or 'span_id', and optionally 'name', 'source', 'id', 'time' (--name and"
        " --source are the defaults). A line without 'id' gets one from its content, so importing the file"
        " again stores nothing twice; a bad line is reported with its number and skipped",
    )
    parser.add_argument(
        "--name",
        default="episode",
        help="'episode' (the rollout's episode reward; the latest by time wins) or the name of an"
        " intermediate reward of one LLM call (default: %(default)s)",
    )
    parser.add_argument("--source", default="cli", help="who gave the reward (default: %(default)s)")
    parser.add_argument(
        "--id",
        dest="reward_id",
        default=None,
        metavar="REWARD_ID",
        help="the reward's id: posting the same reward under it again stores nothing new (default: a new id,"
        " printed)",
    )
    parser.add_argument(
        "--trace", default=None, metavar="TRACE_ID", help="attach it to this trace of the rollout"
    )
    parser.add_argument(
        "--span",
        default=None,
        metavar="SPAN_ID",
        help="attach it to this span of the rollout (an LLM call, a tool call, ...)",
    )
    parser.add_argument(
        "--time",
        default=None,
        metavar="ISO8601",
        help="when the reward was given, e.g. 2025-01-31T12:00:00Z (default: now)",
    )
    parser.add_argument(
        "--store",
        default=None,
        help="store URL, PostgreSQL DSN or SQLite file"
        f" (default: $AGL_STORE_URL or {settings.DEFAULT_STORE_URL})",
    )
    parser.add_argument("--token", default=None, help="the store's bearer token (default: $AGL_STORE_TOKEN)")
    parser.add_argument(
        "--reward-range",
        type=_reward_range,
        default=DEFAULT_REWARD_RANGE,
        metavar="MIN:MAX",
        help="refuse values outside MIN:MAX (a running store also applies its own --reward-range); a"
        " negative MIN needs the = form, --reward-range=-5:5 (default: %(default)s)",
    )


def _reward(args: argparse.Namespace) -> int:
    from .pipeline.rewards import Reward, format_time, new_reward_id, parse_time
    from .rewards_file import add_reward_file, open_reward_store
    from .store import StoreError

    if args.file is not None:
        given = [f for f, v in (("ROLLOUT_ID", args.rollout_id), ("--id", args.reward_id)) if v is not None]
        given += [f for f, v in (("--trace", args.trace), ("--span", args.span), ("--time", args.time)) if v]
        if given:
            print(f"agl reward: --file gives every reward's fields; drop {', '.join(given)}", file=sys.stderr)
            return 2
        return add_reward_file(
            args.file,
            args.store or settings.store_url(),
            args.token,
            args.name,
            args.source,
            reward_range=args.reward_range,
        )
    if args.rollout_id is None or args.value is None:
        print("agl reward: give ROLLOUT_ID and VALUE, or --file PATH", file=sys.stderr)
        return 2

    try:
        value = float(args.value)
    except ValueError:
        print(f"agl reward: VALUE {args.value!r} is not a number", file=sys.stderr)
        return 2
    problem = args.reward_range.problem(value)
    if problem:
        print(f"agl reward: VALUE: {problem}", file=sys.stderr)
        return 2
    try:
        reward = Reward(
            reward_id=args.reward_id if args.reward_id is not None else new_reward_id(),
            value=value,
            name=args.name,
            source=args.source,
            time_ns=parse_time(args.time) if args.time is not None else None,
            rollout_id=args.rollout_id,
            trace_id=args.trace,
            span_id=args.span,
        )
    except ValueError as exc:
        option = str(exc).split(":", 1)[0]
        flag = {"reward_id": "--id", "trace_id": "--trace", "span_id": "--span", "value": "VALUE"}
        flag.update({"name": "--name", "source": "--source", "time": "--time"})
        print(f"agl reward: {flag.get(option, option)}:{str(exc).split(':', 1)[-1]}", file=sys.stderr)
        return 2
    try:
        store = open_reward_store(args.store or settings.store_url(), args.token, args.reward_range)
    except ValueError as exc:
        print(f"agl reward: {exc}", file=sys.stderr)
        return 2
    try:
        (stored,) = store.add_rewards([reward])
    except StoreError as exc:
        print(f"agl reward: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    what = "attached" if stored.created else "already stored, unchanged:"
    print(
        f"{what} reward {stored.reward_id} ({stored.name} = {stored.value:g}, source {reward.source!r}) to"
        f" {reward.describe_target()}: span {stored.span_id} in trace {stored.trace_id}"
        + (f" under span {stored.parent_span_id}" if stored.parent_span_id else "")
        + f", at {format_time(stored.time_ns)}"
    )
    return 0


def _run_plugin(command: plugins.CliCommand, args: argparse.Namespace) -> int:
    try:
        return command.run(args)
    except plugins.PluginError as exc:
        print(exc, file=sys.stderr)
    except ImportError as exc:
        print(plugins.missing_requirement(f"agl {command.name}", exc, command.extra), file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    command = getattr(args, "plugin", None)
    if unknown and not isinstance(command, plugins.UnavailableCommand):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("agl_core.gateway.policy").setLevel(logging.INFO)  # every policy change, one line
    if command is not None:
        return _run_plugin(command, args)
    if args.command == "store" and args.store_command == "serve":
        return _store_serve(args)
    if args.command == "store" and args.store_command == "stats":
        from .store import StoreError

        try:
            reader = StoreReader(args.store, args.token)
            try:
                print(json.dumps(reader.stats(), indent=2))
            finally:
                reader.close()
        except StoreError as exc:
            print(f"agl store stats: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.command == "gateway" and args.gateway_command == "serve":
        from .gateway.cli import run_gateway_serve

        return run_gateway_serve(args)
    if args.command == "run":
        from .runner.cli import run_agents

        return run_agents(args)
    if args.command == "reward":
        return _reward(args)
    if args.command == "dashboard":
        from .dashboard.cli import run_dashboard

        return run_dashboard(args)
    if args.command == "rollouts":
        from ._rollouts_cli import run_rollouts

        return run_rollouts(args)
    if args.command == "import":
        from .importer.cli import run_import

        return run_import(args)
    if args.command == "inspect":
        from .pipeline.report import format_rollout, unjoined_response_ids
        from .store import StoreError

        try:
            reader = StoreReader(args.store, args.token)
            try:
                spans, rollout = reader.spans(args.rollout_id), reader.rollout(args.rollout_id)
                mine = [s for s in spans if s.rollout_id == args.rollout_id]
                missing = unjoined_response_ids(mine)
                recorded_in = reader.gateway_records(missing, args.rollout_id) if missing else {}
            finally:
                reader.close()
        except StoreError as exc:
            print(f"agl inspect: {exc}", file=sys.stderr)
            return 1
        if not spans and rollout is None:
            print(
                f"agl inspect: the store at {reader.where} has no rollout {args.rollout_id!r} and no spans"
                " of it",
                file=sys.stderr,
            )
            return 1
        print(format_rollout(args.rollout_id, spans, rollout=rollout, recorded_in=recorded_in))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
