"""A LangGraph text-to-SQL agent with three agents, made trainable by one callback.

``writer`` writes a SQLite query for the question, ``checker`` runs it on the company database and judges
it (``error``, ``empty`` or ``looks fine``; for the first two, when a rewrite is left, it asks the model
what to fix), and ``rewriter`` rewrites the query from that feedback; the loop stops when the query looks
fine or after ``MAX_REWRITES`` rewrites. The agent names the trainer sees are the graph's node names, so the
config can train ``writer`` and ``rewriter`` and leave ``checker``'s calls out (``algorithm.agents``).

The reward is execution accuracy: 1 when the final query's rows equal the gold rows as a multiset, else 0.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TypedDict

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from agl_langchain import AglCallbackHandler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from company_db import SCHEMA, QueryError, run_query, same_result  # noqa: E402

#: Rewrites after the first query at most (each one is checked again).
MAX_REWRITES = 1
#: Sampling temperature of every call (the trainer needs varied attempts per task).
TEMPERATURE = 0.7
MAX_TOKENS = {"writer": 32, "checker": 16, "rewriter": 32}

WRITER_SYSTEM = "Write one SQLite query that answers the question. Reply with the query only."
CHECKER_SYSTEM = "Say in one short sentence what is wrong with this SQLite query."
REWRITER_SYSTEM = "Fix the SQLite query. Reply with the corrected query only."
#: Worked examples per table, shown to the writer and the rewriter (questions unlike the task templates).
EXAMPLES = {
    "employees": [
        ("How many employees are 30 years old?", "SELECT COUNT(*) FROM employees WHERE age = 30;"),
        ("What is the salary of Alice?", "SELECT salary FROM employees WHERE name = 'Alice';"),
    ],
    "orders": [
        ("How many orders have a price less than 100?", "SELECT COUNT(*) FROM orders WHERE price < 100;"),
        (
            "List the customers of orders with the status shipped.",
            "SELECT customer FROM orders WHERE status = 'shipped';",
        ),
    ],
    "departments": [
        ("How many departments are on floor 3?", "SELECT COUNT(*) FROM departments WHERE floor = 3;"),
        ("What is the budget of department 2?", "SELECT budget FROM departments WHERE id = 2;"),
    ],
}


def tables(task: dict) -> list[str]:
    """The tables the agents are shown: the task's table when it names one (the simplified CPU variant),
    else all of them."""
    return [task["table"]] if task.get("table") in SCHEMA else list(SCHEMA)


def schema_text(task: dict) -> str:
    return "\n".join(f"Table: {SCHEMA[t]}" for t in tables(task))


def few_shot(task: dict) -> list:
    """Question / query turns for the task's tables."""
    messages: list = []
    for table in tables(task):
        for question, sql in EXAMPLES[table]:
            messages += [HumanMessage(question), AIMessage(sql)]
    return messages


_FENCE = re.compile(r"```(?:sql|sqlite)?", re.IGNORECASE)
_SELECT = re.compile(r"\bselect\b", re.IGNORECASE)


def extract_sql(text: str) -> str | None:
    """The first SELECT statement in a reply: code fences dropped, cut at ``;``, a blank line or a fence."""
    text = _FENCE.sub("\n\n", text)
    match = _SELECT.search(text)
    if match is None:
        return None
    sql = text[match.start() :]
    for end in (";", "\n\n"):
        sql = sql.split(end, 1)[0]
    sql = " ".join(sql.split())
    return sql or None


class State(TypedDict, total=False):
    task: dict
    query: str | None
    verdict: str  # "error", "empty" or "looks fine"
    detail: str  # the error message, or a sample of the rows
    feedback: str
    rows: list
    rewrites: int
    #: (agent, reply) of every LLM call, in order.
    replies: list


def execute(query: str | None) -> tuple[str, str, list]:
    """(verdict, detail, rows) of running ``query``."""
    if query is None:
        return "error", "the reply contains no SELECT statement", []
    try:
        rows = run_query(query)
    except QueryError as exc:
        return "error", str(exc), []
    if not rows:
        return "empty", "the query returned no rows", []
    return "looks fine", f"{len(rows)} rows, first: {rows[0]}", rows


def build_graph(model: ChatOpenAI):
    """The compiled three-node graph; ``model`` serves all three agents."""

    def call(agent: str, messages: list) -> str:
        reply = model.invoke(
            messages, max_tokens=MAX_TOKENS[agent], stop=[";"] if agent != "checker" else None
        )
        return reply.content if isinstance(reply.content, str) else str(reply.content)

    def writer(state: State) -> State:
        task = state["task"]
        messages = [
            SystemMessage(f"{WRITER_SYSTEM}\n{schema_text(task)}"),
            *few_shot(task),
            HumanMessage(task["question"]),
        ]
        reply = call("writer", messages)
        return {"query": extract_sql(reply), "rewrites": 0, "replies": [("writer", reply)]}

    def checker(state: State) -> State:
        verdict, detail, rows = execute(state.get("query"))
        update: State = {"verdict": verdict, "detail": detail, "rows": rows, "feedback": ""}
        if verdict != "looks fine" and state.get("rewrites", 0) < MAX_REWRITES:
            task = state["task"]
            reply = call(
                "checker",
                [
                    SystemMessage(f"{CHECKER_SYSTEM}\n{schema_text(task)}"),
                    HumanMessage(
                        f"Question: {task['question']}\nQuery: {state.get('query') or '(none)'}\n"
                        f"Result: {detail}"
                    ),
                ],
            )
            update["feedback"] = reply.strip()
            update["replies"] = [*state.get("replies", []), ("checker", reply)]
        return update

    def rewriter(state: State) -> State:
        task = state["task"]
        reply = call(
            "rewriter",
            [
                SystemMessage(f"{REWRITER_SYSTEM}\n{schema_text(task)}"),
                *few_shot(task),
                HumanMessage(
                    f"{task['question']}\nWrong query: {state.get('query') or '(none)'}\n"
                    f"Problem: {state['detail']}. {state['feedback']}"
                ),
            ],
        )
        return {
            "query": extract_sql(reply),
            "rewrites": state.get("rewrites", 0) + 1,
            "replies": [*state.get("replies", []), ("rewriter", reply)],
        }

    def route(state: State) -> str:
        if state["verdict"] == "looks fine" or state.get("rewrites", 0) >= MAX_REWRITES:
            return END
        return "rewriter"

    graph = StateGraph(State)
    graph.add_node("writer", writer)
    graph.add_node("checker", checker)
    graph.add_node("rewriter", rewriter)
    graph.add_edge(START, "writer")
    graph.add_edge("writer", "checker")
    graph.add_conditional_edges("checker", route, ["rewriter", END])
    graph.add_edge("rewriter", "checker")
    return graph.compile()


def run(task: dict, llm) -> State:
    """Run the graph on one task; the final state (query, verdict, rows, rewrites)."""
    model = ChatOpenAI(
        base_url=llm.base_url, api_key=llm.api_key, model=llm.model, temperature=TEMPERATURE, max_retries=0
    )
    return build_graph(model).invoke({"task": task}, config={"callbacks": [AglCallbackHandler()]})


def solve(task: dict, llm) -> float:
    """Execution accuracy of the agent's final query: 1.0 or 0.0."""
    final = run(task, llm)
    if final.get("verdict") == "error":
        return 0.0
    return 1.0 if same_result(final.get("rows", []), task["answer"]) else 0.0
