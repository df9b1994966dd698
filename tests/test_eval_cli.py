"""``agl eval`` on the tiny model: it scores the checkpoint of a one-step ``agl train`` and the base model
exactly as the run's own validation did, prints the same before/after line, a per-field table and a JSONL
file, and turns bad input into a one-line error with exit status 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ._training import metrics_rows, train_cli

AGENT = """
import openai

def solve(task, llm):
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    out = client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=4,
        temperature=0.0 if llm.evaluating else 1.0)
    return float(len(out.choices[0].message.content or "") % 3) / 2
"""

# one worker: the backend never batches two calls, so greedy replies repeat exactly from run to run
CONFIG = """
agent: agent:solve
tasks: {train: tasks.jsonl, val_fraction: 0.4}
output_dir: run
model: {source: tiny, lora: {r: 4, alpha: 8}}
gateway: {default_max_tokens: 4}
runner: {workers: 1}
algorithm: {learning_rate: 0.05}
train: {steps: 1, tasks_per_step: 3, rollouts_per_task: 3}
logging: {plot: false, tensorboard: false, progress: plain}
"""


def _eval(job: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agl_core.cli", "eval", str(job / "config.yaml"), *args],
        capture_output=True,
        text=True,
        cwd=job,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A job directory after a one-step ``agl train`` (run from it), and that run's output."""
    job = tmp_path_factory.mktemp("eval_job")
    (job / "agent.py").write_text(AGENT)
    (job / "tasks.jsonl").write_text(
        "".join(json.dumps({"id": f"t{i}", "q": f"say {i}", "op": "+-*"[i % 3]}) + "\n" for i in range(15))
    )
    (job / "config.yaml").write_text(CONFIG.replace("output_dir: run", f"output_dir: {job / 'run'}"))
    done = train_cli(job / "config.yaml")
    return job, done.stdout


def test_eval_scores_a_checkpoint_and_the_base_model_as_training_validated_them(job):
    job, train_out = job
    done = _eval(job, "--checkpoint", "run", "--baseline", "--per-field", "op", "--output", "scores.jsonl")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    score = r"\d\.\d{3} ± \d\.\d{3} \(SE, n=6 tasks\)"
    assert re.fullmatch(rf"tiny \(base model\): {score}", lines[0]), lines
    checkpoint = job / "run" / "checkpoints" / "step-000001"
    assert re.fullmatch(
        rf"{re.escape(str(Path('run/checkpoints/step-000001')))} \(policy v1\): {score}", lines[1]
    )
    # the same policies on the same tasks, decoded greedily: the run's own before/after line, to the digit
    (held_out,) = [line for line in train_out.splitlines() if line.startswith("held-out reward:")]
    assert lines[2] == held_out

    # the per-task scores are those of the run's validation rows
    before, after = metrics_rows(job / "run", "val")
    rows = [json.loads(line) for line in (job / "scores.jsonl").read_text().splitlines()]
    assert {r["task_id"]: r["score"] for r in rows} == after["task_scores"]
    assert {r["task_id"]: r["baseline_score"] for r in rows} == before["task_scores"]
    assert all(r["statuses"] == ["succeeded"] and len(r["rewards"]) == 1 for r in rows)
    assert all(r["input"]["id"] == r["task_id"] for r in rows)
    assert lines[-1] == "per-task scores: scores.jsonl"

    # the table: one row per op value, its tasks, and each policy's mean
    table = lines[3:-1]
    assert table[0].split() == ["op", "tasks", "score", "baseline", "change"]
    by_op: dict[str, list[str]] = {}
    for r in rows:
        by_op.setdefault(r["input"]["op"], []).append(r["task_id"])
    assert [line.split()[:2] for line in table[1:]] == [[op, str(len(by_op[op]))] for op in sorted(by_op)]
    for line in table[1:]:
        op = line.split()[0]
        mean = sum(after["task_scores"][t] for t in by_op[op]) / len(by_op[op])
        assert line.split()[2] == f"{mean:.3f}"
    assert checkpoint.is_dir()


