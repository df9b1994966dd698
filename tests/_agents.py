"""The conformance agents: the same two scenarios written idiomatically in each framework.

``single``: one agent, ``solver``, with tools ``add`` and ``divide``; it calls ``add(2, 3)``, then
``divide(1, 0)`` (which raises), then answers. ``multi``: a ``triage`` agent hands over to the solver
(LangGraph: two graph nodes; Agents SDK: a handoff; AutoGen: a swarm team).

Each runner takes the rollout's base URL, the question and the framework-specific extras (LangChain
callbacks) and returns the final answer the framework produced. :func:`scenario_script`, the script of
the :class:`~agl_core.testing.ScriptedBackend` behind the gateway, decides the replies.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agl_core.testing import tool_call

SOLVER_PROMPT = "ROLE=solver You solve arithmetic with your tools."
TRIAGE_PROMPT = "ROLE=triage You route questions to the right agent."
AUTOGEN_MODEL_INFO = {
    "vision": False,
    "function_calling": True,
    "json_output": False,
    "family": "unknown",
    "structured_output": False,
}


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def divide(a: int, b: int) -> float:
    """Divide a by b."""
    return a / b


# --- LangChain / LangGraph ----------------------------------------------------------------------------
_LANGCHAIN_TOOLS: list[Any] = []
_LANGCHAIN_TOOLS_LOCK = threading.Lock()


def _langchain_tools() -> list[Any]:
    """The tools, made once: langchain_core's ``tool()`` silences a pydantic deprecation warning with
    ``warnings.catch_warnings()``, which is not thread-safe, so tools made by concurrent rollouts let the
    warning through another thread's window (an error under the suite's ``filterwarnings = error``)."""
    from langchain_core.tools import tool

    with _LANGCHAIN_TOOLS_LOCK:
        if not _LANGCHAIN_TOOLS:
            _LANGCHAIN_TOOLS.extend([tool(add), tool(divide)])
        return list(_LANGCHAIN_TOOLS)


def _langchain_solver(base_url: str) -> Any:
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import ToolNode, create_react_agent

    llm = ChatOpenAI(base_url=base_url, api_key="x", model="tiny", max_retries=0)
    tools = ToolNode(_langchain_tools(), handle_tool_errors=True)
    return llm, create_react_agent(llm, tools, prompt=SOLVER_PROMPT, name="solver")


def langchain_single(base_url: str, question: str, callbacks: Sequence[Any]) -> str:
    _, solver = _langchain_solver(base_url)
    out = solver.invoke({"messages": [("user", question)]}, config={"callbacks": list(callbacks)})
    return str(out["messages"][-1].content)


def langchain_multi(base_url: str, question: str, callbacks: Sequence[Any]) -> str:
    from langgraph.graph import END, START, MessagesState, StateGraph

    llm, solver = _langchain_solver(base_url)

    def triage(state: MessagesState) -> dict[str, Any]:
        return {"messages": [llm.invoke([("system", TRIAGE_PROMPT), *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("triage", triage)
    graph.add_node("solver", solver)
    graph.add_edge(START, "triage")
    graph.add_edge("triage", "solver")
    graph.add_edge("solver", END)
    out = graph.compile().invoke({"messages": [("user", question)]}, config={"callbacks": list(callbacks)})
    return str(out["messages"][-1].content)


# --- OpenAI Agents SDK --------------------------------------------------------------------------------
def _openai_agents(base_url: str) -> tuple[Any, Any]:
    from agents import Agent, OpenAIChatCompletionsModel, function_tool
    from openai import AsyncOpenAI

    model = OpenAIChatCompletionsModel(
        model="tiny", openai_client=AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    )
    solver = Agent(
        name="solver",
        instructions=SOLVER_PROMPT,
        model=model,
        tools=[function_tool(add), function_tool(divide)],
    )
    triage = Agent(name="triage", instructions=TRIAGE_PROMPT, model=model, handoffs=[solver])
    return solver, triage


async def openai_agents_single_async(base_url: str, question: str) -> str:
    from agents import Runner

    solver, _ = _openai_agents(base_url)
    return str((await Runner.run(solver, question)).final_output)


async def openai_agents_multi_async(base_url: str, question: str) -> str:
    from agents import Runner

    _, triage = _openai_agents(base_url)
    return str((await Runner.run(triage, question)).final_output)


# --- AutoGen AgentChat --------------------------------------------------------------------------------
def _autogen_solver(base_url: str) -> tuple[Any, Any]:
    from autogen_agentchat.agents import AssistantAgent
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    client = OpenAIChatCompletionClient(
        model="tiny", base_url=base_url, api_key="x", model_info=AUTOGEN_MODEL_INFO, max_retries=0
    )
    solver = AssistantAgent(
        "solver",
        client,
        tools=[add, divide],
        system_message=SOLVER_PROMPT,
        reflect_on_tool_use=True,
        max_tool_iterations=3,
    )
    return client, solver


async def autogen_single_async(base_url: str, question: str) -> str:
    _, solver = _autogen_solver(base_url)
    result = await solver.run(task=question)
    return str(result.messages[-1].content)


def autogen_team(kind: str, base_url: str) -> Any:
    """A two-agent team of the given kind (``swarm``, ``round_robin``, ``selector``)."""
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.conditions import MaxMessageTermination, TextMentionTermination
    from autogen_agentchat.teams import RoundRobinGroupChat, SelectorGroupChat, Swarm

    client, solver = _autogen_solver(base_url)
    stop = TextMentionTermination("answer is") | MaxMessageTermination(12)
    if kind == "swarm":
        triage = AssistantAgent("triage", client, handoffs=["solver"], system_message=TRIAGE_PROMPT)
        return Swarm([triage, solver], termination_condition=stop)
    triage = AssistantAgent("triage", client, system_message=TRIAGE_PROMPT)
    if kind == "round_robin":
        return RoundRobinGroupChat([triage, solver], termination_condition=stop)
    return SelectorGroupChat(
        [triage, solver], model_client=client, termination_condition=stop, allow_repeated_speaker=True
    )


async def autogen_team_async(kind: str, base_url: str, question: str) -> str:
    result = await autogen_team(kind, base_url).run(task=question)
    return str(result.messages[-1].content)


def _sync(fn: Callable[..., Any]) -> Callable[[str, str, Sequence[Any]], str]:
    def run(base_url: str, question: str, callbacks: Sequence[Any]) -> str:
        return asyncio.run(fn(base_url, question))

    return run


#: ``RUNNERS[framework][scenario](base_url, question, callbacks) -> final answer``.
RUNNERS: dict[str, dict[str, Callable[[str, str, Sequence[Any]], str]]] = {
    "langchain": {"single": langchain_single, "multi": langchain_multi},
    "openai_agents": {"single": _sync(openai_agents_single_async), "multi": _sync(openai_agents_multi_async)},
    "autogen": {
        "single": _sync(autogen_single_async),
        "multi": _sync(lambda url, q: autogen_team_async("swarm", url, q)),
    },
}
#: The same, as coroutines, for the frameworks that are asyncio-native.
ASYNC_SINGLE = {"openai_agents": openai_agents_single_async, "autogen": autogen_single_async}


# --- the scenario's policy ----------------------------------------------------------------------------
#: The solver's final answer.
FINAL_ANSWER = "The answer is 5."
#: What the triage agent says when the framework gives it no handoff tool (it routes by text).
ROUTE_TEXT = "ROUTE solver"


def _called_tools(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    names = []
    for m in messages:
        for call in m.get("tool_calls") or []:
            names.append((call.get("function") or {}).get("name", ""))
    return names


def scenario_script(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> str:
    """Two agents. ``ROLE=triage`` hands over to the solver (with a ``transfer_to_*`` tool when it has one).
    ``ROLE=solver`` calls ``add(2, 3)``, then ``divide(1, 0)`` (which fails), then answers.
    A prompt asking to pick the next speaker (a selector team) gets the solver's name."""
    system = " ".join(str(m.get("content") or "") for m in messages if m.get("role") == "system")
    tool_names = [(t.get("function") or {}).get("name", "") for t in tools or []]
    if (
        "select the next role" in system.lower()
        or "select the next role" in str(messages[-1].get("content", "")).lower()
    ):
        return "solver"
    if "ROLE=triage" in system:
        handoff = next((n for n in tool_names if n.startswith("transfer_to_")), None)
        return tool_call(handoff, {}) if handoff else ROUTE_TEXT
    called = _called_tools(messages)
    if "add" not in called:
        return tool_call("add", {"a": 2, "b": 3})
    if "divide" not in called:
        return tool_call("divide", {"a": 1, "b": 0})
    return FINAL_ANSWER
