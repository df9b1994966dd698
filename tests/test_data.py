"""Task datasets: JSONL and Parquet files, validation splits, and the resumable epoch sampler."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from agl_trainer.config import TasksConfig
from agl_trainer.run.data import DatasetError, TaskSampler, load_splits, load_tasks


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_tasks_keep_their_ids_and_inputs(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"id": "a", "q": 1}, {"q": 2}])
    tasks = load_tasks(path)
    assert [t.task_id for t in tasks] == ["a", "row-2"]
    assert tasks[1].input == {"q": 2}


def test_parquet_tasks_read_like_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import datetime

    import pyarrow.parquet as pq

    table = pa.table(
        {
            "id": ["p1", "p2"],
            "question": ["2+2", "3+3"],
            "answer": [4, 6],
            "tags": [["a"], []],
            "when": [datetime.date(2026, 1, 1), None],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    tasks = load_tasks(tmp_path / "t.parquet")
    assert [t.task_id for t in tasks] == ["p1", "p2"]
    assert tasks[0].input == {"id": "p1", "question": "2+2", "answer": 4, "tags": ["a"], "when": "2026-01-01"}
    json.dumps([t.input for t in tasks])  # what the store keeps must be JSON


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"id": 1}\n{not json}\n', "t.jsonl:2: not valid JSON"),
        ("[1, 2]\n", "t.jsonl:1: each task must be a JSON object, got list"),
        ('{"id": "x"}\n{"id": "x"}\n', "t.jsonl:2: duplicate task id 'x'"),
        ("\n\n", "no tasks"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, content, message):
    (tmp_path / "t.jsonl").write_text(content)
    with pytest.raises(DatasetError, match=message.replace("[", r"\[")):
        load_tasks(tmp_path / "t.jsonl")


def test_broken_parquet_and_unknown_suffix_are_refused(tmp_path):
    pytest.importorskip("pyarrow")
    (tmp_path / "t.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        load_tasks(tmp_path / "t.parquet")
    (tmp_path / "t.csv").write_text("a\n")
    with pytest.raises(DatasetError, match=r"must be \.jsonl or \.parquet"):
        load_tasks(tmp_path / "t.csv")


def test_validation_fraction_is_a_fixed_disjoint_split(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"id": f"t{i}"} for i in range(40)])
    train, val = load_splits(TasksConfig(train=path, val_fraction=0.25, split_seed=3))
    assert len(val) == 10 and len(train) == 30
    assert not {t.task_id for t in train} & {t.task_id for t in val}
    again_train, again_val = load_splits(TasksConfig(train=path, val_fraction=0.25, split_seed=3))
    assert [t.task_id for t in again_val] == [t.task_id for t in val]
    _, other_val = load_splits(TasksConfig(train=path, val_fraction=0.25, split_seed=4))
    assert [t.task_id for t in other_val] != [t.task_id for t in val]


def test_a_validation_file_must_not_share_tasks_with_training(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"id": "a"}, {"id": "b"}])
    val = _jsonl(tmp_path / "val.jsonl", [{"id": "b"}])
    with pytest.raises(DatasetError, match="in both"):
        load_splits(TasksConfig(train=train, val=val))
    one = _jsonl(tmp_path / "one.jsonl", [{"id": "a"}])
    with pytest.raises(DatasetError, match="leaves none to train on"):
        load_splits(TasksConfig(train=one, val_fraction=0.9))


def test_sampler_visits_every_task_once_per_epoch(tmp_path):
    tasks = load_tasks(_jsonl(tmp_path / "t.jsonl", [{"id": f"t{i}"} for i in range(10)]))
    sampler = TaskSampler(tasks, seed=1)
    drawn = [t.task_id for _ in range(5) for t in sampler.sample(4)]  # two epochs exactly
    first, second = Counter(drawn[:10]), Counter(drawn[10:])
    assert set(first.values()) == {1} and set(second.values()) == {1}
    assert drawn[:10] != drawn[10:]  # each epoch has its own order
    for _ in range(20):
        step = sampler.sample(4)
        assert len({t.task_id for t in step}) == 4  # distinct within a step, also across epoch ends


def test_sampler_state_resumes_the_same_sequence(tmp_path):
    tasks = load_tasks(_jsonl(tmp_path / "t.jsonl", [{"id": f"t{i}"} for i in range(7)]))
    straight = TaskSampler(tasks, seed=5)
    expected = [[t.task_id for t in straight.sample(3)] for _ in range(6)]
    first = TaskSampler(tasks, seed=5)
    got = [[t.task_id for t in first.sample(3)] for _ in range(2)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = TaskSampler(tasks, seed=5)
    resumed.load_state_dict(state)
    got += [[t.task_id for t in resumed.sample(3)] for _ in range(4)]
    assert got == expected
    with pytest.raises(ValueError, match="same task file and train.seed"):
        TaskSampler(tasks[:5], seed=5).load_state_dict(state)
