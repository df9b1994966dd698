"""The arithmetic LangChain example, reduced: trained end to end on the real SmolLM2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ._training import metrics_rows, train_cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_train_example_end_to_end_on_cpu(tmp_path):
    pytest.importorskip("langchain_openai")
    out = tmp_path / "run"
    done = train_cli(
        ROOT / "examples/arith_langchain/config.yaml",
        "--set",
        "train.steps=2",
        "--set",
        "train.tasks_per_step=2",
        "--set",
        "train.rollouts_per_task=4",
        "--set",
        f"output_dir={out}",
        "--set",
        "validation.max_tasks=4",
        timeout=900,
    )
    lines = [s for s in done.stdout.splitlines() if s.startswith("step ")]
    assert len(lines) == 2, done.stdout
    for line in lines:
        assert re.search(r"rollouts=8 .*transitions=\d+ .*mean_reward=[\d.]+ .*loss=", line), line

    rows = metrics_rows(out)
    metrics = [m for m in rows if m["kind"] == "train"]
    # the held-out split is scored before and after training, and the run ends saying so
    assert [(m["step"], m["n"]) for m in rows if m["kind"] == "val"] == [(0, 4), (2, 4)]
    assert "held-out reward: before" in done.stdout and (out / "reward_curve.png").is_file()
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["rollouts"] == 8 and m["transitions"] == 8 for m in metrics)
    # partial-credit rewards make ties unlikely: at least one real update happened and bumped the policy
    assert any(m["loss"] is not None for m in metrics), metrics
    assert metrics[-1]["policy_version"] >= 1

    from agl_core import semconv
    from agl_core.store import SqliteStore

    store = SqliteStore(out / "store.sqlite")  # the file the job left behind, read through the store API
    try:
        spans = store.query_spans(limit=100_000)
        stats = store.stats()
    finally:
        store.close()
    gateway_spans = [s for s in spans if s.attributes.get(semconv.SOURCE) == semconv.SOURCE_GATEWAY]
    assert len(gateway_spans) == 16 + 8 and stats["rollouts_succeeded"] == 16 + 8  # training + validation
    assert all(s.attributes[semconv.RESPONSE_TOKEN_IDS] for s in gateway_spans)
