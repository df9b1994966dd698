"""``agl rollouts list``: every rollout a store holds, with the dashboard's filters, as a table or JSON."""

from __future__ import annotations

import json

import pytest

from agl_core import semconv
from agl_core.cli import main
from agl_core.records import RolloutStatus
from agl_core.store import SqliteStore, StoreClient
from agl_core.store._loose import LooseSpans
from agl_core.testing import Collector
from tests.conftest import make_span


def _fill(store: SqliteStore) -> None:
    store.enqueue_rollouts(
        [{"task_id": "q-1", "rollout_id": "ro-a", "metadata": {"split": "train", "step": 3}}]
        + [{"task_id": "q-2", "rollout_id": "ro-b", "metadata": {"split": "val"}}]
    )
    _, attempt = store.dequeue_rollout("w")
    store.add_spans([make_span("agent", {semconv.ROLLOUT_ID: "ro-a", semconv.GEN_AI_AGENT_NAME: "writer"})])
    store.complete_attempt(attempt.attempt_id, RolloutStatus.SUCCEEDED, reward=0.75)
    store.add_spans([make_span("chat", {semconv.SESSION_ID: "conv-1"})])  # sent from outside a runner
    loose = LooseSpans(quiet_s=0)
    store.group_loose_spans(loose, now=0)


def test_lists_every_rollout_newest_first_with_filters(tmp_path, capsys):
    path = tmp_path / "s.sqlite"
    store = SqliteStore(path)
    _fill(store)
    store.close()

    assert main(["rollouts", "list", "--store", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["ROLLOUT", "STATUS", "REWARD", "SPANS"]
    rows = [line.split() for line in lines[1:-1]]
    assert [r[0] for r in rows] == [rows[0][0], "ro-b", "ro-a"] and rows[0][0].startswith("imp-s-")
    assert rows[0][1:5] == ["succeeded", "-", "1", "live"]
    assert rows[2][1:5] == ["succeeded", "0.750", "1", "queue"]
    assert lines[-1].startswith("3 of 3 matching rollout(s) in ")

    assert main(["rollouts", "list", "--store", str(path), "--status", "queued", "--json"]) == 0
    page = json.loads(capsys.readouterr().out)
    assert [r["rollout_id"] for r in page["rollouts"]] == ["ro-b"] and page["total"] == 1
    for flags, expected in (
        (["--agent", "writer"], ["ro-a"]),
        (["--split", "train", "--step", "3"], ["ro-a"]),
        (["--reward-min", "0.5"], ["ro-a"]),
        (["--task-id", "q-2"], ["ro-b"]),
        (["--search", "writer"], ["ro-a"]),
        (["--search", "nothing like it"], []),
    ):
        assert main(["rollouts", "list", "--store", str(path), "--json", *flags]) == 0
        assert [r["rollout_id"] for r in json.loads(capsys.readouterr().out)["rollouts"]] == expected, flags
    assert main(["rollouts", "list", "--store", str(path), "--limit", "2"]) == 0
    out = capsys.readouterr().out
    before = int(out.rsplit("--before ", 1)[1])
    assert main(["rollouts", "list", "--store", str(path), "--before", str(before)]) == 0
    assert "ro-a" in capsys.readouterr().out


def test_lists_a_running_store_with_its_token(tmp_path, capsys, monkeypatch):
    store = SqliteStore(tmp_path / "s.sqlite")
    _fill(store)
    with Collector(store, token="tok") as collector:
        monkeypatch.setenv("AGL_STORE_TOKEN", "tok")
        assert main(["rollouts", "list", "--store", collector.url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["total"] == 3
        with StoreClient(collector.url, token="tok") as client:
            assert client.stats()["rollouts"] == 3
        monkeypatch.delenv("AGL_STORE_TOKEN")
        assert main(["rollouts", "list", "--store", collector.url]) == 1
        assert "401" in capsys.readouterr().err
    store.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--limit", "0"], "--limit: 0: give a number from 1 to 500"),
        (["--limit", "x"], "'x' is not a whole number"),
        (["--status", "done"], "invalid choice: 'done'"),
        (["--reward-min", "nan"], "give a finite number"),
        (["--reward-min", "2", "--reward-max", "1"], "is above reward_max (1.0) (--search, --reward-min"),
        (["--search", "x" * 257], "a search text must be 1 to 256 characters"),
    ],
)
def test_bad_flags_are_named_and_exit_2(tmp_path, capsys, flags, message):
    path = tmp_path / "s.sqlite"
    SqliteStore(path).close()
    with pytest.raises(SystemExit) as stop:
        code = main(["rollouts", "list", "--store", str(path), *flags])
        raise SystemExit(code)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_store_file_is_named(tmp_path, capsys):
    assert main(["rollouts", "list", "--store", str(tmp_path / "nope.sqlite")]) == 1
    assert "neither a store URL" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "nan", "90000"])
def test_store_serve_refuses_a_bad_group_wait(tmp_path, capsys, value):
    code = main(["store", "serve", "--db", str(tmp_path / "s.sqlite"), "--group-wait", value, "--no-grpc"])
    assert code == 2
    assert f"--group-wait {float(value)}: give seconds from 0 (off) to 86400" in capsys.readouterr().err


def test_search_finds_rollouts_by_span_names_and_text_values(store):
    from agl_core.store import RolloutFilter

    store.add_spans([make_span("lookup_weather", {semconv.ROLLOUT_ID: "ro-w", "tool.input": "Zürich, CH"})])
    store.add_spans([make_span("chat", {semconv.ROLLOUT_ID: "ro-c", "gen_ai.prompt": "what is 2 + 2?"})])
    store.add_observed_rollouts([{"rollout_id": "ro-w"}, {"rollout_id": "ro-c"}])

    def found(text: str) -> list[str]:
        return sorted(r.rollout_id for r in store.list_rollouts(RolloutFilter(text=text)).rollouts)

    assert found("weather") == ["ro-w"]  # a span name
    assert found("Zürich") == ["ro-w"]  # a text value, not ASCII
    assert found("2 + 2") == ["ro-c"]
    assert found("gen_ai.prompt") == ["ro-c"]  # an attribute key
    assert found("zürich") == []  # case-sensitive
    assert store.list_rollouts(RolloutFilter(text="chat", statuses=("failed",))).rollouts == []
