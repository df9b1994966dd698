"""A warm start for the GSM calculator agent: its first call on each training problem answered with the
generator's worked solution, as traces the stored-traces SFT path learns from.

    python examples/calc_autogen/gsm_gold.py [--out runs/gsm_gold]
    agl train examples/calc_autogen/config.gsm.sft.yaml      # SFT on them: runs/calc_gsm_sft

``gsm_symbolic`` gives each problem a worked solution (``answer_cot``: the steps in words and arithmetic,
ending ``#### answer``). This writes, for each problem of ``gsm/train.jsonl`` (never a held-out
template's), the agent's first call (its system prompt, the calculator tool, the worked examples as
earlier turns, the question) answered with that solution, its last line written as the agent's answer
format (``<answer>N</answer>``), with ``agl_core.importer.write_demonstrations``, and imports them into
``OUT/store.sqlite``, one rollout per problem. The solutions compute in text: the warm start teaches the
steps and the answer format, not the calculator calls (RL afterwards may). The held-out score stays the
generator's accuracy on the held-out templates.
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
from agent import example_messages  # noqa: E402
from calc_tool import calculator  # noqa: E402
from gsm_agent import SYSTEM_PROMPT  # noqa: E402


def calculator_tool() -> dict[str, Any]:
    """The calculator as the agent's AutoGen client offers it to the model (the same JSON, key for key)."""
    from autogen_core.tools import FunctionTool

    return {
        "type": "function",
        "function": dict(FunctionTool(calculator, description=calculator.__doc__ or "").schema),
    }


def solution_text(task: dict[str, Any]) -> str:
    """The worked solution with its ``#### N`` line as ``<answer>N</answer>``."""
    steps, _, _ = task["answer_cot"].rpartition("####")
    return f"{steps.strip()}\n<answer>{task['answer']}</answer>"


def example_turns() -> list[dict[str, str]]:
    """The earlier turns the agent starts from (``agent.example_messages``) as the chat messages its
    client sends them."""
    from autogen_core.models import UserMessage

    return [
        {"role": "user" if isinstance(m, UserMessage) else "assistant", "content": m.content}
        for m in example_messages()
    ]


def demonstration(task: dict[str, Any]) -> Demonstration:
    return Demonstration(
        id=f"gsm-gold:{task['id']}",
        messages=[
            {"role": "system", "content": SYSTEM_PROMPT},
            *example_turns(),
            {"role": "user", "content": task["question"]},
        ],
        response=solution_text(task),
        tools=[calculator_tool()],
        agent="gsm_agent",
        attributes={"gsm.task_id": task["id"]},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gsm_gold"), help="(runs/gsm_gold)")
    parser.add_argument("--tasks", type=Path, default=HERE / "gsm" / "train.jsonl", help="(gsm/train.jsonl)")
    args = parser.parse_args(argv)
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    held_out = set(json.loads((HERE / "gsm" / "split.json").read_text())["held_out_templates"])
    leaked = sorted({t["template"] for t in tasks} & held_out)
    if leaked:
        print(f"error: {args.tasks} holds problems of held-out templates {leaked}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    traces, store = args.out / "gold.jsonl", args.out / "store.sqlite"
    count = write_demonstrations(traces, map(demonstration, tasks), service="gsm-gold")
    summary = import_traces([traces], str(store))
    print(f"{count} worked solutions in {traces}; {summary.rollouts} rollouts in {store}")
    for problem in summary.problems:
        print(f"  skipped: {problem}", file=sys.stderr)
    return summary.exit_code


if __name__ == "__main__":
    sys.exit(main())
