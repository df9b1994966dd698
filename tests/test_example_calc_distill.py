"""examples/calc_autogen/distill.py: the AutoGen calculator agent in production behind a capturing gateway
(the real SmolLM2 through the hf backend), its spans in an OTLP JSON-lines file, imported into a fresh
store, rated late by the application's checks, and fine-tuned on with ``algorithm: sft``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agl_core.cli import main as agl
from agl_core.importer import session_rollout_id
from agl_core.pipeline.spantree import kind_of
from agl_core.pipeline.transitions import spans_to_transitions
from agl_core.store import SqliteStore

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "calc_autogen"

pytest.importorskip("autogen_agentchat")


def _distill() -> Any:
    spec = importlib.util.spec_from_file_location("_calc_distill_example", EXAMPLE / "distill.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, list[str]]:
    # as a user runs it: its own process, whose global tracer provider and instrumentation are its own
    out = tmp_path_factory.mktemp("distill")
    args = ["--teacher", "base", "--limit", "3", "--samples", "2", "--out", str(out), "--threads", "2"]
    done = subprocess.run(
        [sys.executable, str(EXAMPLE / "distill.py"), *args], capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _distill(), out, done.stdout.splitlines()


def _feedback(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "feedback.jsonl").read_text().splitlines()]


def test_every_episode_is_one_rollout_joining_the_agents_spans_and_the_gateways_call(run):
    _, out, printed = run
    feedback = _feedback(out)
    sessions = [f["session_id"] for f in feedback]
    assert sessions == [f"calc-train-00{i}-{n}" for i in range(3) for n in range(2)]
    store = SqliteStore(str(out / "store.sqlite"))
    try:
        spans = store.query_spans(limit=100_000)
        records = {r.rollout_id: r for r in store.get_rollouts([session_rollout_id(s) for s in sessions])}
    finally:
        store.close()
    assert set(records) == {session_rollout_id(s) for s in sessions}
    assert all(r.metadata.get("source") == "import" for r in records.values())
    by_rollout: dict[str, list[Any]] = {}
    for span in spans:
        by_rollout.setdefault(str(span.rollout_id), []).append(span)
    assert set(by_rollout) == set(records)  # nothing in the file fell outside a session
    for rid, own in by_rollout.items():
        kinds = sorted(kind_of(s) for s in own)
        # the agent's episode, its AutoGen agent turn, its model call, the gateway's call, the late reward
        assert kinds.count("gateway") == 1, (rid, kinds)
        assert kinds.count("llm") == 1, (rid, kinds)
    result = spans_to_transitions(spans)
    assert not result.problems, result.problems
    rewards = {session_rollout_id(f["session_id"]): f["reward"] for f in feedback}
    assert {t.rollout_id: t.reward for t in result.transitions} == rewards
    assert all(t.agent_name == "calculator_agent" and t.response_ids for t in result.transitions)
    assert len(result.joins) == len(sessions)  # each AutoGen call joined its gateway call
    assert any("6 rewards attached (0 already stored)" in line for line in printed)
    assert any("the same feedback again: 0 new, 6 already stored" in line for line in printed)


def test_rating_again_stores_nothing_twice(run):
    module, out, _ = run
    assert module.rate(out / "store.sqlite", _feedback(out)) == (0, 6)


def test_sft_trains_the_base_model_on_the_imported_calls(run, capsys):
    _, out, _ = run
    code = agl(
        [
            "train",
            str(EXAMPLE / "config.sft.yaml"),
            "--overwrite",
            "--set",
            f"traces.store={out / 'store.sqlite'}",
            "--set",
            "traces.filter.reward_min=0",  # every episode, right or wrong: the sampled answers vary
            "--set",
            "traces.epochs=1",
            "--set",
            f"output_dir={out / 'sft'}",
            "--set",
            "validation.before=false",
            "--set",
            "validation.after=false",
        ]
    )
    assert code == 0, capsys.readouterr()
    rows = [json.loads(line) for line in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[0]["trained_transitions"] == 6
    assert rows[0]["exact_transitions"] == 6 and rows[0]["retokenised_transitions"] == 0
    assert list((out / "sft" / "checkpoints").glob("step-*/adapter/adapter_config.json"))


def test_a_missing_teacher_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="neither a LoRA adapter directory"):
        _distill().find_adapter(str(tmp_path))
