"""A warm start for the BFCL agent: each training entry's call answered with its ground truth, as traces
the stored-traces SFT path learns from.

    python examples/bfcl_openai/gold_traces.py [--out runs/bfcl_gold]
    agl train examples/bfcl_openai/config.sft.yaml      # SFT on them: runs/bfcl_sft
    agl train examples/bfcl_openai/config.warm.yaml     # then RL from that adapter

SmolLM2-135M never answers a BFCL entry right by itself: asked for a call, it copies the format's
placeholder (``{"name": "<function name>", ...}``) or writes prose. BFCL's entries come with their ground
truth: this writes, for each entry of ``train.jsonl`` (never a held-out one), the agent's call (the same
user turn, the same tools) answered with one right answer (``bfcl_check.gold_calls``: each expected call
with the first accepted value of every parameter), as OTLP JSON lines (``OUT/gold.jsonl``, with
``agl_core.importer.write_demonstrations``), and imports them into ``OUT/store.sqlite``: one rollout per
entry, which ``config.sft.yaml`` selects. The held-out score stays BFCL's AST accuracy on the held-out
entries.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agl_core.importer import Demonstration, import_traces, write_demonstrations

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from agent import tool_name, tools_of  # noqa: E402
from bfcl_check import gold_calls  # noqa: E402


def demonstration(task: dict) -> Demonstration:
    """The agent's call for ``task`` answered with its ground truth, under the names the agent offers."""
    calls = [(tool_name(name), args) for name, args in gold_calls(task["functions"], task["ground_truth"])]
    return Demonstration(
        id=f"bfcl-gold:{task['id']}",
        messages=task["messages"],
        tool_calls=calls,
        tools=tools_of(task["functions"]),
        attributes={"bfcl.entry_id": task["id"]},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bfcl_gold"), help="(runs/bfcl_gold)")
    parser.add_argument("--tasks", type=Path, default=HERE / "train.jsonl", help="(train.jsonl here)")
    args = parser.parse_args(argv)
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    held_out = set(json.loads((HERE / "split.json").read_text())["held_out_ids"])
    leaked = sorted({t["id"] for t in tasks} & held_out)
    if leaked:
        print(f"error: {args.tasks} holds held-out entries {leaked[:5]}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    traces = args.out / "gold.jsonl"
    count = write_demonstrations(traces, map(demonstration, tasks), service="bfcl-gold")
    summary = import_traces([traces], str(args.out / "store.sqlite"))
    print(
        f"{count} ground-truth calls in {traces}; {summary.rollouts} rollouts in {args.out / 'store.sqlite'}"
    )
    for problem in summary.problems:
        print(f"  skipped: {problem}", file=sys.stderr)
    return summary.exit_code


if __name__ == "__main__":
    sys.exit(main())