def test_eval_of_the_base_model_on_a_task_file(job):
    job, _ = job
    done = _eval(job, "--tasks", "tasks.jsonl", "--limit", "3", "--samples", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.fullmatch(r"tiny \(base model\): \d\.\d{3} ± \d\.\d{3} \(SE, n=3 tasks\)", done.stdout.strip())
    assert "gateway: http://127.0.0.1:" in done.stderr  # progress goes to stderr, results to stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--checkpoint", "no-such-dir"], "agl eval: checkpoint no-such-dir is not a directory"),
        (["--checkpoint", "."], "agl eval: . holds no checkpoint: pass a checkpoint directory"),
        (["--tasks", "broken.jsonl"], "agl eval: broken.jsonl:2: not valid JSON"),
        (["--per-field", "kind"], "agl eval: no task has a field 'kind'; the tasks' fields are: id, op, q"),
        (
            ["--baseline"],
            "agl eval: a baseline is compared with a checkpoint or a prompt; pass --checkpoint DIR",
        ),
        (["--prompt", "no-such.json"], "agl eval: --prompt no-such.json: cannot read it as JSON"),
        (["--prompt", "broken.jsonl"], "agl eval: --prompt broken.jsonl: cannot read it as JSON"),
        (["--prompt", "bad_prompt.json"], "agl eval: --prompt bad_prompt.json (item 1): mode must be"),
        (["--set", "train.stepz=1"], "agl eval: invalid trainer config:"),
        (["--limit", "0"], "agl eval: limit must be at least 1, got 0"),
        (["--limit", "-1"], "agl eval: limit must be at least 1, got -1"),
        (["--samples", "0"], "agl eval: samples must be at least 1, got 0"),
        (
            ["--output", "no/such/dir/s.jsonl"],
            "agl eval: --output no/such/dir/s.jsonl: the folder no/such/dir does not exist",
        ),
    ],
)
def test_bad_input_is_a_one_line_error(job, args, message):
    job, _ = job
    (job / "broken.jsonl").write_text('{"id": "a"}\n{"id": \n')
    (job / "bad_prompt.json").write_text(
        '[{"version": 1, "system": "x"}, {"version": 2, "system": "y", "mode": "z"}]'
    )
    done = _eval(job, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(message), done.stderr
    if not args[0] == "--set":  # a config error lists every bad key, one per line, as agl train's does
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout == ""


def test_a_prompt_is_scored_against_the_same_model_without_it(job):
    from agl_core import semconv
    from agl_core.store import SqliteStore

    job, _ = job
    (job / "prompt.json").write_text(json.dumps({"version": 4, "agent": None, "system": "Say a number."}))
    done = _eval(job, "--prompt", "prompt.json", "--baseline", "--limit", "3", "--store", "kept.sqlite")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("tiny (base model): ")
    assert lines[1].startswith("tiny (base model) with prompt v4 (every agent): ")
    assert "paired SE over 3 tasks" in lines[2]
    store = SqliteStore(job / "kept.sqlite")
    try:
        calls = [s for s in store.query_spans(limit=10_000) if semconv.POLICY_VERSION in s.attributes]
    finally:
        store.close()
    prompted = [s for s in calls if s.attributes.get(semconv.PROMPT_VERSION) == 4]
    assert len(calls) == 6 and len(prompted) == 3  # the baseline's 3 calls without it, the scored 3 with it
    assert all(s.attributes[semconv.PROMPT_SCOPE] == "*" for s in prompted)


def test_an_unknown_split_is_refused_with_the_choices(job):
    job, _ = job
    done = _eval(job, "--split", "test")
    assert done.returncode == 2
    (line,) = [x for x in done.stderr.splitlines() if "argument --split: invalid choice: 'test'" in x]
    assert "val" in line and "train" in line, done.stderr  # the choices, quoted or not by the Python version
