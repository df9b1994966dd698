"""The calling agent's name on each model request (``x-agl-agent-name``,
:mod:`agl_core.capture.agent_header`).

Real frameworks (LangGraph, the Agents SDK, AutoGen) talk HTTP to a real local gateway in front of a
scripted policy; the gateway's spans say which agent each call named (``gen_ai.agent.name``, read from the
header: the base URLs here name no agent) and which agent's prompt it carried (``ROLE=...`` in its prompt
token ids). Every call, the first one included, must name its own agent; a gateway nobody registered must
get no name; concurrent tasks must not mix names; uninstrumenting takes the hook off httpx.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider

from agl_core import semconv
from agl_core.capture import agent_header
from agl_core.records import Attempt, Resource, Rollout, RolloutStatus
from agl_core.testing import ByteTokenizer, GatewayServer, ScriptedBackend

from . import _agents

for module in ("langchain_openai", "langgraph", "agents", "autogen_agentchat", "autogen_ext.models.openai"):
    pytest.importorskip(module)

QUESTION = "What is 2 + 3?"
FRAMEWORKS = ("langchain", "langchain_async", "langchain_callback", "openai_agents", "autogen")
#: Agents of the concurrency tests: each says only "done", slowly enough for the calls to overlap.
PARALLEL = [f"par-{i}" for i in range(4)]
_ROLE = re.compile(r"ROLE=([\w-]+)")
#: The HTTP client packages the hook goes on: httpx, and httpx2 (what recent openai / anthropic / Agents
#: SDK releases send with) where it is installed.
CLIENT_PACKAGES = [name for name in ("httpx", "httpx2") if importlib.util.find_spec(name) is not None]
_TOKENIZER = ByteTokenizer()


def _script(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> str:
    system = " ".join(str(m.get("content") or "") for m in messages if m.get("role") == "system")
    if "ROLE=par-" in system:
        time.sleep(0.05)
        return "done"
    return _agents.scenario_script(messages, tools)


def _gateway() -> GatewayServer:
    return GatewayServer(ScriptedBackend(_script, model_name="tiny"))


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayServer]:
    """A gateway registered as the runner registers its rollouts' gateway."""
    with _gateway() as gw:
        agent_header.register_gateway(gw.url)
        try:
            yield gw
        finally:
            agent_header.unregister_gateway(gw.url)


@pytest.fixture(scope="module")
def stranger() -> Iterator[GatewayServer]:
    """A gateway on an origin nobody registered: it must never be told agent names."""
    with _gateway() as gw:
        yield gw


@pytest.fixture(autouse=True)
def _no_hook_left() -> Iterator[None]:
    """Each test starts and ends with agl's httpx hook off."""
    import agl_langchain

    if not agl_langchain.is_instrumented():  # held by a handler an earlier test gave in ``callbacks``
        agent_header.uninstall_httpx_hook("langchain")
    assert not agent_header.httpx_hook_installed(), "an earlier test left an adapter instrumented"
    yield
    assert not agent_header.httpx_hook_installed(), "the test left agl's httpx hook installed"


def calls(gw: GatewayServer, rollout_id: str) -> list[tuple[str | None, str | None]]:
    """``(agent whose prompt the call carried, agent the call named)`` of each call of ``rollout_id``,
    in order."""
    found = []
    for span in gw.spans():
        attrs = span.attributes or {}
        if attrs.get(semconv.ROLLOUT_ID) != rollout_id:
            continue
        prompt = _TOKENIZER.decode(list(attrs[semconv.PROMPT_TOKEN_IDS]))  # type: ignore[arg-type]
        role = _ROLE.search(prompt)
        name = attrs.get(semconv.GEN_AI_AGENT_NAME)
        found.append((role.group(1) if role else None, str(name) if name is not None else None))
    return found


# --- the frameworks ----------------------------------------------------------------------------------
def _adapter(framework: str) -> Any:
    import agl_autogen
    import agl_langchain
    import agl_openai_agents

    if framework.startswith("langchain"):
        return agl_langchain
    return {"openai_agents": agl_openai_agents, "autogen": agl_autogen}[framework]


