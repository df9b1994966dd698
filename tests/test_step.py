"""One training step without torch: rollout rounds through a real store (SQLite behind its HTTP server),
rollouts played by a fake worker that writes the spans a runner and the gateway would, and a recording
update in place of the policy's."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from agl_core import semconv
from agl_core.pipeline.transitions import NO_LLM_CALL
from agl_core.records import RolloutStatus, Task
from agl_core.server import BackgroundServer
from agl_core.store import SqliteStore, StoreClient
from agl_core.store.server import create_store_app
from agl_trainer.config import TrainerConfig
from agl_trainer.learning.algo import Advantaged
from agl_trainer.reporting.display import step_lines
from agl_trainer.reporting.results import UNNAMED_AGENT
from agl_trainer.run.rollouts import RolloutQueue, score_tasks
from agl_trainer.run.step import TrainStep

from .conftest import make_span

ROOT = Path(__file__).resolve().parent.parent


class _Worker:
    """Plays the rollouts queued in ``store``: each task input says the episode reward of its k-th rollout
    (``rewards[k % len]``), whether it makes an LLM call, records its reward only in a span (as an agent
    calling ``emit_reward`` does), fails, or never finishes."""

    def __init__(self, store: SqliteStore) -> None:
        self.store = store
        self.played: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> _Worker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            claimed = self.store.dequeue_rollout("fake-worker")
            if claimed is None:
                self._stop.wait(0.01)
                continue
            rollout, attempt = claimed
            spec: Mapping[str, Any] = rollout.input
            k = self.played.get(rollout.task_id, 0)
            self.played[rollout.task_id] = k + 1
            if spec.get("hang"):
                continue  # never completed: late at the deadline
            self._stop.wait(spec.get("sleep", 0))  # a slow agent (or a busy machine)
            if spec.get("fail"):
                self.store.complete_attempt(attempt.attempt_id, RolloutStatus.FAILED, error="Traceback\nboom")
                continue
            reward = float(spec["rewards"][k % len(spec["rewards"])])
            ids = {
                semconv.ROLLOUT_ID: rollout.rollout_id,
                semconv.ATTEMPT_ID: attempt.attempt_id,
                semconv.TASK_ID: rollout.task_id,
            }
            root = make_span(semconv.SPAN_ROLLOUT, ids)
            spans = [root]
            if spec.get("calls", 1):
                spans.append(
                    make_span(
                        "chat agl-policy",
                        {
                            **ids,
                            semconv.SOURCE: semconv.SOURCE_GATEWAY,
                            semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
                            semconv.GEN_AI_RESPONSE_ID: f"chatcmpl-{rollout.rollout_id}",
                            semconv.PROMPT_TOKEN_IDS: [1, 2, 3],
                            semconv.RESPONSE_TOKEN_IDS: [4, 5],
                            semconv.POLICY_VERSION: 0,
                        },
                        parent=root,
                    )
                )
            spans.append(
                make_span(
                    semconv.SPAN_REWARD,
                    {**ids, semconv.REWARD_VALUE: reward, semconv.REWARD_NAME: "episode"},
                    parent=root,
                )
            )
            self.store.add_spans(spans)
            recorded = None if spec.get("reward_in_span_only") else reward
            self.store.complete_attempt(attempt.attempt_id, RolloutStatus.SUCCEEDED, reward=recorded)


@dataclasses.dataclass(frozen=True)
class _Stats:
    loss: float
    grad_norm: float
    tokens: int


class _RecordingLearner:
    """Records every update and counts policy versions up, as serving a new version would."""

    def __init__(self) -> None:
        self.policy_version = 0
        self.updates: list[tuple[list[Advantaged], dict[str, str]]] = []

    def update(self, samples: Sequence[Advantaged], group_of: Mapping[str, str]) -> _Stats:
        self.updates.append((list(samples), dict(group_of)))
        self.policy_version += 1
        return _Stats(loss=0.25, grad_norm=1.5, tokens=sum(len(s.transition.response_ids) for s in samples))


class _Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def line(self, text: str) -> None:
        self.lines.append(text)

    def rollouts(self, label: str, done: int, failed: int, total: int) -> None:
        pass


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[SqliteStore, StoreClient]]:
    store = SqliteStore(tmp_path / "store.sqlite")
    with BackgroundServer(create_store_app(store)) as server, StoreClient(server.url) as client:
        yield store, client
    store.close()


def _config(tmp_path: Path, **sections: Any) -> TrainerConfig:
    (tmp_path / "tasks.jsonl").write_text('{"id": "x"}\n')
    return TrainerConfig.model_validate(
        {"agent": "agent:solve", "tasks": str(tmp_path / "tasks.jsonl"), **sections}
    )


def _task(task_id: str, **spec: Any) -> Task:
    return Task(task_id, {"id": task_id, **spec})


def _drive_step(store: SqliteStore, client: StoreClient, config: TrainerConfig) -> dict[str, Any]:
    """A step of three tasks with one redraw round; returns what the test checks."""
    first = [
        _task("a", rewards=[1.0, 0.0]),  # differing rewards: trains
        _task("b", rewards=[1.0]),  # tie: skipped
        _task("c", rewards=[0.5], calls=0, reward_in_span_only=True),  # no LLM call: nothing to train
    ]
    extra = [_task("d", rewards=[0.0, 1.0]), _task("e", rewards=[0.0])]
    asked: list[int] = []

    def draw(n: int) -> list[Task]:
        asked.append(n)
        return extra[:n]

    learner = _RecordingLearner()
    progress = _Lines()
    flushed: list[int] = []
    queue = RolloutQueue(client, progress, step_timeout_s=60, flush=lambda: flushed.append(1))
    with _Worker(store):
        outcome = TrainStep(config, queue, learner).run(1, first, draw=draw)
    return {"outcome": outcome, "learner": learner, "asked": asked, "flushed": flushed, "progress": progress}


def test_a_step_trains_on_the_groups_with_differing_rewards_and_redraws_for_the_rest(tmp_path, stack):
    store, client = stack
    config = _config(
        tmp_path,
        algorithm={"name": "grpo"},
        train={"tasks_per_step": 3, "rollouts_per_task": 2, "resample_rounds": 1},
    )
    got = _drive_step(store, client, config)
    outcome, learner = got["outcome"], got["learner"]
    metrics, batch = outcome.metrics, outcome.batch

    assert got["asked"] == [2]  # one group of three had differing rewards: two more tasks drawn
    assert len(got["flushed"]) == 2  # the gateway's spans flushed after each round
    assert outcome.redraw_rounds == 1
    assert metrics.tasks == ["a", "b", "c", "d", "e"] and metrics.redrawn_tasks == 2
    assert (metrics.rollouts, metrics.rollouts_failed, metrics.rollouts_late) == (10, 0, 0)
    assert metrics.transitions == 8  # one call per rollout; c's rollouts make none
    assert metrics.trained_transitions == 4  # a's and d's; b and e tie
    assert metrics.mean_reward == pytest.approx(0.5)  # c's 0.5 read from its reward span
    assert metrics.groups_skipped == 2
    assert (metrics.loss, metrics.grad_norm, metrics.tokens) == (0.25, 1.5, 8)
    assert metrics.policy_version == 1
    assert metrics.agents == {UNNAMED_AGENT: {"calls": 8, "trained": 4}}
    assert metrics.untrained == {NO_LLM_CALL: 2}
    assert metrics.problems == {NO_LLM_CALL: 2}

    # the update got the signal groups' calls, advantages centred within each group
    ((samples, group_of),) = learner.updates
    groups = {group_of[s.transition.rollout_id] for s in samples}
    assert groups == {"step1:a", "step1.1:d"}
    rewarded = {s.transition.rollout_id: s for s in samples}
    for group in groups:
        members = [s for s in samples if group_of[s.transition.rollout_id] == group]
        assert len(members) == 2
        assert sum(s.advantage for s in members) == pytest.approx(0.0)
        assert max(members, key=lambda s: s.transition.reward).advantage > 0
    assert all(s.transition.prompt_ids == (1, 2, 3) for s in rewarded.values())
    assert batch.signal_groups == 2 and batch.report.groups == 4
    assert set(batch.untrained.values()) == {NO_LLM_CALL}

    lines = step_lines(outcome, 4, show_agents=False, inspect_hint=" --store s.sqlite")
    assert lines[0].startswith(
        "step 1/4  rollouts=10  transitions=8 (trained 4, 2 groups skipped)  mean_reward=0.500"
    )
    assert "loss=+0.2500 grad_norm=1.500" in lines[0] and "policy=v1" in lines[0]
    assert "  redrew 2 tasks in 1 round(s) for groups with differing rewards: 2 of 4 groups train" in lines
    assert (
        "  2/4 task groups skipped: tied rewards (every rollout of the task scored the same,"
        " no learning signal)" in lines
    )
    (hint,) = [line for line in lines if "gave no training data" in line]
    assert hint.startswith("  2 rollouts gave no training data (see: agl inspect ")
    assert hint.endswith(" --store s.sqlite):")
    assert f"    2 x {NO_LLM_CALL}" in lines

    # every rollout of the step is marked consumed: retention may drop all their spans
    assert store.stats()["spans"] == 10 + 8 + 10  # rollout, LLM call and reward spans
    store.apply_retention(consumed=True)
    assert store.stats()["spans"] == 0


def test_a_step_without_signal_skips_the_update(tmp_path, stack):
    store, client = stack
    config = _config(tmp_path, train={"tasks_per_step": 1, "rollouts_per_task": 2})
    learner = _RecordingLearner()
    queue = RolloutQueue(client, _Lines(), step_timeout_s=60)
    with _Worker(store):
        outcome = TrainStep(config, queue, learner).run(3, [_task("t", rewards=[1.0])])
    assert learner.updates == []
    m = outcome.metrics
    assert (m.trained_transitions, m.loss, m.grad_norm, m.tokens, m.policy_version) == (0, None, None, 0, 0)
    assert "loss=skipped" in step_lines(outcome, 3, show_agents=False)[0]


def test_failed_and_late_rollouts_are_counted_and_the_late_ones_cancelled(tmp_path, stack):
    store, client = stack
    config = _config(tmp_path, train={"tasks_per_step": 3, "rollouts_per_task": 1})
    progress = _Lines()
    queue = RolloutQueue(client, progress, step_timeout_s=1.0, inflight=tmp_path / "inflight.json")
    tasks = [_task("ok", rewards=[1.0]), _task("bad", fail=True), _task("slow", hang=True)]
    with _Worker(store):
        outcome = TrainStep(config, queue, _RecordingLearner()).run(1, tasks)
    m = outcome.metrics
    assert (m.rollouts, m.rollouts_failed, m.rollouts_late) == (1, 1, 1)
    assert any(line.endswith("failed: boom") for line in progress.lines), progress.lines
    assert "  1 rollouts were not done after runner.step_timeout_s=1s and were cancelled" in progress.lines
    assert not (tmp_path / "inflight.json").exists()  # written while the round ran, removed after
    stats = store.stats()
    assert (stats["rollouts_succeeded"], stats["rollouts_failed"], stats["rollouts_cancelled"]) == (1, 1, 1)


def test_held_out_score_counts_failed_rollouts_as_zero(tmp_path, stack):
    store, client = stack
    queue = RolloutQueue(client, _Lines(), step_timeout_s=60)
    tasks = [_task("a", rewards=[1.0, 0.0]), _task("b", rewards=[0.5]), _task("c", fail=True)]
    with _Worker(store):
        scored = score_tasks(queue, tasks, step=2, rollouts_per_task=2, max_attempts=1, keep_spans=True)
    result = scored.result
    assert result.task_scores == {"a": 0.5, "b": 0.5, "c": 0.0}
    assert result.mean == pytest.approx(1 / 3) and result.n == 3 and result.rollouts_failed == 2
    assert [(r.task_id, r.reward) for r in scored.rollouts] == [
        ("a", 1.0),
        ("a", 0.0),
        ("b", 0.5),
        ("b", 0.5),
        ("c", 0.0),
        ("c", 0.0),
    ]
    assert {r.group_id for r in store.get_rollouts([r.rollout_id for r in scored.rollouts])} == {
        "val2:a",
        "val2:b",
        "val2:c",
    }
    assert all(
        r.metadata["split"] == "val" for r in store.get_rollouts([r.rollout_id for r in scored.rollouts])
    )
    # spans kept for the succeeded rollouts (the failed ones wrote none)
    assert sorted(len(v) for v in scored.spans.values()) == [3, 3, 3, 3]


def test_a_held_out_pass_waits_while_rollouts_finish_and_never_scores_an_unfinished_one(tmp_path, stack):
    """On a busy machine held-out rollouts once still running at runner.step_timeout_s were cancelled and
    scored 0, so a published score depended on the machine's speed. The pass now waits while rollouts keep
    finishing (8 rollouts of 0.3 s one after another take 2.4 s, past the 1.5 s limit); one that stalls is
    cancelled after the limit without progress and left unscored, and the result says the pass is
    incomplete."""
    from agl_trainer.reporting.display import held_out_line

    store, client = stack
    progress = _Lines()
    queue = RolloutQueue(client, progress, step_timeout_s=1.5)
    slow = [_task(f"t{i}", rewards=[1.0], sleep=0.3) for i in range(8)]
    with _Worker(store):
        complete = score_tasks(queue, slow, step=0, rollouts_per_task=1, max_attempts=1).result
        stalled = score_tasks(
            queue, [*slow[:2], _task("stuck", hang=True)], step=1, rollouts_per_task=1, max_attempts=1
        ).result
    assert complete.n == 8 and complete.mean == 1.0 and complete.unfinished == 0
    assert "INCOMPLETE" not in complete.describe()
    assert stalled.task_scores == {"t0": 1.0, "t1": 1.0} and stalled.unfinished == 1
    assert stalled.rollouts_failed == 0 and stalled.mean == 1.0
    line = held_out_line(complete, stalled)
    assert "INCOMPLETE: 1 rollouts did not finish and are not scored" in line
    assert "1 rollouts were not done with none finishing for runner.step_timeout_s=1.5s" in " ".join(
        progress.lines
    )


def test_the_step_machinery_imports_no_torch():
    code = (
        "import sys\n"
        "import agl_trainer.run.step, agl_trainer.run.rollouts\n"
        "import agl_trainer.reporting.display, agl_trainer.reporting.results\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
