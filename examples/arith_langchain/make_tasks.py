"""Writes tasks.jsonl: single-digit additions, deterministic (seeded)."""

import json
import random
from pathlib import Path

rng = random.Random(7)
pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
rng.shuffle(pairs)
with (Path(__file__).parent / "tasks.jsonl").open("w") as fh:
    for i, (a, b) in enumerate(pairs):
        fh.write(
            json.dumps({"id": f"add-{i:03d}", "question": f"What is {a} + {b}?", "answer": a + b}) + "\n"
        )
