"""A LangGraph text-to-SQL agent on Spider's databases, made trainable by one callback.

The graph: ``writer`` sees the database's schema (its ``CREATE TABLE`` statements) and the question and
writes one SQLite query; ``run_sql`` (a LangChain tool) runs it on the database, read-only; when it fails
or returns nothing and a revision is left, ``reviser`` sees the query and what went wrong and writes
another, which is run again; the last query that ran is the answer.

The reward is Spider's execution accuracy of the answer (``spider_eval.execution_match``): 1 when its
result is the gold query's, else 0; the held-out score is that and nothing else. While training (not when
the trainer evaluates), an answer that is wrong but ran earns ``PARTIAL_RUNS`` (0.1) instead of 0: partial
credit for valid SQL, which gives a group whose answers are all wrong something to learn from (set it to 0
for accuracy alone).
"""

from __future__ import annotations

import functools
import re
import sqlite3
import sys
from pathlib import Path
from typing import Any, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from agl_langchain import AglCallbackHandler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spider_data import check, database_path  # noqa: E402
from spider_eval import QueryError, execution_match, run_query  # noqa: E402

check()  # the data cache, verified on import: a missing or corrupt one stops the run before it starts

#: Revisions after the first query at most.
MAX_REVISIONS = 1
#: Sampling temperature while training (the trainer evaluates greedily).
TEMPERATURE = 0.8
MAX_TOKENS = 96
#: Each call stops at the end of its first statement: the answer is one query (``extract_sql`` cuts there
#: too), and a reply cannot run on past it (RL without this stop learned to fill all 96 tokens).
STOP = [";"]
#: Partial credit for a wrong answer that ran, while training (module docstring).
PARTIAL_RUNS = 0.1
#: Seconds a query may run.
QUERY_TIMEOUT_S = 5.0

WRITER_SYSTEM = (
    "You write SQLite queries. Answer the user's question about the database below with one SQL query."
    " Reply with the query only.\n\n{schema}"
)
REVISER_SYSTEM = (
    "You fix SQLite queries. The query below did not answer the user's question about this database."
    " Reply with a corrected query only.\n\n{schema}"
)


@functools.cache
def schema_text(db_id: str) -> str:
    """The database's ``CREATE TABLE`` statements, as SQLite stores them."""
    with sqlite3.connect(f"file:{database_path(db_id)}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT sql FROM sqlite_master WHERE type = 'table' ORDER BY rowid").fetchall()
    return ";\n".join(sql for (sql,) in rows if sql) + ";"


_FENCE = re.compile(r"```(?:sql|sqlite)?", re.IGNORECASE)
_START = re.compile(r"\b(select|with)\b", re.IGNORECASE)


def extract_sql(text: str) -> str | None:
    """The first ``SELECT`` (or ``WITH``) statement in a reply: code fences dropped, cut at ``;`` or a
    blank line, whitespace collapsed."""
    text = _FENCE.sub("\n\n", text)
    match = _START.search(text)
    if match is None:
        return None
    sql = text[match.start() :]
    for end in (";", "\n\n"):
        sql = sql.split(end, 1)[0]
    return " ".join(sql.split()) or None


@tool
def run_sql(db_id: str, query: str) -> str:
    """Run a read-only SQLite query on a Spider database; the first rows, or the error."""
    try:
        rows = run_query(database_path(db_id), query, timeout_s=QUERY_TIMEOUT_S)
    except QueryError as exc:
        return f"error: {exc}"
    if not rows:
        return "no rows"
    shown = "; ".join(str(row) for row in rows[:5])
    return f"{len(rows)} rows: {shown}" + (" ..." if len(rows) > 5 else "")


class State(TypedDict, total=False):
    task: dict
    query: str | None
    #: The query that last ran without error, and what ``run_sql`` said of the last one.
    answer: str | None
    result: str
    revisions: int


def build_graph(model: ChatOpenAI):
    def ask(system: str, user: str, config: RunnableConfig) -> str:
        reply = model.invoke(
            [SystemMessage(system), HumanMessage(user)], config=config, max_tokens=MAX_TOKENS, stop=STOP
        )
        return reply.content if isinstance(reply.content, str) else str(reply.content)

    def writer(state: State, config: RunnableConfig) -> State:
        task = state["task"]
        reply = ask(WRITER_SYSTEM.format(schema=schema_text(task["db_id"])), task["question"], config)
        return {"query": extract_sql(reply), "revisions": 0}

    def execute(state: State, config: RunnableConfig) -> State:
        query = state.get("query")
        if query is None:
            return {"result": "error: the reply holds no SELECT statement"}
        result = run_sql.invoke({"db_id": state["task"]["db_id"], "query": query}, config=config)
        update: State = {"result": result}
        if not result.startswith("error:"):
            update["answer"] = query
        return update

    def reviser(state: State, config: RunnableConfig) -> State:
        task = state["task"]
        query = state.get("query") or "(none)"
        user = f"Question: {task['question']}\nQuery: {query}\nResult: {state['result']}"
        reply = ask(REVISER_SYSTEM.format(schema=schema_text(task["db_id"])), user, config)
        return {"query": extract_sql(reply), "revisions": state.get("revisions", 0) + 1}

    def route(state: State) -> str:
        result = state["result"]
        failed = result.startswith("error:") or result == "no rows"
        return "reviser" if failed and state.get("revisions", 0) < MAX_REVISIONS else END

    graph = StateGraph(State)
    graph.add_node("writer", writer)
    graph.add_node("run_sql", execute)
    graph.add_node("reviser", reviser)
    graph.add_edge(START, "writer")
    graph.add_edge("writer", "run_sql")
    graph.add_conditional_edges("run_sql", route, ["reviser", END])
    graph.add_edge("reviser", "run_sql")
    return graph.compile()


def run(task: dict, llm: Any) -> State:
    """Run the graph on one task; the final state."""
    training = not getattr(llm, "evaluating", False)
    model = ChatOpenAI(
        base_url=llm.base_url,
        api_key=llm.api_key,
        model=llm.model,
        temperature=TEMPERATURE if training else 0.0,
        max_retries=0,
    )
    graph = build_graph(model)
    return graph.invoke({"task": task}, config={"callbacks": [AglCallbackHandler()]})


def solve(task: dict, llm: Any) -> float:
    """Spider's execution accuracy of the agent's answer, 1.0 or 0.0; while training, 0.1 for a wrong
    answer that ran."""
    final = run(task, llm)
    if execution_match(database_path(task["db_id"]), final.get("answer"), task["gold"]):
        return 1.0
    training = not getattr(llm, "evaluating", False)
    return PARTIAL_RUNS if training and final.get("answer") is not None else 0.0
