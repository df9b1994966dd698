"""The text-to-SQL LangGraph example, reduced: real SmolLM2, writer and rewriter trained, checker left out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ._training import metrics_rows, train_cli

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "sql_langchain"

#: Three tasks the untrained model solves about two times in three (measured over 6 runs each),
#: so that with 4 rollouts each some group has both outcomes (all three tie with probability ~1%), and one
#: on the orders table it gets wrong, mostly with an error (so the checker is called).
TRAIN_IDS = (
    "emp_names_older-41",
    "emp_names_salary_gt-110000",
    "emp_names_salary_gt-82500",
    "ord_count_customer-Wayne",
)


def _import_example():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import agent
        import company_db
        import trained_agents
    finally:
        sys.path.remove(str(EXAMPLE))
    return agent, company_db, trained_agents


def test_tasks_and_database_are_consistent(tmp_path):
    _, company_db, _ = _import_example()
    path = company_db.database_path(tmp_path)
    splits = {
        name: [json.loads(line) for line in (EXAMPLE / f"{name}.jsonl").read_text().splitlines()]
        for name in ("train", "val", "dev")
    }
    assert (len(splits["train"]), len(splits["val"]), len(splits["dev"])) == (200, 100, 40)
    train_ids = {t["id"] for t in splits["train"]}
    assert not train_ids & {t["id"] for t in splits["val"]}
    assert {t["id"] for t in splits["dev"]} <= train_ids
    for task in splits["train"][:20] + splits["val"][:20]:
        rows = company_db.run_query(task["gold_sql"], path)
        assert rows and company_db.same_result(rows, task["answer"])
    # multiset semantics: order does not matter, multiplicity and values do; 5 == 5.0
    assert company_db.same_result([("a",), ("b",)], [["b"], ["a"]])
    assert not company_db.same_result([("a",), ("a",)], [["a"]])
    assert company_db.same_result([(5,)], [[5.0]])
    with pytest.raises(company_db.QueryError, match="no such column"):
        company_db.run_query("SELECT nope FROM employees", path)
    with pytest.raises(company_db.QueryError, match="readonly"):
        company_db.run_query("DELETE FROM employees", path)


def test_extract_sql_is_lenient():
    agent, _, _ = _import_example()
    assert (
        agent.extract_sql("```sql\nSELECT name FROM employees WHERE age > 3;\n```")
        == "SELECT name FROM employees WHERE age > 3"
    )
    assert (
        agent.extract_sql("Sure! select COUNT(*)\n  FROM orders\n\nThis counts.")
        == "select COUNT(*) FROM orders"
    )
    assert agent.extract_sql("I cannot do that.") is None


@pytest.mark.slow
def test_train_sql_example_end_to_end_on_cpu(tmp_path):
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    _, _, trained_agents = _import_example()
    tasks = {json.loads(line)["id"]: line for line in (EXAMPLE / "train.jsonl").read_text().splitlines()}
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(tasks[i] + "\n" for i in TRAIN_IDS))
    out = tmp_path / "run"
    overrides = (
        f"tasks.train={train_file}",
        "train.steps=1",
        "train.tasks_per_step=4",
        "train.rollouts_per_task=4",
        "validation.max_tasks=1",
        f"output_dir={out}",
        "logging.progress=plain",
        "logging.tensorboard=false",
        "logging.plot=false",
    )
    sets = [arg for override in overrides for arg in ("--set", override)]
    done = train_cli(EXAMPLE / "config.yaml", "--overwrite", *sets, timeout=900)
    assert "held-out reward: before " in done.stdout, done.stdout

    rows = metrics_rows(out)
    assert [(r["kind"], r["step"]) for r in rows] == [("val", 0), ("train", 1), ("val", 1)]
    assert all(r["n"] == 1 for r in rows if r["kind"] == "val")
    step = rows[1]
    assert step["rollouts"] == 16 and step["rollouts_failed"] == 0, step

    # The trained set, recomputed from the stored spans with the trainer's functions, agrees with the metrics:
    # the writer's calls (and the rewriter's, when a rewrite happened) were trained, none of the checker's.
    [audit] = trained_agents.audit(EXAMPLE / "config.yaml", overrides)
    assert audit.matches_metrics, (audit.calls, audit.trained, step)
    assert set(audit.calls) <= {"writer", "checker", "rewriter"}, audit.calls
    assert audit.calls["writer"] == step["rollouts"]  # one writer call per rollout, named by its graph node
    assert audit.calls["checker"] >= 1 and audit.calls["rewriter"] == audit.calls["checker"], audit.calls
    assert audit.trained["writer"] >= 1, (audit.trained, done.stdout)
    assert audit.trained["checker"] == 0
    assert step["transitions"] > step["trained_transitions"]
    # the selection is what kept them out: without it, the checker calls of rollouts in groups with a signal
    # would have been trained too
    assert audit.trained_without_selection["writer"] == audit.trained["writer"]
    assert audit.trained_without_selection["rewriter"] == audit.trained["rewriter"]
