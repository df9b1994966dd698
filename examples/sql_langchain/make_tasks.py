"""Writes train.jsonl, val.jsonl and dev.jsonl: questions from templates over the company database.

Every (template, value) pair is one task; its gold answer is the result of executing its gold SQL. Pairs
whose gold result is empty (or a count of 0) are left out, so an empty result is never right by accident.
The pairs are shuffled with a fixed seed and split: ``val`` (100) and ``train`` (200) share no pair, and
``dev`` is the first 40 tasks of ``train`` (for choosing settings without looking at ``val``).

    python examples/sql_langchain/make_tasks.py
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from company_db import CITIES, CUSTOMERS, DEPARTMENTS, PRODUCTS, STATUSES, database_path, run_query  # noqa: E402

N_VAL, N_TRAIN, N_DEV = 100, 200, 40
SEED = 11

AGES = list(range(25, 61))
SALARIES = list(range(45_000, 125_001, 2_500))
QUANTITIES = list(range(2, 19))
PRICES = list(range(200, 1801, 100))

#: (template id, table, question, gold SQL, values); ``{v}`` is the value in both.
TEMPLATES: list[tuple[str, str, str, str, list]] = [
    (
        "emp_count_dept",
        "employees",
        "How many employees work in {v}?",
        "SELECT COUNT(*) FROM employees WHERE department = '{v}'",
        DEPARTMENTS,
    ),
    (
        "emp_count_city",
        "employees",
        "How many employees live in {v}?",
        "SELECT COUNT(*) FROM employees WHERE city = '{v}'",
        CITIES,
    ),
    (
        "emp_names_dept",
        "employees",
        "List the names of employees who work in {v}.",
        "SELECT name FROM employees WHERE department = '{v}'",
        DEPARTMENTS,
    ),
    (
        "emp_names_city",
        "employees",
        "List the names of employees who live in {v}.",
        "SELECT name FROM employees WHERE city = '{v}'",
        CITIES,
    ),
    (
        "emp_names_older",
        "employees",
        "List the names of employees older than {v}.",
        "SELECT name FROM employees WHERE age > {v}",
        AGES,
    ),
    (
        "emp_names_younger",
        "employees",
        "List the names of employees younger than {v}.",
        "SELECT name FROM employees WHERE age < {v}",
        AGES,
    ),
    (
        "emp_count_older",
        "employees",
        "How many employees are older than {v}?",
        "SELECT COUNT(*) FROM employees WHERE age > {v}",
        AGES,
    ),
    (
        "emp_count_younger",
        "employees",
        "How many employees are younger than {v}?",
        "SELECT COUNT(*) FROM employees WHERE age < {v}",
        AGES,
    ),
    (
        "emp_names_salary_gt",
        "employees",
        "List the names of employees with a salary greater than {v}.",
        "SELECT name FROM employees WHERE salary > {v}",
        SALARIES,
    ),
    (
        "emp_count_salary_lt",
        "employees",
        "How many employees have a salary less than {v}?",
        "SELECT COUNT(*) FROM employees WHERE salary < {v}",
        SALARIES,
    ),
    (
        "emp_avg_salary_dept",
        "employees",
        "What is the average salary of employees in {v}?",
        "SELECT AVG(salary) FROM employees WHERE department = '{v}'",
        DEPARTMENTS,
    ),
    (
        "emp_max_salary_dept",
        "employees",
        "What is the highest salary in {v}?",
        "SELECT MAX(salary) FROM employees WHERE department = '{v}'",
        DEPARTMENTS,
    ),
    (
        "dept_budget",
        "departments",
        "What is the budget of the {v} department?",
        "SELECT budget FROM departments WHERE name = '{v}'",
        DEPARTMENTS,
    ),
    (
        "dept_floor",
        "departments",
        "On which floor is the {v} department?",
        "SELECT floor FROM departments WHERE name = '{v}'",
        DEPARTMENTS,
    ),
    (
        "ord_count_status",
        "orders",
        "How many orders have the status {v}?",
        "SELECT COUNT(*) FROM orders WHERE status = '{v}'",
        STATUSES,
    ),
    (
        "ord_count_customer",
        "orders",
        "How many orders did {v} place?",
        "SELECT COUNT(*) FROM orders WHERE customer = '{v}'",
        CUSTOMERS,
    ),
    (
        "ord_ids_customer",
        "orders",
        "List the ids of orders placed by {v}.",
        "SELECT id FROM orders WHERE customer = '{v}'",
        CUSTOMERS,
    ),
    (
        "ord_sum_quantity_product",
        "orders",
        "What is the total quantity of {v} ordered?",
        "SELECT SUM(quantity) FROM orders WHERE product = '{v}'",
        PRODUCTS,
    ),
    (
        "ord_count_quantity_gt",
        "orders",
        "How many orders have a quantity greater than {v}?",
        "SELECT COUNT(*) FROM orders WHERE quantity > {v}",
        QUANTITIES,
    ),
    (
        "ord_ids_price_gt",
        "orders",
        "List the ids of orders with a price greater than {v}.",
        "SELECT id FROM orders WHERE price > {v}",
        PRICES,
    ),
]


def instances() -> list[dict]:
    """Every (template, value) task whose gold result is not empty, in template order."""
    path = database_path()
    out = []
    for template, table, question, sql, values in TEMPLATES:
        for value in values:
            gold_sql = sql.format(v=value)
            answer = run_query(gold_sql, path)
            if not answer or answer == [(0,)] or answer == [(None,)]:
                continue
            out.append(
                {
                    "id": f"{template}-{value}",
                    "template": template,
                    "table": table,
                    "question": question.format(v=value),
                    "gold_sql": gold_sql,
                    "answer": [list(row) for row in answer],
                }
            )
    return out


def main() -> None:
    tasks = instances()
    random.Random(SEED).shuffle(tasks)
    if len(tasks) < N_VAL + N_TRAIN:
        raise SystemExit(f"only {len(tasks)} template instances; need {N_VAL + N_TRAIN}")
    val, train = tasks[:N_VAL], tasks[N_VAL : N_VAL + N_TRAIN]
    for name, split in (("val", val), ("train", train), ("dev", train[:N_DEV])):
        with (HERE / f"{name}.jsonl").open("w") as fh:
            for task in split:
                fh.write(json.dumps(task) + "\n")
    print(f"{len(tasks)} template instances: {len(train)} train ({N_DEV} of them dev), {len(val)} val")


if __name__ == "__main__":
    main()
