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

The curriculum's first stage, for a model that solves almost none of these (SmolLM2-135M): reasoning-gym's
``basic_arithmetic`` generator at the difficulty ``ARITH_CONFIG`` sets (2 to 4 terms of 1 to 3 digits,
with parentheses and negation), scored by its own scorer. The generator seeds its n-th problem with
``seed + n``, so both files come from one seed (``TRAIN_SEED``): ``gsm/arith_train.jsonl`` the first
``ARITH_TRAIN_SIZE`` problems, ``gsm/arith_val.jsonl`` the next ``ARITH_VAL_SIZE`` whose expression is
not among the training ones. A problem whose stated answer is not its expression's value (the generator
rounds some divisions inside a negation to 0) is left out and named in ``gsm/split.json``. Each of these
tasks names its generator, whose scorer ``gsm_agent.score`` uses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from calc_tool import calculator  # noqa: E402  (this folder's: the value the agent's tool gives)

OUT = HERE / "gsm"
COMMAND = "python examples/calc_autogen/gsm_tasks.py"
GENERATOR = "gsm_symbolic"
TRAIN_SEED, VAL_SEED = 1, 2
TRAIN_SIZE, VAL_SIZE = 600, 200
#: Templates whose number is a multiple of this are held out.
HOLD_OUT_EVERY = 5
#: The curriculum's first stage: reasoning-gym's basic_arithmetic at this difficulty.
ARITH_GENERATOR = "basic_arithmetic"
ARITH_CONFIG: dict[str, Any] = {"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 3}
ARITH_TRAIN_SIZE, ARITH_VAL_SIZE = 400, 200


def _generator(seed: int, size: int, name: str = GENERATOR, **config: Any) -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise SystemExit(
            "error: reasoning-gym is not installed: pip install 'agl[gsm]' (reasoning-gym==0.1.25)"
        ) from None
    return reasoning_gym.create_dataset(name, seed=seed, size=size, **config)


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


def _arith_tasks(
    dataset: Any, start: int, count: int, seen: set[str], prefix: str, excluded: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    tasks: list[dict[str, Any]] = []
    for index in range(start, len(dataset)):
        entry = dataset[index]
        expression = entry["metadata"]["expression"]
        if expression in seen:
            continue
        seen.add(expression)
        value = calculator(expression)
        if value != entry["answer"]:
            excluded.append(
                {"index": index, "question": entry["question"], "answer": entry["answer"], "value": value}
            )
            continue
        tasks.append(
            {
                "id": f"{prefix}-{len(tasks):03d}",
                "question": entry["question"],
                "answer": entry["answer"],
                "generator": ARITH_GENERATOR,
                "seed": TRAIN_SEED,
                "index": index,
            }
        )
        if len(tasks) == count:
            return tasks
    raise SystemExit(f"error: {len(dataset)} draws of {ARITH_GENERATOR} gave only {len(tasks)} problems")


def build() -> dict[str, str]:
    """The three files' contents, from the generator."""
    from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import tasks_ok

    held_out = [t for t in tasks_ok if t % HOLD_OUT_EVERY == 0]
    seen: set[str] = set()
    train = _tasks(TRAIN_SEED, TRAIN_SIZE, lambda t: t not in held_out, seen, "gsm-train")
    val = _tasks(VAL_SEED, VAL_SIZE, lambda t: t in held_out, seen, "gsm-val")
    arith = _generator(TRAIN_SEED, 2 * (ARITH_TRAIN_SIZE + ARITH_VAL_SIZE), ARITH_GENERATOR, **ARITH_CONFIG)
    seen_expressions: set[str] = set()
    excluded: list[dict[str, Any]] = []
    arith_train = _arith_tasks(arith, 0, ARITH_TRAIN_SIZE, seen_expressions, "arith-train", excluded)
    start = arith_train[-1]["index"] + 1
    arith_val = _arith_tasks(arith, start, ARITH_VAL_SIZE, seen_expressions, "arith-val", excluded)
    split = {
        "generator": f"reasoning-gym==0.1.25 {GENERATOR}",
        "held_out_templates": held_out,
        "curriculum": {
            "generator": f"reasoning-gym==0.1.25 {ARITH_GENERATOR}",
            "config": ARITH_CONFIG,
            "seed": TRAIN_SEED,
            "excluded": excluded,
        },
    }

    def lines(tasks: list[dict[str, Any]]) -> str:
        return "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tasks)

    return {
        "split.json": json.dumps(split, indent=1) + "\n",
        "train.jsonl": lines(train),
        "val.jsonl": lines(val),
        "arith_train.jsonl": lines(arith_train),
        "arith_val.jsonl": lines(arith_val),
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
        print(f"gsm/{', gsm/'.join(files)} are what the generator gives")
        return 0
    OUT.mkdir(exist_ok=True)
    for name, text in files.items():
        (OUT / name).write_text(text)
    counts = {name: text.count("\n") for name, text in files.items() if name.endswith(".jsonl")}
    print(
        f"wrote {OUT}: {counts['train.jsonl']} training problems, {counts['val.jsonl']} held out;"
        f" curriculum ({ARITH_GENERATOR}): {counts['arith_train.jsonl']} and {counts['arith_val.jsonl']}"
    )
    for problem in json.loads(files["split.json"])["curriculum"]["excluded"]:
        print(
            f"excluded {ARITH_GENERATOR} #{problem['index']}: {problem['question']!r} states"
            f" {problem['answer']}, its value is {problem['value']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
