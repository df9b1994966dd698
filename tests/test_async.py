"""Asynchronous training (``train.mode: async``, :mod:`agl_trainer.run.pipeline`) through the real pipeline:
store, gateway, runner, the tiny model's update.

A slow task group holds no step back: steps train on the groups that finished, while the slow one runs on
through the updates; when it finishes with calls too many policy versions old it is dropped and counted,
never trained, and never split. A run resumed from a checkpoint goes on from the next step.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import openai
import pytest

from agl_core.store import SqliteStore
from agl_trainer import Trainer
from agl_trainer.config import ConfigError

from ._training import TINY_JOB, Turns, metrics_rows

CONFIG: dict[str, Any] = {
    **TINY_JOB,
    "train": {"steps": 3, "tasks_per_step": 1, "rollouts_per_task": 2, "mode": "async", "max_staleness": 1},
}
TASKS = [{"id": f"t{i}", "q": f"say {i}"} for i in range(6)]


class SlowFirstGroup:
    """The agent: one LLM call, then a reward that alternates within each group (so every group trains).
    The rollouts of the first task to start under policy version 0 wait after their call until ``release``
    is set: that group finishes only once the policy has moved on."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.slow_task: str | None = None
        self._lock = threading.Lock()
        self._turns = Turns()

    def __call__(self, task: dict[str, Any], llm: Any) -> float:
        with self._lock:
            if self.slow_task is None and llm.policy_version == 0:
                self.slow_task = task["id"]
            slow = task["id"] == self.slow_task and llm.policy_version == 0
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
        client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=3
        )
        if slow:
            assert self.release.wait(120), "the slow group was never released"
        return self._turns.reward(task)


def _groups_of(store_file, rollout_ids: list[str]) -> Counter[str]:
    store = SqliteStore(str(store_file))
    try:
        return Counter(r.group_id for r in store.get_rollouts(rollout_ids))
    finally:
        store.close()


def test_a_slow_group_holds_no_step_back_and_is_dropped_when_too_stale(tmp_path):
    agent = SlowFirstGroup()
    lines: list[str] = []

    def echo(line: str) -> None:
        lines.append(line)
        if line.startswith("step 2/"):
            agent.release.set()  # the slow group finishes after the second update

    out = tmp_path / "run"
    result = Trainer({**CONFIG, "output_dir": str(out)}, echo=echo).fit(agent, TASKS)
    assert [m.step for m in result.history] == [1, 2, 3]
    first, second, third = (m.pipeline for m in result.history)
    assert first is not None and second is not None and third is not None
    # steps 1 and 2 trained on the groups that finished while the slow one was still running
    assert first["in_flight_at_update"] >= 2 and first["dropped_groups"] == 0
    assert first["staleness"] == {"0": 2} and second["staleness"] == {"0": 2}
    # its calls were made under version 0; at step 3 the policy being updated is version 2
    assert third["dropped_groups"] == 1
    assert all(int(behind) <= 1 for m in result.history for behind in m.pipeline["staleness"])
    for m in result.history:
        assert m.trained_transitions == 2
        # one whole group per step: never split, never mixed with the dropped one
        assert list(_groups_of(out / "store.sqlite", m.rollout_ids).values()) == [2]
    assert any("1 group(s) dropped as too stale" in line for line in lines)
    assert any(line.startswith("  async: trained calls by staleness (0 behind: 2") for line in lines)
    rows = [r for r in metrics_rows(out) if r["kind"] == "train"]
    assert [r["pipeline"]["dropped_groups"] for r in rows] == [0, 0, 1]
    # the rollouts phase of an asynchronous step is its wait for finished groups
    assert [r["phases"]["rollouts"] for r in rows] == [r["pipeline"]["wait_s"] for r in rows]
    assert not (out / "inflight.json").exists()  # the groups left in flight were cancelled at the end


def test_an_async_run_resumes_at_the_next_step(tmp_path):
    turns = Turns()

    def agent(task: dict[str, Any], llm: Any) -> float:
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
        client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=3
        )
        return turns.reward(task)

    config = {**CONFIG, "output_dir": str(tmp_path / "run"), "checkpoint": {"every_steps": 1}}
    first = Trainer(config, overrides=["train.steps=2"]).fit(agent, TASKS)
    assert [m.step for m in first.history] == [1, 2]
    again = Trainer(config, overrides=["train.steps=3"]).fit(agent, TASKS, resume=True)
    assert [m.step for m in again.history] == [3]
    assert again.history[0].policy_version == 3 and again.history[0].pipeline is not None
    steps = [r["step"] for r in metrics_rows(tmp_path / "run") if r["kind"] == "train"]
    assert steps == [1, 2, 3]  # none repeated or skipped


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"mode": "async", "resample_rounds": 1}, "train.resample_rounds redraws tasks within a synchronous"),
        ({"max_staleness": 2}, "train.max_staleness applies with train.mode: async"),
        ({"mode": "async", "max_staleness": -1}, "max_staleness"),
        ({"mode": "later"}, "mode"),
    ],
)
def test_bad_async_settings_are_refused(tmp_path, train, message):
    with pytest.raises(ConfigError) as refused:
        Trainer({**CONFIG, "output_dir": str(tmp_path), "train": {"steps": 1, **train}})
    assert message in str(refused.value)
