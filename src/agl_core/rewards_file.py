"""``agl reward --file PATH``: many late rewards from a JSON-lines file, as an application's feedback log
writes them.

Each line is an object: ``value`` and a target (``rollout_id``, ``trace_id`` or ``span_id``, as for one
reward), optionally ``name``, ``source``, ``id`` and ``time`` (ISO 8601). A line without ``id`` gets one
from its content (``file-<sha256 of the line's fields>``), so importing the same file again stores nothing
twice. A line that is not JSON, or not a valid reward, is reported with its number and skipped; rewards are
sent in batches, and a batch the store refuses (an unknown rollout, an id stored with another reward) is
sent again one reward at a time, so only the refused lines are lost, each reported.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from ._bounded import bounded_lines
from .pipeline.rewards import DEFAULT_REWARD_RANGE, Reward, RewardRange, parse_time

__all__ = ["add_reward_file", "open_reward_store", "read_reward_lines"]

#: Rewards per request to the store.
BATCH = 500
_FIELDS = {"value", "rollout_id", "trace_id", "span_id", "name", "source", "id", "time"}


def _content_id(fields: dict[str, Any]) -> str:
    canonical = json.dumps({k: fields[k] for k in sorted(fields) if k != "id"}, sort_keys=True)
    return "file-" + hashlib.sha256(canonical.encode()).hexdigest()[:32]


#: The longest line read as a reward; a longer one is reported and skipped, never held whole.
MAX_LINE_CHARS = 1024 * 1024


def read_reward_lines(
    stream: IO[str], *, name: str, source: str
) -> Iterator[tuple[int, Reward | None, str | None]]:
    """``(line number, reward, None)`` for each good line and ``(line number, None, why)`` for each bad
    one; blank lines are skipped. ``name`` and ``source`` are the defaults of lines without them."""
    for number, line in bounded_lines(stream, MAX_LINE_CHARS):
        if line is None:
            yield number, None, f"longer than {MAX_LINE_CHARS} characters (a reward line is a small object)"
            continue
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
        except json.JSONDecodeError as exc:
            yield number, None, f"not JSON ({exc.msg} at column {exc.colno})"
            continue
        except RecursionError:
            yield number, None, "not JSON this reader takes: nested too deeply"
            continue
        if not isinstance(fields, dict):
            yield number, None, f"a JSON {type(fields).__name__}, not an object"
            continue
        unknown = sorted(set(fields) - _FIELDS)
        if unknown:
            yield number, None, f"unknown field {unknown[0]!r} (known: {', '.join(sorted(_FIELDS))})"
            continue
        if "value" not in fields:
            yield number, None, "no 'value'"
            continue
        try:
            time_ns = parse_time(str(fields["time"])) if fields.get("time") is not None else None
            reward = Reward(
                reward_id=str(fields.get("id") or _content_id(fields)),
                value=fields["value"],
                name=str(fields.get("name", name)),
                source=str(fields.get("source", source)),
                time_ns=time_ns,
                rollout_id=fields.get("rollout_id"),
                trace_id=fields.get("trace_id"),
                span_id=fields.get("span_id"),
            )
        except (ValueError, TypeError) as exc:
            yield number, None, str(exc)
            continue
        yield number, reward, None


def open_reward_store(
    target: str, token: str | None, reward_range: RewardRange = DEFAULT_REWARD_RANGE
) -> Any:
    """The store rewards go to: a running store at the URL ``target`` (with ``token``; it applies its
    own reward range), or the SQLite file or PostgreSQL DSN ``target`` (taking ``reward_range``);
    ``ValueError`` when it is none of these. The caller closes it."""
    from .store import StoreClient, StoreError, connect

    try:
        store = connect(target, token, must_exist=True)
    except StoreError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(store, StoreClient):  # a database this process writes to: the range is applied here
        store.reward_range = reward_range
    return store


def add_reward_file(
    path: str,
    target: str,
    token: str | None,
    name: str,
    source: str,
    *,
    reward_range: RewardRange = DEFAULT_REWARD_RANGE,
) -> int:
    """Attach the rewards of the file at ``path`` (``-``: stdin) to the store at ``target`` (a URL, a
    PostgreSQL DSN or a SQLite file); prints what happened. Exit status: 0 all attached, 1 some lines
    skipped or refused, 2 the file or store could not be used at all."""
    from .store import StoreError, StoreUnavailableError

    if path != "-" and not Path(path).is_file():
        print(f"agl reward: --file {path}: no such file", file=sys.stderr)
        return 2
    try:
        store = open_reward_store(target, token, reward_range)
    except ValueError as exc:
        print(f"agl reward: {exc}", file=sys.stderr)
        return 2
    created = unchanged = skipped = 0

    def bad(number: int, why: str) -> None:
        nonlocal skipped
        skipped += 1
        print(f"agl reward: {path}:{number}: {why}; skipped", file=sys.stderr)

    def send(batch: list[tuple[int, Reward]]) -> None:
        nonlocal created, unchanged
        try:
            stored = store.add_rewards([r for _, r in batch])
        except StoreUnavailableError:
            raise
        except StoreError:
            if len(batch) == 1:
                raise
            for one in batch:  # find the refused ones; the others go in on their own
                try:
                    send([one])
                except StoreError as exc:
                    if isinstance(exc, StoreUnavailableError):
                        raise
                    bad(one[0], str(exc))
            return
        created += sum(1 for s in stored if s.created)
        unchanged += sum(1 for s in stored if not s.created)

    stream: IO[str] = sys.stdin if path == "-" else open(path, encoding="utf-8", errors="replace")  # noqa: SIM115
    try:
        batch: list[tuple[int, Reward]] = []
        for number, reward, why in read_reward_lines(stream, name=name, source=source):
            if reward is None:
                bad(number, why or "invalid")
                continue
            problem = reward_range.problem(reward.value)
            if problem:
                bad(number, f"value: {problem}")
                continue
            batch.append((number, reward))
            if len(batch) >= BATCH:
                send(batch)
                batch = []
        if batch:
            send(batch)
    except StoreUnavailableError as exc:
        print(f"agl reward: {exc}; {created} attached before it", file=sys.stderr)
        return 2
    finally:
        if stream is not sys.stdin:
            stream.close()
        store.close()
    print(
        f"attached {created} reward(s) from {path} ({unchanged} already stored, unchanged)"
        + (f"; skipped {skipped} line(s)" if skipped else "")
    )
    return 1 if skipped else 0
