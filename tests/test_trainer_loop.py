"""``agl train`` end to end on the tiny model, beyond the CPU default: serving through (fake) vLLM,
rollout timeouts and their rewards reaching the update, runners started elsewhere with ``agl run``, and
redrawing tasks whose rollouts tie."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ._training import metrics_rows, train_cli

ROOT = Path(__file__).resolve().parent.parent

AGENT = """
import itertools
import random
import time
import openai

# every other call hangs (not a coin flip, which left all six rollouts of a task hanging one run in 32: a
# group of tied rewards that trains nothing)
_hangs = itertools.cycle((False, True))

def solve(task, llm):
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=4
    )
    if task.get("hang") and next(_hangs):
        time.sleep(30)  # past runner.rollout_timeout_s
    return 1.0 if task.get("tie") else random.random()
"""


def _job(tmp_path: Path, config: str, tasks: list[dict]) -> Path:
    """A job of AGENT over ``tasks`` writing to ``tmp_path/run``; ``config`` adds the test's own sections."""
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    (tmp_path / "config.yaml").write_text(
        f"agent: agent:solve\ntasks: tasks.jsonl\noutput_dir: {tmp_path / 'run'}\n"
        "logging: {plot: false, tensorboard: false}\n" + config
    )
    return tmp_path / "config.yaml"


def _spans(out: Path):
    from agl_core.store import SqliteStore

    store = SqliteStore(out / "store.sqlite")
    try:
        return store.query_spans(limit=100_000)
    finally:
        store.close()


def test_training_serves_through_vllm_and_publishes_every_version(tmp_path):
    from agl_core import semconv

    paths = os.pathsep.join([str(ROOT), str(ROOT / "src"), str(ROOT / "trainer")])
    config = _job(
        tmp_path,
        f"""
model: {{source: tiny, lora: {{r: 4, alpha: 8}}}}
serving:
  backend: vllm
  vllm:
    launch: {{model: {tmp_path / "base"}, command: [{sys.executable}, -m, tests.fake_vllm, serve],
              env: {{PYTHONPATH: "{paths}"}}, startup_timeout_s: 120}}
train: {{steps: 2, tasks_per_step: 2, rollouts_per_task: 3}}
""",
        [{"id": f"t{i}", "q": f"say {i}"} for i in range(6)],
    )
    done = train_cli(config)
    assert "(vllm backend)" in done.stdout
    rows = metrics_rows(tmp_path / "run", "train")
    assert [r["policy_version"] for r in rows] == [1, 2]  # random rewards: every group has a signal
    assert sorted(p.name for p in (tmp_path / "run" / "adapters").iterdir()) == ["v1", "v2"]
    gateway = [
        s for s in _spans(tmp_path / "run") if s.attributes.get(semconv.SOURCE) == semconv.SOURCE_GATEWAY
    ]
    assert {s.attributes[semconv.GATEWAY_BACKEND] for s in gateway} == {"vllm"}
    # step 1's rollouts were served by the base policy, step 2's by the adapter published after step 1
    assert sorted({s.attributes[semconv.POLICY_VERSION] for s in gateway}) == [0, 1]
    assert all(s.attributes[semconv.RESPONSE_TOKEN_IDS] for s in gateway)


def test_timed_out_rollouts_are_trained_with_the_configured_penalty(tmp_path):
    config = _job(
        tmp_path,
        """
model: {source: tiny, lora: null}
gateway: {default_max_tokens: 4}
runner: {workers: 4, rollout_timeout_s: 2}
algorithm: {rewards: {timeout: -1.0, timeout_episode_reward: 0.0}}
train: {steps: 1, tasks_per_step: 2, rollouts_per_task: 6}
""",
        [{"id": "t0", "q": "wait", "hang": True}, {"id": "t1", "q": "wait too", "hang": True}],
    )
    done = train_cli(config)
    (row,) = metrics_rows(tmp_path / "run", "train")
    timed_out = row["rollouts_failed"]
    assert timed_out >= 1, done.stdout
    assert row["reward_events"].get("timeout") == timed_out
    assert row["trained_transitions"] == 12  # the timed-out rollouts were trained too, with their penalty
    assert row["agents"] == {"(unnamed)": {"calls": 12, "trained": 12}}  # plain OpenAI client: no agent name
    assert "timed-out rollouts trained with the timeout episode reward" in done.stdout


