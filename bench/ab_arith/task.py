"""The single-call task of bench/learning_ab.py: reasoning-gym's basic_arithmetic problems (the calculator
example's first GSM stage, examples/calc_autogen/gsm/arith_*.jsonl) answered directly in one model call,
without a tool. Plain Python with no imports beyond the standard library: agl's agent (agent.py) and TRL's
reward function (in TRL's own environment) both use it, so both sides are scored by the same code.
"""

from __future__ import annotations

import re

SYSTEM = "You are a calculator. Reply with the result as a number and nothing else."
#: Sampling settings both trainers use: the temperature of training rollouts (held-out passes are greedy)
#: and the completion budget.
TEMPERATURE = 1.0
MAX_TOKENS = 16

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def messages(question: str) -> list[dict[str, str]]:
    """The chat messages of one problem: the system instruction and the question."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def parse(text: str) -> str | None:
    """The last number of the reply ("3 + 8 = 11" -> "11"), thousands separators dropped; ``None`` if none."""
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def correct(text: str, answer: str) -> bool:
    """Whether the reply's number is the expected answer (compared as numbers)."""
    got = parse(text)
    try:
        return got is not None and float(got) == float(answer)
    except ValueError:
        return False


def reward(text: str, answer: str) -> float:
    """The training reward: 1 for the right number, partial credit ``0.5 / (1 + |error|)`` for another
    number (so a group of samples rarely ties), 0 for a reply without one."""
    got = parse(text)
    if got is None:
        return 0.0
    if correct(text, answer):
        return 1.0
    try:
        return 0.5 / (1.0 + abs(float(got) - float(answer)))
    except ValueError:
        return 0.0
