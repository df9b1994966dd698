"""How the calculator agent used its tool, per operation, on top of ``agl eval``.

    python examples/calc_autogen/evaluate.py dev.jsonl                     # the base SmolLM2-135M-Instruct
    python examples/calc_autogen/evaluate.py val.jsonl --checkpoint runs/calc_autogen --samples 4

Scores the policy exactly as ``agl eval examples/calc_autogen/config.yaml --tasks FILE`` does (the same
line: mean ± SE over problems, n), then reads each rollout's spans for what the model wrote: per operation
of the reference expression, the problems' mean reward and the operators of the model's first calculator
call, and how many calls it made and how many failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import agent as calc_agent  # noqa: E402


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


def outcome_from_spans(reward: float, spans: Sequence[Any]) -> calc_agent.Outcome:
    """What one rollout did, read from its spans: the gateway's record of each reply (the calls the
    model asked for, its text) and the calculator's tool spans (which of them raised)."""
    from agl_core import semconv

    replies = sorted(
        (s for s in spans if s.attributes.get(semconv.SOURCE) == semconv.SOURCE_GATEWAY),
        key=lambda s: s.start_ns,
    )
    expressions: list[str] = []
    text = ""
    for span in replies:
        for message in json.loads(span.attributes.get(semconv.GEN_AI_OUTPUT_MESSAGES) or "[]"):
            called = [
                calc_agent._expression_of(call.get("function", {}).get("arguments", ""))
                for call in message.get("tool_calls") or []
            ]
            expressions += called
            text = message.get("content") or ", ".join(f"calculator({e!r})" for e in called)
    errors = sum(
        s.is_error and s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == semconv.OP_EXECUTE_TOOL
        for s in spans
    )
    return calc_agent.Outcome(None, reward, len(expressions), errors, text, tuple(expressions))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "tasks", nargs="?", help="JSONL problems (dev.jsonl, val.jsonl; default: the config's val)"
    )
    parser.add_argument(
        "--config", default=str(HERE / "config.yaml"), help="the trainer config (default: this example's)"
    )
    parser.add_argument(
        "--checkpoint", help="a checkpoint (or run) directory to score instead of the base model"
    )
    parser.add_argument("--samples", type=int, default=1, help="attempts per problem")
    parser.add_argument("--limit", type=int, help="only the first N problems")
    parser.add_argument("--split", default="val", help="llm.split: val decodes greedily, train samples")
    parser.add_argument("--show", type=int, default=0, help="print the model's reply for N attempts")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)

    from agl_trainer import load_config
    from agl_trainer.evaluate import evaluate

    path = None
    if args.tasks is not None:
        path = Path(args.tasks) if Path(args.tasks).is_file() else HERE / args.tasks
        if not path.is_file():
            parser.error(
                f"{args.tasks} does not exist (here or in {HERE}); write the splits with make_tasks.py"
            )
    config = load_config(args.config, args.overrides)
    done = evaluate(
        config,
        tasks=path,
        checkpoint=args.checkpoint,
        samples=args.samples,
        limit=args.limit,
        split=args.split,
        keep_spans=True,
    )
    score = done.score
    outcomes = [outcome_from_spans(r.reward, score.spans.get(r.rollout_id, [])) for r in score.rollouts]
    tasks = [t.input for t in done.tasks]
    for task, outcome in zip(
        [t for t in tasks for _ in range(args.samples)], outcomes[: args.show], strict=False
    ):
        print(
            f"[{outcome.reward:.0f}] {task['question']} (answer {task['answer']}) -> {outcome.final_text!r}"
        )
    print(operator_report(tasks, outcomes, args.samples))
    attempts = len(outcomes)
    print(
        f"tool calls/attempt={sum(o.tool_calls for o in outcomes) / attempts:.2f}"
        f" failed tool calls={sum(o.tool_errors for o in outcomes)}"
        f" attempts without a tool call={sum(o.tool_calls == 0 for o in outcomes)}"
    )
    print(f"{score.policy}: {score.result.describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