def test_runners_started_elsewhere_with_agl_run(tmp_path):
    config = _job(
        tmp_path,
        """
model: {source: tiny, lora: null}
gateway: {default_max_tokens: 4}
runner: {workers: 0, step_timeout_s: 120}
train: {steps: 2, tasks_per_step: 2, rollouts_per_task: 2}
""",
        [{"id": f"t{i}", "q": f"say {i}"} for i in range(4)],
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    trainer = subprocess.Popen(
        [sys.executable, "-m", "agl_core.cli", "train", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    runner = None
    lines: list[str] = []
    try:
        for line in trainer.stdout:
            lines.append(line)
            if "start runners with:" in line:
                command = shlex.split(next(trainer.stdout).strip())
                break
        else:
            pytest.fail("the trainer printed no agl run command:\n" + "".join(lines))
        assert command[:2] == ["agl", "run"] and command[2] == "agent:solve"
        runner = subprocess.Popen(
            [sys.executable, "-m", "agl_core.cli", *command[1:], "--workers", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        rest, _ = trainer.communicate(timeout=300)
        lines.append(rest)
        assert trainer.returncode == 0, "".join(lines)[-3000:]
    finally:
        trainer.kill()
        if runner is not None:
            runner.terminate()
            runner.communicate(timeout=30)  # reads and closes its pipe
    rows = metrics_rows(tmp_path / "run", "train")
    assert [r["rollouts"] for r in rows] == [4, 4]
    assert all(r["transitions"] == 4 for r in rows)


def test_step_metrics_count_calls_and_trained_transitions_per_agent():
    from agl_core.records import Transition
    from agl_trainer.run.step import agent_counts

    def t(agent, i):
        return Transition("r", None, None, i, (1,), (2,), None, 0.0, agent_name=agent)

    calls = [t("writer", 0), t("checker", 1), t("writer", 2), t(None, 3)]
    assert agent_counts(calls, [calls[0], calls[2]]) == {
        "writer": {"calls": 2, "trained": 2},
        "checker": {"calls": 1, "trained": 0},
        "(unnamed)": {"calls": 1, "trained": 0},
    }


def test_tied_groups_are_redrawn_until_the_step_has_its_groups(tmp_path):
    from agl_core.records import Task
    from agl_trainer.run.data import TaskSampler

    # even tasks always score 1.0 (their groups tie, no gradient); odd ones score at random (always differ)
    tasks = [{"id": f"t{i}", "q": f"say {i}", "tie": i % 2 == 0} for i in range(8)]
    config = _job(
        tmp_path,
        """
model: {source: tiny, lora: null}
gateway: {default_max_tokens: 4}
train: {steps: 2, tasks_per_step: 2, rollouts_per_task: 2, resample_rounds: 3, seed: 0}
""",
        tasks,
    )
    done = train_cli(config)
    rows = metrics_rows(tmp_path / "run", "train")
    ties = {t["id"] for t in tasks if t["tie"]}

    # what the run should have drawn: the step's tasks, then as many more as groups were missing
    sampler = TaskSampler([Task(task_id=t["id"], input=t) for t in tasks], seed=0)
    for row in rows:
        expected = [t.task_id for t in sampler.sample(2)]
        rounds = 0
        while sum(t not in ties for t in expected) < 2 and rounds < 3:
            rounds += 1
            expected += [t.task_id for t in sampler.sample(2 - sum(t not in ties for t in expected))]
        assert row["tasks"] == expected
        assert row["redrawn_tasks"] == len(expected) - 2
        assert row["rollouts"] == 2 * len(expected)
        differing = sum(t not in ties for t in expected)
        assert row["trained_transitions"] == 2 * differing  # one call per rollout; tied groups skipped
        assert row["groups_skipped"] == len(expected) - differing
    assert sum(r["redrawn_tasks"] for r in rows) > 0  # the seed makes some step redraw
    assert "redrew" in done.stdout
