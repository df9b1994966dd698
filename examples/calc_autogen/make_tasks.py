"""Writes train.jsonl, dev.jsonl and val.jsonl: arithmetic word problems with integer answers.

Deterministic (seeded) and disjoint: no two problems share the same operation and numbers, so no split
holds a rewording of another split's problem. ``dev`` is for choosing settings, ``val`` only for the final
before/after numbers.

Difficulty (``--difficulty``):

1. one addition or subtraction, numbers 2..20;
2. one addition or subtraction with numbers 12..99, or a multiplication / exact division with a factor
   2..12 and the other factor 3..25 (what a small model cannot do reliably in its head);
3. two operations (``a + b - c``, ``a * b + c``, ``(a + b) * c``), numbers as in 2.

Each line: ``{"id", "question", "answer", "expression", "difficulty"}``; ``expression`` is a reference
expression for the answer (the agent never sees it).

    python make_tasks.py                       # the committed files (difficulty 2, seed 7)
    python make_tasks.py --difficulty 1 --out /tmp/easy
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ["Sam", "Maria", "Leo", "Aisha", "Tom", "Nina", "Omar", "Lena", "Ravi", "Kate", "Jon", "Mei"]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cards", "shells", "stamps", "cookies"]
CONTAINERS = ["boxes", "bags", "jars", "baskets", "shelves", "packs"]

# Each template: (question format, how to compute the answer from a and b, reference expression format).
ADD = [
    "{n} has {a} {item}. {p} gets {b} more. How many {item} does {n} have now?",
    "There are {a} {item} in one box and {b} {item} in another box. How many {item} are there altogether?",
    "{n} collected {a} {item} on Monday and {b} {item} on Tuesday. How many {item} did {n} collect in total?",
]
SUB = [
    "{n} has {a} {item} and gives {b} of them away. How many {item} does {n} have left?",
    "A shop had {a} {item}. It sold {b} {item}. How many {item} does the shop have now?",
    "{n} needs {a} {item} and already has {b}. How many more {item} does {n} need?",
]
MUL = [
    "There are {a} {container} with {b} {item} in each. How many {item} are there in total?",
    "{n} buys {a} packs of {item}. Each pack holds {b} {item}. How many {item} does {n} buy?",
    "Each of {a} children has {b} {item}. How many {item} do the children have together?",
]
DIV = [
    "{n} shares {c} {item} equally among {a} friends. How many {item} does each friend get?",
    "{c} {item} are packed into {container} of {a}. How many {container} are filled?",
    "{n} puts {c} {item} into {a} equal piles. How many {item} are in each pile?",
]
TWO_STEP = [
    (
        "{n} has {a} {item}, buys {b} more and then gives {c} away. How many {item} does {n} have now?",
        lambda a, b, c: a + b - c,
        "{a} + {b} - {c}",
    ),
    (
        "There are {a} {container} with {b} {item} each, and {c} loose {item}. "
        "How many {item} are there in total?",
        lambda a, b, c: a * b + c,
        "{a} * {b} + {c}",
    ),
    (
        "{n} has {a} {item} and {p_lower} friend has {b}. They put them in one pile and triple it. "
        "How many {item} are in the pile?",
        lambda a, b, c: (a + b) * 3,
        "({a} + {b}) * 3",
    ),
]


def _words(rng: random.Random) -> dict[str, str]:
    name = rng.choice(NAMES)
    pronoun = "She" if name in {"Maria", "Aisha", "Nina", "Lena", "Kate", "Mei"} else "He"
    return {
        "n": name,
        "p": pronoun,
        "p_lower": "her" if pronoun == "She" else "his",
        "item": rng.choice(ITEMS),
        "container": rng.choice(CONTAINERS),
    }


def _one_step(rng: random.Random, difficulty: int) -> tuple[tuple, str, int, str]:
    """(key, question, answer, expression) of a one-operation problem."""
    ops = ["add", "sub"] if difficulty == 1 else ["add", "sub", "mul", "div"]
    op = rng.choice(ops)
    lo, hi = (2, 20) if difficulty == 1 else (12, 99)
    w = _words(rng)
    if op == "add":
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        return (op, a, b), rng.choice(ADD).format(a=a, b=b, **w), a + b, f"{a} + {b}"
    if op == "sub":
        a, b = sorted((rng.randint(lo, hi), rng.randint(lo, hi)), reverse=True)
        if a == b:
            a += 1
        return (op, a, b), rng.choice(SUB).format(a=a, b=b, **w), a - b, f"{a} - {b}"
    a, b = rng.randint(2, 12), rng.randint(3, 25)
    if op == "mul":
        return (op, a, b), rng.choice(MUL).format(a=a, b=b, **w), a * b, f"{a} * {b}"
    c = a * b
    return (op, c, a), rng.choice(DIV).format(a=a, c=c, **w), b, f"{c} / {a}"


def _two_step(rng: random.Random) -> tuple[tuple, str, int, str]:
    question, answer_of, expression = rng.choice(TWO_STEP)
    a, b = rng.randint(3, 30), rng.randint(3, 30)
    c = rng.randint(2, a + b - 1) if "- {c}" in expression else rng.randint(2, 30)
    if "* {b}" in expression:
        a, b = rng.randint(2, 12), rng.randint(3, 25)
    w = _words(rng)
    return (
        (expression, a, b, c),
        question.format(a=a, b=b, c=c, **w),
        answer_of(a, b, c),
        expression.format(a=a, b=b, c=c),
    )


def make_problems(count: int, *, difficulty: int, seed: int) -> list[dict]:
    """``count`` distinct problems (by operation and numbers) of the given difficulty, in a seeded order."""
    if difficulty not in (1, 2, 3):
        raise ValueError(f"difficulty must be 1, 2 or 3, got {difficulty}")
    rng = random.Random(seed)
    make: Callable[[], tuple[tuple, str, int, str]] = (
        (lambda: _two_step(rng)) if difficulty == 3 else (lambda: _one_step(rng, difficulty))
    )
    seen: set[tuple] = set()
    problems: list[dict] = []
    tries = 0
    while len(problems) < count:
        tries += 1
        if tries > 100 * count:
            raise ValueError(f"difficulty {difficulty} has too few distinct problems for {count}")
        key, question, answer, expression = make()
        if key in seen:
            continue
        seen.add(key)
        problems.append(
            {"question": question, "answer": answer, "expression": expression, "difficulty": difficulty}
        )
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--difficulty", type=int, choices=(1, 2, 3), default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--train", type=int, default=200, help="problems in train.jsonl")
    parser.add_argument("--dev", type=int, default=60, help="problems in dev.jsonl (for choosing settings)")
    parser.add_argument("--val", type=int, default=100, help="problems in val.jsonl (held out)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent, help="directory to write to")
    args = parser.parse_args()
    problems = make_problems(args.train + args.dev + args.val, difficulty=args.difficulty, seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    start = 0
    for split, size in (("train", args.train), ("dev", args.dev), ("val", args.val)):
        with (args.out / f"{split}.jsonl").open("w") as fh:
            for i, problem in enumerate(problems[start : start + size]):
                fh.write(json.dumps({"id": f"{split}-{i:03d}", **problem}) + "\n")
        start += size
        print(f"{args.out / f'{split}.jsonl'}: {size} problems")


if __name__ == "__main__":
    main()
