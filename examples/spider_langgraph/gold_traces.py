"""A warm start for the Spider agent: its writer's call answered with the gold SQL, for every training
question, as traces the stored-traces SFT path learns from.

    python examples/spider_langgraph/gold_traces.py [--out runs/spider_gold]
    agl train examples/spider_langgraph/config.sft.yaml      # SFT on them: runs/spider_sft
    agl train examples/spider_langgraph/config.warm.yaml     # then RL from that adapter

SmolLM2-135M answers almost none of Spider's questions (0.004 held-out), so a group of rollouts rarely
holds a success and RL alone has little to learn from. Spider's training questions come with gold SQL:
this writes, for each question of ``train.jsonl`` (never a held-out database's), one trace whose LLM span
is the agent's ``writer`` call (the same system prompt with the database's schema, the same question)
answered with the gold query, in the OpenTelemetry GenAI conventions (``gen_ai.input.messages``,
``gen_ai.output.messages``), as OTLP JSON lines (``OUT/gold.jsonl``, what a Collector's ``file`` exporter
writes). It then imports them into ``OUT/store.sqlite`` with ``agl import``: one rollout per trace, which
``config.sft.yaml`` selects (``traces.filter.source: import``). The held-out score stays Spider's
execution accuracy on the held-out databases.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from agent import WRITER_SYSTEM, schema_text  # noqa: E402

#: Traces per OTLP JSON line.
PER_LINE = 100


def _attribute(key: str, value: str) -> dict[str, Any]:
    return {"key": key, "value": {"stringValue": value}}


def _text(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "parts": [{"type": "text", "content": text}]}


def gold_span(task: dict[str, Any], start_ns: int) -> dict[str, Any]:
    """The writer's call of ``task`` answered with its gold SQL, as an OTLP JSON span of its own trace."""
    digest = hashlib.sha256(f"spider-gold:{task['id']}".encode()).hexdigest()
    system = WRITER_SYSTEM.format(schema=schema_text(task["db_id"]))
    inputs = [_text("system", system), _text("user", task["question"])]
    output = {**_text("assistant", " ".join(task["gold"].split())), "finish_reason": "stop"}
    return {
        "traceId": digest[:32],
        "spanId": digest[32:48],
        "name": "chat agl-policy",
        "kind": 3,  # client
        "startTimeUnixNano": str(start_ns),
        "endTimeUnixNano": str(start_ns + 1_000_000),
        "attributes": [
            _attribute("gen_ai.operation.name", "chat"),
            _attribute("gen_ai.request.model", "agl-policy"),
            _attribute("gen_ai.agent.name", "writer"),
            _attribute("gen_ai.input.messages", json.dumps(inputs)),
            _attribute("gen_ai.output.messages", json.dumps([output])),
            _attribute("spider.question_id", task["id"]),
        ],
        "status": {"code": 1},
    }


def write_traces(tasks: list[dict[str, Any]], path: Path) -> int:
    """``tasks``' gold spans as OTLP JSON lines in ``path``; how many."""
    spans = [gold_span(task, 1_700_000_000_000_000_000 + i * 10_000_000) for i, task in enumerate(tasks)]
    with path.open("w") as f:
        for start in range(0, len(spans), PER_LINE):
            scope = {"scope": {"name": "agl.examples.spider_gold"}, "spans": spans[start : start + PER_LINE]}
            resource = {"attributes": [_attribute("service.name", "spider-gold")]}
            f.write(json.dumps({"resourceSpans": [{"resource": resource, "scopeSpans": [scope]}]}) + "\n")
    return len(spans)


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
    count = write_traces(tasks, traces)
    print(f"{count} gold writer calls in {traces}")
    command = [sys.executable, "-m", "agl_core.cli", "import", str(traces), "--store", str(store)]
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
