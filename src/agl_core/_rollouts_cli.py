"""``agl rollouts list``: the rollouts a store holds, newest first, with the dashboard's filters.

    agl rollouts list [--store URL|FILE] [--status S ...] [--task-id T] [--group-id G] [--step N]
                      [--split S] [--agent NAME] [--reward-min X] [--reward-max X] [--limit N]
                      [--before SEQ] [--json]

A table (rollout id, status, reward, spans, source, task, created) or, with ``--json``, the store's page
as JSON. Every rollout the store holds is listed: queued by a trainer, imported, captured by the gateway,
or grouped from spans sent without a rollout (``agl store serve --group-wait``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from typing import Any

from . import settings
from ._store_reader import add_store_arguments
from .records import RolloutStatus

__all__ = ["add_rollouts_arguments", "run_rollouts"]

_STATUSES = [s.value for s in RolloutStatus]


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number")
    return value


def _count(low: int, high: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value}: give a number from {low} to {high}")
        return value

    return parse


def add_rollouts_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="rollouts_command", required=True, metavar="SUBCOMMAND")
    listing = sub.add_parser(
        "list",
        help="the rollouts a store holds, newest first (filters as the dashboard's)",
        description="List the rollouts a store holds, newest first: queued by a trainer, imported, captured"
        " by the gateway, or grouped from spans sent without a rollout.",
    )
    add_store_arguments(listing)
    listing.add_argument(
        "--status",
        action="append",
        default=[],
        choices=_STATUSES,
        help="only rollouts in this state (repeatable)",
    )
    listing.add_argument("--task-id", default=None, help="only rollouts of this task")
    listing.add_argument(
        "--group-id", default=None, help="only rollouts of this group (a task within a step)"
    )
    listing.add_argument(
        "--step", type=_count(0, 2**63 - 1), default=None, help="only rollouts of this training step"
    )
    listing.add_argument("--split", default=None, help="only rollouts of this split (train, val, ...)")
    listing.add_argument(
        "--run", default=None, help="only rollouts of this training run (its output folder's name)"
    )
    listing.add_argument(
        "--agent", default=None, help="only rollouts with a span naming this agent (gen_ai.agent.name)"
    )
    listing.add_argument(
        "--search",
        default=None,
        metavar="TEXT",
        help="only rollouts with a span whose name or an attribute (key or text value) contains TEXT"
        " (case-sensitive)",
    )
    listing.add_argument("--reward-min", type=_finite, default=None, help="only rewards at least this")
    listing.add_argument("--reward-max", type=_finite, default=None, help="only rewards at most this")
    listing.add_argument(
        "--limit",
        type=_count(1, 500),
        default=50,
        help="most rollouts to list, 1 to 500 (default: %(default)s)",
    )
    listing.add_argument(
        "--before",
        type=_count(1, 2**63 - 1),
        default=None,
        metavar="SEQ",
        help="start below this store position (the next page: the number the last page printed)",
    )
    listing.add_argument("--json", action="store_true", help="print the page as JSON")


def _cell(value: Any, width: int) -> str:
    text = str(value)
    return text if len(text) <= width else text[: width - 1] + "~"


def _when(created_at: float) -> str:
    if not created_at:
        return "-"
    return datetime.datetime.fromtimestamp(created_at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def run_rollouts(args: argparse.Namespace) -> int:
    from ._store_reader import StoreReader
    from .store import RolloutFilter, StoreError
    from .store.formats.wire import page_to_json

    def fail(message: str) -> int:
        print(f"agl rollouts list: {message}", file=sys.stderr)
        return 2

    try:
        where = RolloutFilter(
            statuses=tuple(args.status),
            task_id=args.task_id,
            group_id=args.group_id,
            step=args.step,
            split=args.split,
            run=args.run,
            agent=args.agent,
            text=args.search,
            reward_min=args.reward_min,
            reward_max=args.reward_max,
        )
    except ValueError as exc:
        return fail(f"{exc} (--search, --reward-min, --reward-max)")
    try:
        reader = StoreReader(args.store, settings.store_token(args.token))
        try:
            if reader.store is not None:
                page = reader.store.list_rollouts(where, before=args.before, limit=args.limit)
            else:
                assert reader.client is not None
                page = reader.client.list_rollouts(where, before=args.before, limit=args.limit)
        finally:
            reader.close()
    except StoreError as exc:
        print(f"agl rollouts list: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(page_to_json(page), indent=2))
        return 0
    if not page.rollouts:
        print(f"no rollouts match in {reader.where}")
        return 0
    header = (
        f"{'ROLLOUT':<40} {'STATUS':<10} {'REWARD':>8} {'SPANS':>6}  {'SOURCE':<8} {'TASK':<24} CREATED (UTC)"
    )
    print(header)
    for rollout in page.rollouts:
        reward = "-" if rollout.reward is None else f"{rollout.reward:.3f}"
        source = str(rollout.metadata.get("source") or ("queue" if rollout.attempts else "-"))
        print(
            f"{_cell(rollout.rollout_id, 40):<40} {rollout.status.value:<10} {reward:>8}"
            f" {page.span_counts.get(rollout.rollout_id, 0):>6}  {_cell(source, 8):<8}"
            f" {_cell(rollout.task_id, 24):<24} {_when(rollout.created_at)}"
        )
    total = f"{page.total:,}" + ("+" if page.total_capped else "")
    shown = f"{len(page.rollouts)} of {total} matching rollout(s) in {reader.where}"
    if page.before is not None:
        shown += f"; the next page: --before {page.before}"
    print(shown)
    return 0
