"""Spider's execution accuracy, written here: a predicted query is right when, run on the question's
database, it returns the gold query's result.

As in Spider's test-suite evaluation (Zhong et al., 2020): two results are equal when they have the same
number of rows and columns and some order of the predicted result's columns makes its rows equal the
gold rows as a multiset, or as a sequence when the gold query orders its result (``ORDER BY``); columns
are matched by position, not name, so ``SELECT name, age`` and ``SELECT age, name`` both answer a
question whose gold asks for the two. Empty results equal each other.

Queries run as written: ``DISTINCT`` is kept in both the predicted and the gold query. The test-suite
evaluator strips it from both by default (its ``--keep_distinct`` off), so a prediction that differs from
the gold only by ``DISTINCT`` can be right there and wrong here, or the other way round.

Predicted SQL is untrusted: it runs on a read-only connection to the database file, one statement only,
allowed to read and compute and nothing else (an authorizer refuses ``ATTACH``, ``PRAGMA`` and every
write), and is stopped after ``timeout_s`` seconds (SQLite's progress handler), so a cross join of every
table costs a wrong answer, not the run.
"""

from __future__ import annotations

import collections
import itertools
import re
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["QueryError", "execution_match", "orders", "results_equal", "run_query"]

#: What a query may do: read tables, call functions, recurse (WITH RECURSIVE); everything else is refused.
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
#: Column orders tried at most when matching a result (module docstring).
MAX_PERMUTATIONS = 10_000
#: Rows a query may return before it counts as wrong (no Spider gold result comes near it).
MAX_ROWS = 100_000


class QueryError(Exception):
    """A predicted query that did not run: the message is SQLite's, or says why it was refused."""


def orders(sql: str) -> bool:
    """Whether a query orders its result."""
    return re.search(r"\border\s+by\b", sql, re.IGNORECASE) is not None


def run_query(database: Path, sql: str, *, timeout_s: float = 5.0) -> list[tuple[Any, ...]]:
    """The rows of one read-only statement on ``database``; :class:`QueryError` when it fails, is not a
    single statement, takes longer than ``timeout_s`` or returns more than :data:`MAX_ROWS` rows."""
    if not sqlite3.complete_statement(sql.rstrip().rstrip(";") + ";"):
        raise QueryError("not a complete SQL statement")
    connection = sqlite3.connect(f"file:{database}?mode=ro", uri=True, check_same_thread=False)
    deadline = time.monotonic() + timeout_s
    connection.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, 10_000)
    connection.text_factory = lambda raw: raw.decode("utf-8", errors="replace")
    connection.set_authorizer(
        lambda action, *_: sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY
    )
    try:
        cursor = connection.execute(sql)  # execute() refuses more than one statement
        rows = cursor.fetchmany(MAX_ROWS + 1)
    except sqlite3.OperationalError as exc:
        if "interrupted" in str(exc):
            raise QueryError(f"stopped after {timeout_s:g} s") from None
        raise QueryError(str(exc)) from None
    except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError) as exc:
        raise QueryError(str(exc)) from None
    finally:
        connection.close()
    if len(rows) > MAX_ROWS:
        raise QueryError(f"more than {MAX_ROWS} rows")
    return [tuple(row) for row in rows]


def _permutations(
    gold: Sequence[tuple[Any, ...]], predicted: Sequence[tuple[Any, ...]]
) -> list[tuple[int, ...]]:
    """Orders of the predicted columns worth trying: predicted column ``j`` may stand at gold position
    ``i`` only when every value of it occurs in gold column ``i`` (checked on the rows)."""
    width = len(gold[0])
    gold_values = [{row[i] for row in gold} for i in range(width)]
    predicted_values = [{row[j] for row in predicted} for j in range(width)]
    candidates = [[j for j in range(width) if predicted_values[j] <= gold_values[i]] for i in range(width)]
    orders_ = (p for p in itertools.product(*candidates) if len(set(p)) == width)
    return list(itertools.islice(orders_, MAX_PERMUTATIONS))


def results_equal(
    gold: Sequence[tuple[Any, ...]], predicted: Sequence[tuple[Any, ...]], *, ordered: bool
) -> bool:
    """Whether ``predicted`` is ``gold`` up to an order of its columns (module docstring)."""
    if not gold and not predicted:
        return True
    if len(gold) != len(predicted) or len(gold[0]) != len(predicted[0]):
        return False
    if any(len(row) != len(gold[0]) for row in (*gold, *predicted)):
        return False
    target = list(gold) if ordered else collections.Counter(gold)
    for permutation in _permutations(gold, predicted):
        rows = [tuple(row[j] for j in permutation) for row in predicted]
        if (rows if ordered else collections.Counter(rows)) == target:
            return True
    return False


def execution_match(database: Path, predicted: str | None, gold: str, *, timeout_s: float = 5.0) -> bool:
    """Spider's execution accuracy for one question: ``predicted`` (``None``: no query) returns ``gold``'s
    result on ``database``. A predicted query that fails is wrong; a gold query that fails raises (the
    data build excludes those)."""
    expected = run_query(database, gold, timeout_s=60.0)
    if predicted is None:
        return False
    try:
        got = run_query(database, predicted, timeout_s=timeout_s)
    except QueryError:
        return False
    return results_equal(expected, got, ordered=orders(gold))
