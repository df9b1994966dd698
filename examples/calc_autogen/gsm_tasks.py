"""GSM-style math problems for the calculator agent, from reasoning-gym's ``gsm_symbolic`` generator.

    python examples/calc_autogen/gsm_tasks.py [--check]

``gsm_symbolic`` (reasoning-gym 0.1.25, Apache-2.0; ``pip install 'agl[gsm]'``) instantiates templates
made from GSM8K problems with new names and numbers, and scores an answer with its own scorer (1 for the
right number, 0.01 for another number, 0 for none). This writes the calculator agent's GSM tasks next to
this file, in ``gsm/``:

- the split is by template, fixed in ``gsm/split.json``: every fifth of the generator's templates (by
  their number) is held out, so the held-out problems come from GSM8K problems never trained on, not only
  from new numbers in familiar ones;
- ``gsm/train.jsonl``: the problems of the generator seeded with ``TRAIN_SEED`` whose template is not
  held out, the first ``TRAIN_SIZE``; ``gsm/val.jsonl``: those of ``VAL_SEED`` whose template is held out,
  the first ``VAL_SIZE``. A problem whose question is already in the training set is skipped.

Each task keeps the question as the generator words it, the answer, the template's number, the worked
solution (``answer_cot``, ending ``#### answer``) and where it came from (seed, index), so another run of
this command rebuilds the same files; ``--check`` says whether the committed ones are that.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "gsm"
COMMAND = "python examples/calc_autogen/gsm_tasks.py"
GENERATOR = "gsm_symbolic"
TRAIN_SEED, VAL_SEED = 1, 2
TRAIN_SIZE, VAL_SIZE = 600, 200
#: Templates whose number is a multiple of this are held out.
HOLD_OUT_EVERY = 5


def _generator(seed: int, size: int) -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise SystemExit(
            "error: reasoning-gym is not installed: pip install 'agl[gsm]' (reasoning-gym==0.1.25)"
        ) from None
    return reasoning_gym.create_dataset(GENERATOR, seed=seed, size=size)


def _tasks(seed: int, count: int, keep: Any, seen: set[str], prefix: str) -> list[dict[str, Any]]:
    tasks: list[dict[str, Any]] = []
    size = count * 8  # enough draws for `count` problems of the kept templates
    dataset = _generator(seed, size)
    for index in range(size):
        template = dataset.task_indices[index]
        if not keep(template):
            continue
        entry = dataset[index]
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        tasks.append(
            {
                "id": f"{prefix}-{len(tasks):03d}",
                "question": entry["question"],
                "answer": entry["answer"],
                "template": template,
                "answer_cot": entry["metadata"]["answer_cot"],
                "seed": seed,
                "index": index,
            }
        )
        if len(tasks) == count:
            return tasks
    raise SystemExit(f"error: {size} draws of seed {seed} gave only {len(tasks)} problems")


def build() -> dict[str, str]:
    """The three files' contents, from the generator."""
    from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import tasks_ok

    held_out = [t for t in tasks_ok if t % HOLD_OUT_EVERY == 0]
    seen: set[str] = set()
    train = _tasks(TRAIN_SEED, TRAIN_SIZE, lambda t: t not in held_out, seen, "gsm-train")
    val = _tasks(VAL_SEED, VAL_SIZE, lambda t: t in held_out, seen, "gsm-val")
    split = {"generator": f"reasoning-gym==0.1.25 {GENERATOR}", "held_out_templates": held_out}

    def lines(tasks: list[dict[str, Any]]) -> str:
        return "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tasks)

    return {
        "split.json": json.dumps(split, indent=1) + "\n",
        "train.jsonl": lines(train),
        "val.jsonl": lines(val),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="compare the committed files with the generator's"
    )
    args = parser.parse_args(argv)
    files = build()
    if args.check:
        stale = [
            name
            for name, text in files.items()
            if not (OUT / name).exists() or (OUT / name).read_text() != text
        ]
        if stale:
            print(
                f"error: gsm/{', gsm/'.join(stale)} differ from the generator's; run {COMMAND}",
                file=sys.stderr,
            )
            return 1
        print("gsm/split.json, gsm/train.jsonl and gsm/val.jsonl are what the generator gives")
        return 0
    OUT.mkdir(exist_ok=True)
    for name, text in files.items():
        (OUT / name).write_text(text)
    counts = {name: text.count("\n") for name, text in files.items() if name.endswith(".jsonl")}
    print(f"wrote {OUT}: {counts['train.jsonl']} training problems, {counts['val.jsonl']} held out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
