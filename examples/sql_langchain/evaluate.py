"""Execution accuracy of the untrained agent on a task file (``dev.jsonl`` by default), without training.

Serves the model through the gateway as training does and runs the agent on every task, printing the
mean ± SE, the accuracy per template, how often each verdict ended a run, and a few final queries:

    PYTHONPATH=src:trainer python examples/sql_langchain/evaluate.py [dev.jsonl] [--rollouts 2] [--model smollm2]
                                                                     [--adapter runs/.../checkpoints/step-N/adapter]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import agent  # noqa: E402
from company_db import same_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks", nargs="?", default=str(HERE / "dev.jsonl"), help="JSONL task file")
    parser.add_argument("--rollouts", type=int, default=2, help="runs per task (default 2)")
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a Hugging Face model directory")
    parser.add_argument("--adapter", default=None, help="a PEFT adapter directory (a checkpoint's) to apply")
    parser.add_argument("--workers", type=int, default=4, help="concurrent runs (the gateway batches them)")
    parser.add_argument("--limit", type=int, default=None, help="first N tasks only")
    parser.add_argument("--show", type=int, default=8, help="final queries to print")
    args = parser.parse_args()
    path = Path(args.tasks)
    if not path.is_file():
        parser.error(f"task file {path} does not exist")
    tasks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][: args.limit]

    import torch

    from agl_core._serve import BackgroundServer
    from agl_core.gateway import create_gateway_app
    from agl_core.runner import LLM
    from agl_trainer.hf_backend import HFBackend
    from agl_trainer.model import load_policy

    torch.set_num_threads(1)
    model, tokenizer = load_policy(args.model)
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    backend = HFBackend(model, tokenizer, model_name="agl-policy")
    server = BackgroundServer(create_gateway_app(backend)).start()
    llm = LLM(base_url=f"{server.url}/v1", model="agl-policy")

    def one(task: dict) -> tuple[dict, dict]:
        final = agent.run(task, llm)
        ok = final.get("verdict") != "error" and same_result(final.get("rows", []), task["answer"])
        return task, {
            "ok": ok,
            "query": final.get("query"),
            "verdict": final.get("verdict"),
            "rewrites": final.get("rewrites", 0),
            "replies": final.get("replies", []),
        }

    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(args.workers) as pool:
            results = list(pool.map(one, [t for t in tasks for _ in range(args.rollouts)]))
    finally:
        server.stop()
        backend.close()
    seconds = time.monotonic() - t0

    per_task: dict[str, list[float]] = defaultdict(list)
    per_template: dict[str, list[float]] = defaultdict(list)
    for task, r in results:
        per_task[task["id"]].append(float(r["ok"]))
        per_template[task["template"]].append(float(r["ok"]))
    scores = [sum(v) / len(v) for v in per_task.values()]
    mean = sum(scores) / len(scores)
    se = (
        math.sqrt(sum((s - mean) ** 2 for s in scores) / (len(scores) - 1) / len(scores))
        if len(scores) > 1
        else 0.0
    )
    print(
        f"accuracy {mean:.3f} ± {se:.3f} (SE, n={len(scores)} tasks x {args.rollouts} runs) in {seconds:.0f}s"
    )
    print("  tasks solved at least once:", sum(s > 0 for s in scores), "of", len(scores))
    print(
        "  final verdicts:",
        dict(Counter(r["verdict"] for _, r in results)),
        " rewrites:",
        dict(Counter(r["rewrites"] for _, r in results)),
    )
    for template, values in sorted(per_template.items()):
        print(f"  {template:26s} {sum(values) / len(values):.2f} ({len(values)} runs)")
    for task, r in results[: args.show]:
        print(f"  [{'ok' if r['ok'] else '--'}] {task['question']}")
        for name, reply in r["replies"]:
            print(f"        {name}: {' '.join(reply.split())[:150]}")


if __name__ == "__main__":
    main()
