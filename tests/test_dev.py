"""A dev run (``Trainer.dev``, ``agl dev``) on the real pipeline with the tiny model: each rollout goes
through the store, the gateway and the runner, its spans become transitions and credit, nothing is
trained, and the report names, per rollout, what it gave and why it would not train."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import openai

from agl_core.pipeline.transitions import NO_LLM_CALL
from agl_core.records import RolloutStatus
from agl_trainer import DevResult, Trainer

CONFIG: dict[str, Any] = {
    "model": {"source": "tiny", "lora": None},
    "gateway": {"default_max_tokens": 4},
    "runner": {"workers": 1},
}
#: What the agent does, by task: call the model, answer without calling it, fail.
TASKS = [{"id": "calls", "q": "say 1"}, {"id": "quiet"}, {"id": "broken"}]

AGENT = """
import openai


def solve(task, llm):
    if task["id"] == "broken":
        raise ValueError("no answer for " + task["id"])
    if task["id"] == "quiet":
        return 0.5  # answered without the model: nothing to train
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=4
    )
    return 1.0
"""


def _rollout_line(line: str) -> bool:
    return re.match(r"rollout ro-\w+ \(task \w+\): ", line) is not None


def test_dev_reports_each_rollout_and_why_it_would_not_train(tmp_path):
    def solve(task, llm):  # as AGENT's, but local: no process could import it by name
        if task["id"] == "broken":
            raise ValueError("no answer for " + task["id"])
        if task["id"] == "quiet":
            return 0.5
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
        client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=4
        )
        return 1.0

    lines: list[str] = []
    trainer = Trainer({**CONFIG, "output_dir": str(tmp_path / "run")}, echo=lines.append)
    result = trainer.dev(solve, TASKS, n=4, store=tmp_path / "dev.sqlite")

    assert isinstance(result, DevResult) and result.store == str(tmp_path / "dev.sqlite")
    assert [r.task_id for r in result.rollouts] == ["calls", "quiet", "broken", "calls"]  # in task order
    calls, quiet, broken, again = result.rollouts
    for r in (calls, again):
        assert (r.status, r.reward, r.llm_calls, r.transitions, r.trained, r.reasons) == (
            RolloutStatus.SUCCEEDED,
            1.0,
            1,
            1,
            1,
            (),
        )
    assert (quiet.status, quiet.reward, quiet.llm_calls, quiet.trained) == (
        RolloutStatus.SUCCEEDED,
        0.5,
        0,
        0,
    )
    assert quiet.reasons == (NO_LLM_CALL,)
    assert (broken.status, broken.reward, broken.trained) == (RolloutStatus.FAILED, None, 0)
    assert broken.reasons == ("rollout failed: ValueError: no answer for broken",)
    assert result.trainable == 2

    report = lines[lines.index(next(line for line in lines if _rollout_line(line))) :]
    assert [line for line in report if _rollout_line(line)] == [
        f"rollout {r.rollout_id} (task {r.task_id}): {r.status.value}  reward={reward}"
        f"  llm_calls={r.llm_calls}  transitions={r.transitions}  trained={r.trained}"
        for r, reward in zip(result.rollouts, ["1.000", "0.500", "-", "1.000"], strict=True)
    ]
    assert f"  not trained: {NO_LLM_CALL}" in report
    assert "  not trained: rollout failed: ValueError: no answer for broken" in report
    assert "2 of 4 rollouts would train (2 transitions); no update was made" in report
    assert (
        report[-1]
        == f"span tree and transitions: agl inspect {quiet.rollout_id} --store {tmp_path / 'dev.sqlite'}"
    )
    assert not (tmp_path / "run").exists()  # no update, no checkpoint, no metrics


def test_agl_dev_runs_the_configs_agent_from_the_command_line(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "tasks.jsonl").write_text('{"id": "calls", "q": "say 1"}\n')
    (tmp_path / "dev.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS[:2]))
    (tmp_path / "config.yaml").write_text(
        f"agent: agent:solve\ntasks: tasks.jsonl\noutput_dir: {tmp_path / 'run'}\n"
        "model: {source: tiny, lora: null}\ngateway: {default_max_tokens: 4}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "agl_core.cli", "dev", "config.yaml", "--tasks", "dev.jsonl", "-n", "2"]
        + ["--set", "runner.workers=1"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert re.fullmatch(
        r"rollout ro-\w+ \(task calls\): succeeded  reward=1\.000  llm_calls=1  transitions=1  trained=1",
        lines[0],
    ), lines
    assert re.fullmatch(
        r"rollout ro-\w+ \(task quiet\): succeeded  reward=0\.500  llm_calls=0  transitions=0  trained=0",
        lines[1],
    ), lines
    assert lines[2:] == [
        f"  not trained: {NO_LLM_CALL}",
        "1 of 2 rollouts would train (1 transition); no update was made",
        "the rollouts were in a temporary store; to keep them for agl inspect, pass --store FILE"
        " (store=FILE from Python)",
    ]
    assert "runner: 1 worker(s) in thread mode" in done.stderr  # progress on stderr, the report on stdout
    assert not (tmp_path / "run").exists()


def test_agl_dev_refuses_a_bad_config_in_one_line(tmp_path):
    (tmp_path / "config.yaml").write_text("agent: agent:solve\ntrain: {steps: 1}\n")
    done = subprocess.run(
        [sys.executable, "-m", "agl_core.cli", "dev", "config.yaml", "--set", "train.stpes=2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert "agl dev: invalid trainer config:" in done.stderr
    assert "config.yaml: missing required key 'tasks'" in done.stderr
    assert "--set train.stpes=2: unknown key 'train.stpes' (did you mean 'train.steps'?)" in done.stderr
