"""bench/learning_ab.py's parts that decide its figures: the shared reward and accuracy of the single-call
task (bench/ab_arith/task.py, used by both trainers), the held-out set without problems seen in training,
the paired change, and the arguments it refuses (the training runs themselves are run by hand)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("learning_ab", ROOT / "bench" / "learning_ab.py")
task = _load("ab_arith_task", ROOT / "bench" / "ab_arith" / "task.py")


@pytest.mark.parametrize(
    ("reply", "answer", "right", "reward"),
    [
        ("82", "82", True, 1.0),
        ("The result is 1,234.", "1234", True, 1.0),
        ("3 + 8 = 11", "11", True, 1.0),
        ("-5", "-5", True, 1.0),
        ("80", "82", False, 0.5 / 3),
        ("eighty-two", "82", False, 0.0),
        ("", "82", False, 0.0),
        ("2.0", "2", True, 1.0),
    ],
)
def test_the_shared_scorer(reply, answer, right, reward):
    assert task.correct(reply, answer) is right
    assert task.reward(reply, answer) == pytest.approx(reward)


def test_the_held_out_set_leaves_out_questions_seen_in_training(tmp_path, monkeypatch):
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text(json.dumps({"id": "a", "question": "Calculate 2 - -1.", "answer": "3"}) + "\n")
    val.write_text(
        json.dumps({"id": "b", "question": "Calculate 2 - -1. ", "answer": "3"})
        + "\n"
        + json.dumps({"id": "c", "question": "Calculate 5 + 5.", "answer": "10"})
        + "\n"
    )
    monkeypatch.setattr(bench, "TRAIN", train)
    monkeypatch.setattr(bench, "VAL", val)
    path, dropped = bench.held_out(tmp_path)
    assert dropped == 1 and [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["c"]
    train.write_text(json.dumps({"id": "a", "question": "Calculate 9 + 9.", "answer": "18"}) + "\n")
    assert bench.held_out(tmp_path) == (val, 0)


def test_the_shipped_held_out_set_is_unseen():
    _, dropped = bench.held_out(ROOT / "runs")
    assert dropped == 0


def test_the_paired_change():
    before = {"a": 0.0, "b": 1.0, "c": 0.0, "d": 0.0}
    after = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0, "e": 1.0}  # e: not scored before, left out
    mean, change, se, n = bench.paired(before, after)
    assert (mean, change, n) == (0.75, 0.5, 4)
    assert se == pytest.approx(0.2886751, rel=1e-6)  # stdev([1, 0, 1, 0]) / 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--group", "1"], "--group must be at least 2"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--learning-rate", "2"], "--learning-rate must be in (0, 1)"),
        (["--agl-set", "algorithm.loss_norm"], "--agl-set algorithm.loss_norm: give KEY=VALUE"),
        (["--agl-label", "trl"], "not 'trl'"),
        (["--trl-python", "/nowhere/python"], "run bash bench/setup_trl_env.sh first"),
    ],
)
def test_bad_arguments_are_refused(flags, message):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "learning_ab.py"), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and message in done.stderr


def test_the_accuracy_agrees_with_reasoning_gyms_scorer_except_on_decimal_forms():
    """basic_arithmetic's own scorer (reasoning-gym's ``score_answer``) counts an answer right when the
    extracted string equals the expected one; the bench compares the last number as a number, so "82.0"
    counts as 82 there and not in reasoning-gym: the one class where they differ."""
    rg = pytest.importorskip("reasoning_gym")
    dataset = rg.create_dataset("basic_arithmetic", size=1, seed=0)
    val = [json.loads(line) for line in bench.VAL.read_text().splitlines()]
    disagree: dict[str, int] = {}
    for entry in val:
        answer = entry["answer"]
        forms = {
            "plain": answer,
            "sentence": f"The result is {answer}.",
            "equation": f"{entry['question'].removeprefix('Calculate ').rstrip('.')} = {answer}",
            "off by one": str(int(answer) + 1),
            "negated": str(-int(answer)) if int(answer) != 0 else "1",
            "decimal": f"{answer}.0",
            "no number": "I cannot tell.",
        }
        for kind, reply in forms.items():
            extracted = task.parse(reply)
            official = dataset.score_answer(extracted, {"answer": answer}) == 1.0
            if task.correct(reply, answer) != official:
                disagree[kind] = disagree.get(kind, 0) + 1
    assert disagree == {"decimal": len(val)}
