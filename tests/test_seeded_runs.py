"""``train.seed`` makes a run repeat itself: two ``agl train`` runs of the same config on the tiny model,
whose rewards depend only on what the model sampled, draw the same tasks, sample the same responses, score
the same rewards and train the same update; another seed samples differently."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from ._training import metrics_rows, train_cli

#: The reward is read from the sampled reply alone: its length in characters, modulo 3, over 2.
AGENT = """
import openai

def solve(task, llm):
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    reply = client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=6, temperature=1.0
    )
    return (len(reply.choices[0].message.content or "") % 3) / 2
"""


def _run(folder: Path, seed: int) -> tuple[list[dict], Counter[tuple[int, ...]]]:
    """One run in ``folder``: its train rows and the multiset of the response token ids it sampled."""
    from agl_core import semconv
    from agl_core.store import SqliteStore

    folder.mkdir()
    (folder / "agent.py").write_text(AGENT)
    tasks = [{"id": f"t{i}", "q": f"count to {i}"} for i in range(8)]
    (folder / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    (folder / "config.yaml").write_text(
        f"agent: agent:solve\ntasks: tasks.jsonl\noutput_dir: {folder / 'run'}\n"
        "logging: {plot: false, tensorboard: false}\n"
        "model: {source: tiny, lora: {r: 4, alpha: 8}}\n"
        "runner: {workers: 4}\n"
        f"train: {{steps: 3, tasks_per_step: 2, rollouts_per_task: 4, seed: {seed}}}\n"
    )
    train_cli(folder / "config.yaml")
    store = SqliteStore(folder / "run" / "store.sqlite")
    try:
        spans = store.query_spans(limit=100_000)
    finally:
        store.close()
    responses = Counter(
        tuple(s.attributes[semconv.RESPONSE_TOKEN_IDS])
        for s in spans
        if semconv.RESPONSE_TOKEN_IDS in s.attributes
    )
    return metrics_rows(folder / "run", "train"), responses


def _what_trained(rows: list[dict]) -> list[tuple]:
    return [(r["tasks"], r["mean_reward"], r["trained_transitions"], r["tokens"]) for r in rows]


def test_a_seeded_run_repeats_itself_and_another_seed_does_not(tmp_path):
    rows, responses = _run(tmp_path / "first", seed=0)
    again_rows, again_responses = _run(tmp_path / "again", seed=0)
    other_rows, other_responses = _run(tmp_path / "other", seed=1)

    assert len(rows) == 3 and sum(responses.values()) == 3 * 2 * 4  # one call per rollout
    assert sum(r["trained_transitions"] for r in rows) > 0  # the rewards differed within some group
    assert again_responses == responses  # every step's samples, whatever order the workers asked in
    assert _what_trained(again_rows) == _what_trained(rows)
    for one, two in zip(rows, again_rows, strict=True):
        if one["loss"] is None:
            assert two["loss"] is None
        else:  # the same update, up to the order of a sum
            assert abs(one["loss"] - two["loss"]) <= 1e-5 and abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5
    assert other_responses != responses
