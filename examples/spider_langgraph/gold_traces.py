"""A warm start for the Spider agent: its writer's call answered with the gold SQL, for every training
question, as traces the stored-traces SFT path learns from.

    python examples/spider_langgraph/gold_traces.py [--out runs/spider_gold]
    agl train examples/spider_langgraph/config.sft.yaml      # SFT on them: runs/spider_sft
    agl train examples/spider_langgraph/config.warm.yaml     # then RL from that adapter

SmolLM2-135M answers almost none of Spider's questions (0.004 held-out), so a group of rollouts rarely
holds a success and RL alone has little to learn from. Spider's training questions come with gold SQL:
this writes, for each question of ``train.jsonl`` (never a held-out database's), the agent's ``writer``
call (the same system prompt with the database's schema, the same question) answered with the gold query,
as OTLP JSON lines (``OUT/gold.jsonl``, with ``agl_core.importer.write_demonstrations``), and imports them
into ``OUT/store.sqlite``: one rollout per question, which ``config.sft.yaml`` selects
(``traces.filter.source: import``). The held-out score stays Spider's execution accuracy on the held-out
databases.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from agl_core.importer import Demonstration, import_traces, write_demonstrations

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from agent import WRITER_SYSTEM, schema_text  # noqa: E402


def demonstration(task: dict[str, Any]) -> Demonstration:
    """The writer's call of ``task`` answered with its gold SQL."""
    system = WRITER_SYSTEM.format(schema=schema_text(task["db_id"]))
    return Demonstration(
        id=f"spider-gold:{task['id']}",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": task["question"]}],
        response=" ".join(task["gold"].split()),
        agent="writer",
        attributes={"spider.question_id": task["id"]},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/spider_gold"), help="(runs/spider_gold)")
    parser.add_argument("--tasks", type=Path, default=HERE / "train.jsonl", help="(train.jsonl here)")
    args = parser.parse_args(argv)
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    held_out = set(json.loads((HERE / "split.json").read_text())["held_out_databases"])
    leaked = sorted({t["db_id"] for t in tasks} & held_out)
    if leaked:
        print(f"error: {args.tasks} holds questions on held-out databases {leaked}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    traces, store = args.out / "gold.jsonl", args.out / "store.sqlite"
    count = write_demonstrations(traces, map(demonstration, tasks), service="spider-gold")
    summary = import_traces([traces], str(store))
    print(f"{count} gold writer calls in {traces}; {summary.rollouts} rollouts in {store}")
    for problem in summary.problems:
        print(f"  skipped: {problem}", file=sys.stderr)
    return summary.exit_code


if __name__ == "__main__":
    sys.exit(main())
