"""A policy per agent with the real frameworks: three agents written in LangGraph, the OpenAI Agents SDK or
AutoGen talk HTTP to the real gateway (hf backend serving LoRA adapters of the tiny model) through the real
runner and store, and name themselves only through agl's adapter (the ``x-agl-agent-name`` header: the
rollout's base URL names no agent). Each agent's calls must be served by its own policy's adapter from the
first call and train that adapter only; a policy whose agents made no call must not move."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agl_trainer import Trainer

from ._agents import AUTOGEN_MODEL_INFO
from ._training import TINY_JOB, Turns, served_by

for module in ("langchain_openai", "langgraph", "agents", "autogen_agentchat", "autogen_ext.models.openai"):
    pytest.importorskip(module)

#: The agents of each system, in the order they speak; ``checker`` belongs to no policy (the base model).
AGENTS = ("writer", "rewriter", "checker")
POLICIES = [
    {"name": "writer", "agents": ["writer"]},
    {"name": "rewriter", "agents": ["re*"]},
    {"name": "idle", "agents": ["nobody"]},
]
CONFIG: dict[str, Any] = {**TINY_JOB, "runner": {"workers": 2, "mode": "thread"}, "policies": POLICIES}
TASKS = [{"id": f"t{i}", "q": f"Fix the query number {i}."} for i in range(2)]


def _langgraph(task: dict[str, Any], llm: Any) -> None:
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph

    from agl_langchain import AglCallbackHandler

    model = ChatOpenAI(
        base_url=llm.base_url, api_key=llm.api_key, model=llm.model, max_tokens=3, max_retries=0
    )

    def node(name: str) -> Callable[[MessagesState], dict[str, Any]]:
        def run(state: MessagesState) -> dict[str, Any]:
            return {"messages": [model.invoke([("system", f"You are the {name}."), *state["messages"]])]}

        return run

    graph = StateGraph(MessagesState)
    previous = START
    for name in AGENTS:  # the node names are the agent names
        graph.add_node(name, node(name))
        graph.add_edge(previous, name)
        previous = name
    graph.add_edge(previous, END)
    graph.compile().invoke({"messages": [("user", task["q"])]}, config={"callbacks": [AglCallbackHandler()]})


def _openai_agents(task: dict[str, Any], llm: Any) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner
    from openai import AsyncOpenAI

    async def run() -> None:
        async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
            model = OpenAIChatCompletionsModel(model=llm.model, openai_client=client)
            text = task["q"]
            for name in AGENTS:  # each agent works on the previous one's answer
                agent = Agent(
                    name=name,
                    instructions=f"You are the {name}.",
                    model=model,
                    model_settings=ModelSettings(max_tokens=3),
                )
                text = str((await Runner.run(agent, text)).final_output).strip() or "(nothing)"

    asyncio.run(run())


def _autogen(task: dict[str, Any], llm: Any) -> None:
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.conditions import MaxMessageTermination
    from autogen_agentchat.teams import RoundRobinGroupChat
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    async def run() -> None:
        client = OpenAIChatCompletionClient(
            model=llm.model,
            base_url=llm.base_url,
            api_key=llm.api_key,
            model_info=AUTOGEN_MODEL_INFO,
            max_retries=0,
            max_tokens=3,
        )
        try:
            team = RoundRobinGroupChat(
                [AssistantAgent(name, client, system_message=f"You are the {name}.") for name in AGENTS],
                termination_condition=MaxMessageTermination(1 + len(AGENTS)),  # the task, then one turn each
            )
            await team.run(task=task["q"])
        finally:
            await client.close()

    asyncio.run(run())


SYSTEMS: dict[str, Callable[[dict[str, Any], Any], None]] = {
    "langgraph": _langgraph,
    "openai_agents": _openai_agents,
    "autogen": _autogen,
}


@pytest.fixture
def framework(request: pytest.FixtureRequest) -> Iterator[str]:
    """The framework of the test's parameter, instrumented as its users do (LangChain: the callback in
    the agent's code)."""
    import agl_autogen
    import agl_openai_agents

    name: str = request.param
    adapter = {"openai_agents": agl_openai_agents, "autogen": agl_autogen}.get(name)
    if name == "openai_agents":
        agl_openai_agents.instrument(replace_processors=True)
    elif adapter is not None:
        adapter.instrument()
    try:
        yield name
    finally:
        if adapter is not None:
            adapter.uninstrument()
        else:
            from agl_core.capture import agent_header

            agent_header.uninstall_httpx_hook("langchain")  # installed by the handler's first call


def _lora_b(checkpoint: Path, policy: str) -> torch.Tensor:
    from safetensors.torch import load_file

    weights = load_file(str(checkpoint / "adapter" / policy / "adapter_model.safetensors"))
    return torch.cat([w.flatten() for name, w in sorted(weights.items()) if "lora_B" in name])


@pytest.mark.parametrize("framework", list(SYSTEMS), indirect=True)
def test_each_agent_is_served_by_and_trains_its_own_adapter(framework, tmp_path):
    turns = Turns()
    system = SYSTEMS[framework]

    def solve(task: dict[str, Any], llm: Any) -> float:
        system(task, llm)
        return turns.reward(task)

    result = Trainer({**CONFIG, "output_dir": str(tmp_path / "run")}).fit(solve, TASKS)

    served = served_by(tmp_path / "run" / "store.sqlite")
    # every call, each agent's first included, went to its own policy's adapter (4 rollouts, 1 call each)
    assert served == {("writer", "writer"): 4, ("rewriter", "rewriter"): 4, ("checker", "base"): 4}

    (step,) = result.history
    assert step.policies is not None
    trained = {name: (row["calls"], row["trained"], row["updates"]) for name, row in step.policies.items()}
    assert trained == {"writer": (4, 4, 1), "rewriter": (4, 4, 1), "idle": (0, 0, 0), "base": (4, 0, 0)}
    assert result.checkpoint is not None
    writer, rewriter = _lora_b(result.checkpoint, "writer"), _lora_b(result.checkpoint, "rewriter")
    assert writer.abs().sum() > 0 and rewriter.abs().sum() > 0  # LoRA B starts at zero: both moved
    assert not torch.equal(writer, rewriter)  # each from its own agent's calls
    assert _lora_b(result.checkpoint, "idle").abs().sum() == 0  # no calls: untouched
