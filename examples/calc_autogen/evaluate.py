"""Held-out accuracy of a policy on one split, through the real stack: HF backend, gateway, AutoGen agent.

    python evaluate.py dev.jsonl                                 # the base SmolLM2-135M-Instruct
    python evaluate.py val.jsonl --adapter runs/calc_autogen/adapter --samples 4 --temperature 1

Prints the mean reward, its standard error over problems and n (problems x samples), plus how the agent
used its tool. A problem's score is the mean over its ``--samples`` attempts; the standard error is that
of the mean over problems (attempts of one problem are not independent).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import agent as calc_agent  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Per-problem mean rewards (in task order) and tool-use counts over every attempt."""

    task_ids: list[str]
    scores: list[float]
    attempts: int
    tool_calls: int
    tool_errors: int
    no_tool: int
    seconds: float
    #: Every attempt, ``samples`` per problem in task order.
    outcomes: list[calc_agent.Outcome] = dataclasses.field(default_factory=list, repr=False)

    @property
    def mean(self) -> float:
        return sum(self.scores) / len(self.scores)

    @property
    def stderr(self) -> float:
        n = len(self.scores)
        if n < 2:
            return float("nan")
        m = self.mean
        return math.sqrt(sum((s - m) ** 2 for s in self.scores) / (n - 1) / n)

    def summary(self, label: str) -> str:
        return (
            f"{label}: mean={self.mean:.3f} se={self.stderr:.3f} n={len(self.scores)} problems"
            f" x {self.attempts // len(self.scores)} samples | tool calls/attempt={self.tool_calls / self.attempts:.2f}"
            f" failed tool calls={self.tool_errors} attempts without a tool call={self.no_tool}"
            f" | {self.seconds:.0f}s"
        )


def paired_difference(before: Evaluation, after: Evaluation) -> tuple[float, float]:
    """Mean and standard error of ``after - before`` per problem (the same problems in the same order)."""
    if before.task_ids != after.task_ids:
        raise ValueError("the two evaluations are over different problems")
    diffs = [a - b for a, b in zip(after.scores, before.scores)]
    n = len(diffs)
    mean = sum(diffs) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else float("nan")
    return mean, se


def operators(expression: str) -> str:
    """The arithmetic operators of an expression in order ("12 * 4 + 3" -> "*+"); "" for none."""
    return "".join(ch for ch in expression if ch in "+-*/")


def operator_report(
    tasks: Sequence[dict[str, Any]], outcomes: Sequence[calc_agent.Outcome], samples: int
) -> str:
    """Per operation of the reference expression: problems, mean reward and the operators the model wrote."""
    rows: dict[str, tuple[list[float], collections.Counter]] = {}
    for i, task in enumerate(tasks):
        scores, used = rows.setdefault(
            operators(str(task.get("expression", ""))) or "?", ([], collections.Counter())
        )
        for outcome in outcomes[i * samples : (i + 1) * samples]:
            scores.append(outcome.reward)
            used[(operators(outcome.expressions[0]) or "none") if outcome.expressions else "text"] += 1
    lines = ["reference op | attempts | mean reward | operators the model wrote"]
    for op, (scores, used) in sorted(rows.items()):
        wrote = ", ".join(f"{k} {v}" for k, v in used.most_common())
        lines.append(f"{op:>12} | {len(scores):>8} | {sum(scores) / len(scores):>11.3f} | {wrote}")
    return "\n".join(lines)


def load_split(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    tasks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not tasks:
        raise ValueError(f"{path}: no problems")
    return tasks[:limit] if limit else tasks


def evaluate(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[dict[str, Any]],
    *,
    samples: int = 1,
    temperature: float = 0.0,
    max_tokens: int = calc_agent.MAX_TOKENS,
    concurrency: int = 16,
) -> Evaluation:
    """Serve ``model`` behind a gateway on a free port and run the agent ``samples`` times on each task."""
    from agl_core._serve import BackgroundServer
    from agl_core.gateway import create_gateway_app
    from agl_core.runner import LLM
    from agl_trainer.hf_backend import HFBackend

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    start = time.monotonic()
    backend = HFBackend(
        model, tokenizer, model_name="agl-policy", default_max_tokens=max_tokens, max_batch=concurrency
    )
    try:
        with BackgroundServer(create_gateway_app(backend)) as gateway:
            llm = LLM(base_url=f"{gateway.url}/v1", model="agl-policy")

            def attempt(task: dict[str, Any]) -> calc_agent.Outcome:
                return asyncio.run(
                    calc_agent.run_agent(
                        task["question"], task["answer"], llm, temperature=temperature, max_tokens=max_tokens
                    )
                )

            jobs = [task for task in tasks for _ in range(samples)]
            with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                outcomes = list(pool.map(attempt, jobs))
    finally:
        backend.close()
    scores = [
        sum(o.reward for o in outcomes[i * samples : (i + 1) * samples]) / samples for i in range(len(tasks))
    ]
    return Evaluation(
        task_ids=[str(t.get("id", i)) for i, t in enumerate(tasks)],
        scores=scores,
        attempts=len(outcomes),
        tool_calls=sum(o.tool_calls for o in outcomes),
        tool_errors=sum(o.tool_errors for o in outcomes),
        no_tool=sum(o.tool_calls == 0 for o in outcomes),
        seconds=time.monotonic() - start,
        outcomes=outcomes,
    )


def load_model(source: str, adapter: Path | None) -> tuple[Any, Any]:
    from agl_trainer.model import load_policy

    model, tokenizer = load_policy(source)
    if adapter is not None:
        from peft import PeftModel

        if not (adapter / "adapter_config.json").is_file():
            raise SystemExit(
                f"{adapter} has no adapter_config.json; pass the directory a LoRA adapter was saved to"
            )
        model = PeftModel.from_pretrained(model, str(adapter))
    return model, tokenizer


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("split", type=Path, help="JSONL problems (dev.jsonl, val.jsonl, ...)")
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, or a local model directory")
    parser.add_argument("--adapter", type=Path, help="a saved LoRA adapter directory to evaluate")
    parser.add_argument("--samples", type=int, default=1, help="attempts per problem")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--max-tokens", type=int, default=calc_agent.MAX_TOKENS)
    parser.add_argument("--limit", type=int, help="only the first N problems")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--show", type=int, default=0, help="print the agent's final message for N problems")
    args = parser.parse_args(argv)
    if not args.split.is_file():
        raise SystemExit(f"{args.split} does not exist; write the splits with make_tasks.py")

    import torch

    torch.set_num_threads(args.threads)
    tasks = load_split(args.split, args.limit)
    model, tokenizer = load_model(args.model, args.adapter)
    result = evaluate(
        model,
        tokenizer,
        tasks,
        samples=args.samples,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
    )
    for task, outcome in zip([t for t in tasks for _ in range(args.samples)], result.outcomes[: args.show]):
        print(
            f"[{outcome.reward:.0f}] {task['question']} (answer {task['answer']}) -> {outcome.final_text!r}"
        )
    print(operator_report(tasks, result.outcomes, args.samples))
    print(result.summary(f"{args.split.name}{' + ' + str(args.adapter) if args.adapter else ''}"))


if __name__ == "__main__":
    main()
