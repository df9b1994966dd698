"""The example's reward: token-level answer F1 against the gold answer plus a small format term.

``reward = 0.9 * F1 + 0.1 * formatted``, in [0, 1]:

- ``formatted`` is 1 when the reply's first non-empty line is ``Answer: <something>`` (the format the
  agent's instructions ask for), else 0;
- ``F1`` compares the predicted answer with the gold one word by word (SQuAD-style: lower-cased,
  punctuation and the articles a / an / the dropped, then the harmonic mean of precision and recall
  over the multiset of words). The predicted answer is the text after ``Answer:`` on that line when the
  reply is formatted, else the whole reply, so an unformatted reply still earns partial credit.

A reply that is the gold answer in the requested format scores 1.0; "Answer: Mara Voss was born in
Quillfield" against "Quillfield" scores 0.9 * 2/7 + 0.1 ≈ 0.357.
"""

from __future__ import annotations

import re
import string
from collections import Counter

F1_WEIGHT, FORMAT_WEIGHT = 0.9, 0.1
# "Answer: X", also in markdown bold ("**Answer:** X", "**Answer**: X")
_ANSWER = re.compile(r"^\s*\**\s*answer\s*\**\s*:\s*\**\s*(.*\S)", re.IGNORECASE)
_ARTICLES = {"a", "an", "the"}
_PUNCT = str.maketrans({c: " " for c in string.punctuation})


def normalize(text: str) -> list[str]:
    """Words of ``text`` for comparison: lower case, no punctuation, no articles."""
    return [w for w in text.lower().translate(_PUNCT).split() if w not in _ARTICLES]


def f1(predicted: str, gold: str) -> float:
    """Word-level F1 of ``predicted`` against ``gold`` (1.0 when both are empty after normalising)."""
    p, g = normalize(predicted), normalize(gold)
    if not p or not g:
        return float(p == g)
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def extract_answer(reply: str) -> tuple[str, bool]:
    """``(answer, formatted)``: the text after ``Answer:`` on the first non-empty line when it is there,
    else the whole reply and ``False``."""
    first = next((line for line in reply.splitlines() if line.strip()), "")
    match = _ANSWER.match(first)
    if match:
        return match.group(1).strip(), True
    return reply.strip(), False


def score(reply: str, gold: str) -> float:
    """The reward of ``reply`` for a question whose answer is ``gold``, in [0, 1]."""
    answer, formatted = extract_answer(reply)
    return F1_WEIGHT * f1(answer, gold) + FORMAT_WEIGHT * float(formatted)