def _langchain_graph(base_url: str) -> Any:
    """``tests/_agents.langchain_multi``'s graph (a ``triage`` node, then the ``solver`` ReAct agent)."""
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph

    llm, solver = _agents._langchain_solver(base_url)
    assert isinstance(llm, ChatOpenAI)

    async def triage(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke([("system", _agents.TRIAGE_PROMPT), *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("triage", triage)
    graph.add_node("solver", solver)
    graph.add_edge(START, "triage")
    graph.add_edge("triage", "solver")
    graph.add_edge("solver", END)
    return graph.compile()


def _run_two_agents(framework: str, base_url: str) -> None:
    """One run of two agents: ``triage`` first, then ``solver`` (with tools)."""
    if framework == "langchain":
        _agents.langchain_multi(base_url, QUESTION, [])
    elif framework == "langchain_callback":
        from agl_langchain import AglCallbackHandler

        handler = AglCallbackHandler(tracer_provider=TracerProvider())
        _agents.langchain_multi(base_url, QUESTION, [handler])
    elif framework == "langchain_async":
        asyncio.run(_langchain_graph(base_url).ainvoke({"messages": [("user", QUESTION)]}))
    elif framework == "openai_agents":
        asyncio.run(_agents.openai_agents_multi_async(base_url, QUESTION))
    else:
        asyncio.run(_agents.autogen_team_async("round_robin", base_url, QUESTION))


@pytest.fixture
def instrumented(request: pytest.FixtureRequest) -> Iterator[str]:
    """The framework of the test's parameter, instrumented (``langchain_callback``: not instrumented,
    the handler is given in ``callbacks``)."""
    framework: str = request.param
    adapter = _adapter(framework)
    if framework != "langchain_callback":
        adapter.instrument(tracer_provider=TracerProvider())
    try:
        yield framework
    finally:
        adapter.uninstrument()
        if framework == "langchain_callback":  # the handler installed it at its first model call
            agent_header.uninstall_httpx_hook("langchain")


@pytest.mark.parametrize("instrumented", FRAMEWORKS, indirect=True)
def test_each_call_names_its_own_agent_from_the_first_one(gateway, instrumented):
    from agl_core.tracing import rollout_scope

    rollout_id = f"ro-two-{instrumented}"
    with rollout_scope(rollout_id, tracer_provider=TracerProvider()):
        _run_two_agents(instrumented, gateway.base_url(rollout_id))
    found = calls(gateway, rollout_id)
    assert found[0] == ("triage", "triage"), found  # the very first call is named
    assert {role for role, _ in found} == {"triage", "solver"}, found
    assert all(role == name for role, name in found), found
    assert sum(role == "solver" for role, _ in found) >= 2, found  # the solver's tool loop: each call


@pytest.mark.parametrize("instrumented", FRAMEWORKS, indirect=True)
def test_a_gateway_nobody_registered_gets_no_name(stranger, instrumented):
    from agl_core.tracing import rollout_scope

    rollout_id = f"ro-stranger-{instrumented}"
    with rollout_scope(rollout_id, tracer_provider=TracerProvider()):
        _run_two_agents(instrumented, stranger.base_url(rollout_id))
    found = calls(stranger, rollout_id)
    assert {role for role, _ in found} == {"triage", "solver"}, found
    assert all(name is None for _, name in found), found


# --- concurrency ---------------------------------------------------------------------------------------
async def _langchain_parallel(base_url: str) -> None:
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph

    llm = ChatOpenAI(base_url=base_url, api_key="x", model="tiny", max_retries=0)

    def graph_of(name: str) -> Any:
        async def node(state: MessagesState) -> dict[str, Any]:
            return {"messages": [await llm.ainvoke([("system", f"ROLE={name}"), *state["messages"]])]}

        graph = StateGraph(MessagesState)
        graph.add_node(name, node)
        graph.add_edge(START, name)
        graph.add_edge(name, END)
        return graph.compile()

    graphs = [graph_of(name) for name in PARALLEL]
    await asyncio.gather(*(g.ainvoke({"messages": [("user", QUESTION)]}) for g in graphs for _ in range(2)))


async def _openai_agents_parallel(base_url: str) -> None:
    from agents import Agent, OpenAIChatCompletionsModel, Runner
    from openai import AsyncOpenAI

    model = OpenAIChatCompletionsModel(
        model="tiny", openai_client=AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    )
    agents = [Agent(name=name, instructions=f"ROLE={name}", model=model) for name in PARALLEL]
    await asyncio.gather(*(Runner.run(agent, QUESTION) for agent in agents for _ in range(2)))


async def _autogen_parallel(base_url: str) -> None:
    from autogen_agentchat.agents import AssistantAgent
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    client = OpenAIChatCompletionClient(
        model="tiny", base_url=base_url, api_key="x", model_info=_agents.AUTOGEN_MODEL_INFO, max_retries=0
    )
    agents = [
        AssistantAgent(name.replace("-", "_"), client, system_message=f"ROLE={name}") for name in PARALLEL
    ]
    await asyncio.gather(*(agent.run(task=QUESTION) for agent in agents for _ in range(2)))


PARALLEL_RUNS: dict[str, Callable[[str], Any]] = {
    "langchain": _langchain_parallel,
    "openai_agents": _openai_agents_parallel,
    "autogen": _autogen_parallel,
}


@pytest.mark.parametrize("instrumented", sorted(PARALLEL_RUNS), indirect=True)
def test_concurrent_tasks_of_different_agents_do_not_mix_names(gateway, instrumented):
    from agl_core.tracing import rollout_scope

    rollout_id = f"ro-par-{instrumented}"
    with rollout_scope(rollout_id, tracer_provider=TracerProvider()):
        asyncio.run(PARALLEL_RUNS[instrumented](gateway.base_url(rollout_id)))
    found = calls(gateway, rollout_id)
    assert sorted(role or "" for role, _ in found) == sorted(PARALLEL * 2), found
    # AutoGen agent names are Python identifiers: par_0 for the prompt's par-0
    assert all((name or "").replace("_", "-") == role for role, name in found), found


# --- the hook itself -----------------------------------------------------------------------------------
@pytest.fixture
def hook() -> Iterator[list[httpx.Request]]:
    """The hook installed, ``http://gw.test:8000`` registered; the requests a mock transport received."""
    agent_header.install_httpx_hook("test")
    agent_header.register_gateway("http://gw.test:8000/rollouts/r/v1")
    try:
        yield []
    finally:
        agent_header.unregister_gateway("http://gw.test:8000")
        agent_header.uninstall_httpx_hook("test")


def _client(seen: list[Any], package: str = "httpx") -> Any:
    """A ``Client`` of ``package`` (httpx or httpx2) whose requests go to ``seen``."""
    http = importlib.import_module(package)

    def handle(request: Any) -> Any:
        seen.append(request)
        return http.Response(200, json={})

    return http.Client(transport=http.MockTransport(handle))


def _named(seen: list[Any]) -> list[str | None]:
    return [r.headers.get(agent_header.HEADER) for r in seen]


@pytest.mark.parametrize("package", CLIENT_PACKAGES)
def test_the_header_goes_only_to_known_gateways_with_a_valid_name(hook, monkeypatch, package):
    with _client(hook, package) as client:
        client.get("http://gw.test:8000/v1/models")  # no agent set
        with agent_header.agent_scope("solver"):
            client.get("http://gw.test:8000/v1/models")
            client.get("http://GW.test:8000/rollouts/r/v1/models")  # hosts compare case-insensitively
            client.get("http://gw.test:8001/v1/models")  # another port: another origin
            client.get("https://gw.test:8000/v1/models")  # another scheme
            client.get("https://api.openai.com/v1/models")
            client.get("http://gw.test:8000/v1/models", headers={agent_header.HEADER: "mine"})
            with agent_header.agent_scope("planner"):
                client.get("http://gw.test:8000/v1/models")
            client.get("http://gw.test:8000/v1/models")  # the outer agent is back
        client.get("http://gw.test:8000/v1/models")
        for bad in ("a/b", " padded", "x" * 200, "résumé"):  # the gateway would refuse, or misread, them
            with agent_header.agent_scope(bad):
                client.get("http://gw.test:8000/v1/models")
        monkeypatch.setenv("AGL_GATEWAY_URLS", "http://prod-gw.internal:9000/v1, https://other.example")
        with agent_header.agent_scope("solver"):
            client.get("http://prod-gw.internal:9000/v1/models")
            client.get("https://other.example:443/v1/models")
            client.get("http://other.example/v1/models")
    assert _named(hook) == [
        None,
        "solver",
        "solver",
        None,
        None,
        None,
        "mine",
        "planner",
        "solver",
        None,
        None,
        None,
        None,
        None,
        "solver",
        "solver",
        None,
    ]


@pytest.mark.parametrize("package", CLIENT_PACKAGES)
def test_async_clients_and_concurrent_tasks(hook, package):
    http = importlib.import_module(package)

    async def handle(request: Any) -> Any:
        hook.append(request)
        await asyncio.sleep(0.01)
        return http.Response(200, json={})

    async def agent(client: Any, name: str) -> None:
        with agent_header.agent_scope(name):
            for _ in range(3):
                await client.get(f"http://gw.test:8000/v1/models?who={name}")
                await asyncio.sleep(0)

    async def main() -> None:
        async with http.AsyncClient(transport=http.MockTransport(handle)) as client:
            await asyncio.gather(*(agent(client, f"a{i}") for i in range(5)))
            await client.get("http://gw.test:8000/v1/models?who=")  # outside every agent

    asyncio.run(main())
    assert len(hook) == 16
    assert all(r.headers.get(agent_header.HEADER) == (r.url.params["who"] or None) for r in hook)


@pytest.mark.parametrize("framework", ["langchain", "openai_agents", "autogen"])
def test_uninstrumenting_takes_the_hook_off_httpx(framework):
    def sends() -> list[Any]:
        packages = [importlib.import_module(name) for name in CLIENT_PACKAGES]
        return [vars(cls)["send"] for p in packages for cls in (p.Client, p.AsyncClient)]

    originals = sends()
    adapter = _adapter(framework)
    other = _adapter("autogen" if framework != "autogen" else "openai_agents")
    adapter.instrument(tracer_provider=TracerProvider())
    try:
        assert agent_header.httpx_hook_installed()
        assert all(now is not before for now, before in zip(sends(), originals, strict=True))
        adapter.instrument(tracer_provider=TracerProvider())  # again: still one hook
        assert [send.__wrapped__ for send in sends()] == originals
        other.instrument(tracer_provider=TracerProvider())
        adapter.uninstrument()
        assert agent_header.httpx_hook_installed()  # the other adapter still uses it
        other.uninstrument()
    finally:
        adapter.uninstrument()
        other.uninstrument()
    assert not agent_header.httpx_hook_installed()
    assert sends() == originals


def test_a_hook_wrapped_by_someone_else_stays_switched_off(hook):
    agl_send = vars(httpx.Client)["send"]

    def theirs(self: httpx.Client, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        return agl_send(self, request, **kwargs)

    httpx.Client.send = theirs  # type: ignore[method-assign]
    try:
        agent_header.uninstall_httpx_hook("test")
        assert not agent_header.httpx_hook_installed() and vars(httpx.Client)["send"] is theirs
        with _client(hook) as client, agent_header.agent_scope("solver"):
            client.get("http://gw.test:8000/v1/models")
        assert _named(hook) == [None]
    finally:
        httpx.Client.send = agl_send.__wrapped__  # type: ignore[method-assign]


# --- the runner registers its rollouts' gateway ---------------------------------------------------------
def test_the_runner_registers_the_gateway_of_its_rollouts():
    from agl_core.runner._state import RunState

    gateway_url = "http://runner-gw.test:7000"
    store = SimpleNamespace(
        get_resource=lambda name: Resource(name, 1, {"base_url": gateway_url, "model": "m"}),
    )
    state = RunState(
        lambda task, llm: None,
        store,  # type: ignore[arg-type]
        TracerProvider(),
        workers=1,
        rollout_timeout_s=None,
        poll_s=0.1,
        lease_s=30.0,
    )
    rollout = Rollout("ro-1", "t-1", {}, RolloutStatus.RUNNING)
    attempt = Attempt("at-1", "ro-1", 1, RolloutStatus.RUNNING)
    assert not agent_header.is_gateway_url(gateway_url)
    try:
        llm = state.llm_for(rollout, attempt)
        assert not isinstance(llm, str)
        assert agent_header.is_gateway_url(llm.base_url)
        assert agent_header.is_gateway_url("http://runner-gw.test:7000/anything")
        assert not agent_header.is_gateway_url("http://runner-gw.test:7001/v1")
    finally:
        agent_header.unregister_gateway(gateway_url)
