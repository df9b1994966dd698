"""What a new user running an unseen agent through ``agl train`` meets: every rollout failing, tracing
set up inside the agent, the failure shown by its root cause, and the tools to look at a failed rollout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ._training import metrics_rows, train_cli

FAILING_AGENT = """
import openai

def solve(task, llm):
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    try:
        try:
            # a model name the gateway does not serve: the gateway answers 404 model_not_found
            client.chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": task["q"]}], max_tokens=4
            )
        except openai.NotFoundError as exc:
            exc.add_note("During task with name 'planner' and id 'abc'")  # what LangGraph adds
            raise
    except Exception as exc:
        raise RuntimeError("graph run failed") from exc  # a framework's wrapper
"""

TRACING_AGENT = """
import random

import openai
from opentelemetry import trace

import agl_core

def solve(task, llm):
    agl_core.setup_tracing()  # inside the agent function, as users write it
    with trace.get_tracer("user").start_as_current_span("user.step"):
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
        client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=4
        )
    return random.random()
"""


def _job(tmp_path: Path, agent: str, tasks: int = 3) -> Path:
    (tmp_path / "agent.py").write_text(agent)
    (tmp_path / "tasks.jsonl").write_text(
        "".join(json.dumps({"id": f"t{i}", "q": "ab" * i}) + "\n" for i in range(tasks))
    )
    (tmp_path / "config.yaml").write_text(
        f"agent: agent:solve\ntasks: tasks.jsonl\noutput_dir: {tmp_path / 'run'}\n"
        "logging: {plot: false, tensorboard: false}\nmodel: {source: tiny, lora: null}\n"
        "gateway: {default_max_tokens: 4}\nvalidation: {before: false, after: false}\n"
        "train: {steps: 2, tasks_per_step: 3, rollouts_per_task: 2}\n"
    )
    return tmp_path / "config.yaml"


def _agl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agl_core.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_a_run_where_every_rollout_fails_exits_1_and_says_why(tmp_path):
    done = train_cli(_job(tmp_path, FAILING_AGENT), returncode=1)
    out = tmp_path / "run"
    # the one-line summary names the root cause, not the wrapper or the framework's note
    failed_lines = [
        line
        for line in done.stdout.splitlines()
        if line.strip().startswith("rollout ") and " failed: " in line
    ]
    assert failed_lines, done.stdout[-2000:]
    assert all("NotFoundError" in line and "does not exist here" in line for line in failed_lines), (
        failed_lines
    )
    assert not any("During task" in line or "RuntimeError" in line for line in failed_lines)
    assert "warning: step 1 trained nothing: all 6 rollouts failed" in done.stdout
    assert "no step trained: all 6 rollouts failed; first error: NotFoundError" in done.stderr
    assert not list((out / "checkpoints").glob("*")) if (out / "checkpoints").exists() else True
    rows = metrics_rows(out, "train")
    assert [r["problems"].get("step trained nothing") for r in rows] == [1, 1]
    assert all(len(r["rollout_ids"]) == 6 and r["warning"] for r in rows)

    # agl inspect on a failed rollout: its status, the error and the stored traceback
    rollout_id = rows[0]["rollout_ids"][0]
    inspect = _agl("inspect", rollout_id, "--store", str(out / "store.sqlite"))
    assert inspect.returncode == 0, inspect.stderr
    assert "status: failed" in inspect.stdout
    assert "error (" in inspect.stdout and "NotFoundError" in inspect.stdout
    assert "stored traceback" in inspect.stdout and "RuntimeError: graph run failed" in inspect.stdout

    # agl store stats reads the same file
    stats = _agl("store", "stats", "--store", str(out / "store.sqlite"))
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["rollouts_failed"] == 12


def test_setup_tracing_inside_the_agent_keeps_the_runs_exporter(tmp_path, monkeypatch):
    monkeypatch.setenv("AGL_STORE_URL", "http://127.0.0.1:9")  # where a re-aimed exporter would go
    done = train_cli(_job(tmp_path, TRACING_AGENT))
    rows = metrics_rows(tmp_path / "run", "train")
    assert all(r["transitions"] == 6 for r in rows), done.stdout[-2000:]
    assert "rollout has no episode reward" not in done.stdout
    assert "Failed to export" not in done.stderr and "ConnectionRefused" not in done.stderr
    assert "rollouts: " in done.stdout  # the ids are printed for agl inspect
    from agl_core.store import SqliteStore

    store = SqliteStore(tmp_path / "run" / "store.sqlite")
    try:
        names = {s.name for s in store.query_spans(limit=100_000)}
    finally:
        store.close()
    assert "user.step" in names  # the agent's own span reached the run's store


def test_a_key_in_the_wrong_section_suggests_its_dotted_name(tmp_path):
    from agl_trainer.config import ConfigError, load_config

    config = _job(tmp_path, TRACING_AGENT)
    with pytest.raises(ConfigError, match=r"did you mean 'algorithm\.agents'"):
        load_config(config, ["select_agents=[planner]"])
    with pytest.raises(ConfigError, match=r"did you mean 'train\.tasks_per_step'"):
        load_config(config, ["train.task_per_step=2"])
