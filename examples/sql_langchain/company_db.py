"""The example's company database: three small tables, generated deterministically, and safe query execution.

``database_path()`` builds ``company.sqlite`` next to this file on first use (from a fixed seed, so every
machine gets the same rows); ``run_query`` executes one SELECT read-only with a row and time budget, and
``same_result`` compares two results as multisets of rows (execution accuracy).
"""

from __future__ import annotations

import os
import random
import sqlite3
import tempfile
from collections import Counter
from pathlib import Path

__all__ = ["SCHEMA", "QueryError", "database_path", "normalize", "run_query", "same_result"]

HERE = Path(__file__).resolve().parent
DB_NAME = "company.sqlite"
SEED = 20240611

DEPARTMENTS = ["Sales", "Marketing", "Engineering", "Finance", "Support"]
CITIES = ["Boston", "Chicago", "Denver", "Seattle", "Austin"]
FIRST_NAMES = [
    "Alice",
    "Bob",
    "Carol",
    "David",
    "Emma",
    "Frank",
    "Grace",
    "Henry",
    "Irene",
    "Jack",
    "Karen",
    "Leo",
    "Maria",
    "Nick",
    "Olga",
    "Paul",
    "Quinn",
    "Rosa",
    "Sam",
    "Tina",
    "Umar",
    "Vera",
    "Walt",
    "Xena",
    "Yusuf",
    "Zoe",
    "Anna",
    "Ben",
    "Clara",
    "Dan",
    "Eva",
    "Fred",
    "Gina",
    "Hugo",
    "Ivy",
    "Jon",
    "Kim",
    "Liam",
    "Mia",
    "Noah",
]
CUSTOMERS = ["Acme", "Globex", "Initech", "Umbrella", "Hooli", "Stark", "Wayne", "Wonka"]
PRODUCTS = ["laptop", "monitor", "keyboard", "mouse", "printer", "desk"]
STATUSES = ["shipped", "pending", "cancelled"]

#: The schema as the agents see it: one line per table.
SCHEMA = {
    "employees": "employees(id, name, department, age, salary, city)",
    "departments": "departments(id, name, budget, floor)",
    "orders": "orders(id, customer, product, quantity, price, status)",
}

_DDL = [
    "CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT NOT NULL, department TEXT NOT NULL,"
    " age INTEGER NOT NULL, salary INTEGER NOT NULL, city TEXT NOT NULL)",
    "CREATE TABLE departments (id INTEGER PRIMARY KEY, name TEXT NOT NULL, budget INTEGER NOT NULL,"
    " floor INTEGER NOT NULL)",
    "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT NOT NULL, product TEXT NOT NULL,"
    " quantity INTEGER NOT NULL, price INTEGER NOT NULL, status TEXT NOT NULL)",
]

#: SQLite virtual-machine steps a query may take before it is stopped (a cross join of all tables is far
#: below).
_MAX_VM_STEPS = 5_000_000
_MAX_ROWS = 1000


def rows() -> dict[str, list[tuple]]:
    """The table contents, the same on every call."""
    rng = random.Random(SEED)
    employees = []
    for i, name in enumerate(FIRST_NAMES, start=1):
        employees.append(
            (
                i,
                name,
                DEPARTMENTS[(i - 1) % len(DEPARTMENTS)] if i <= 10 else rng.choice(DEPARTMENTS),
                rng.randint(22, 64),
                rng.randrange(40_000, 130_001, 500),
                rng.choice(CITIES),
            )
        )
    departments = [
        (i, name, rng.randrange(100_000, 1_000_001, 10_000), rng.randint(1, 9))
        for i, name in enumerate(DEPARTMENTS, start=1)
    ]
    orders = [
        (
            i,
            rng.choice(CUSTOMERS),
            rng.choice(PRODUCTS),
            rng.randint(1, 20),
            rng.randrange(20, 2001, 10),
            rng.choice(STATUSES),
        )
        for i in range(1, 49)
    ]
    return {"employees": employees, "departments": departments, "orders": orders}


def build(path: Path) -> None:
    """Write the database to ``path`` (atomically: a concurrent reader never sees a half-built file)."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    os.close(fd)
    try:
        conn = sqlite3.connect(tmp)
        try:
            for ddl in _DDL:
                conn.execute(ddl)
            for table, values in rows().items():
                marks = ",".join("?" * len(values[0]))
                conn.executemany(f"INSERT INTO {table} VALUES ({marks})", values)
            conn.commit()
        finally:
            conn.close()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def database_path(directory: Path | None = None) -> Path:
    """``company.sqlite`` in ``directory`` (this example's folder by default), built on first use."""
    path = (directory or HERE) / DB_NAME
    if not path.is_file():
        build(path)
    return path


class QueryError(Exception):
    """The query could not be run; the message is SQLite's (or says which limit it hit)."""


def run_query(sql: str, path: Path | None = None) -> list[tuple]:
    """The rows of ``sql`` on the database, opened read-only; raises :class:`QueryError` on any failure."""
    conn = sqlite3.connect(f"file:{path or database_path()}?mode=ro", uri=True, check_same_thread=False)
    steps = 0

    def budget() -> int:
        nonlocal steps
        steps += 1000
        return 1 if steps > _MAX_VM_STEPS else 0

    conn.set_progress_handler(budget, 1000)
    try:
        cursor = conn.execute(sql)
        result = cursor.fetchmany(_MAX_ROWS + 1)
    except sqlite3.Error as exc:  # also sqlite3.Warning-free: one statement only, else ProgrammingError
        message = "query took too long" if steps > _MAX_VM_STEPS else str(exc)
        raise QueryError(message) from None
    except (ValueError, OverflowError) as exc:
        raise QueryError(str(exc)) from None
    finally:
        conn.close()
    if len(result) > _MAX_ROWS:
        raise QueryError(f"query returned more than {_MAX_ROWS} rows")
    return result


def normalize(result: list[tuple] | list[list]) -> Counter:
    """Rows as a multiset; numbers compared as floats rounded to 2 decimals (so 5 == 5.0)."""

    def cell(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return v
        return round(float(v), 2)

    return Counter(tuple(cell(v) for v in row) for row in result)


def same_result(predicted: list[tuple] | list[list], gold: list[tuple] | list[list]) -> bool:
    """Execution accuracy: the same rows, in any order, with the same multiplicities."""
    return normalize(predicted) == normalize(gold)
