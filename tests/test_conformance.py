"""One conformance suite for every adapter: the real frameworks, the real gateway, the real store.

Parametrised over the three frameworks and the span source: ``agl`` (the agl adapter, through its
``instrument()``), ``openinference`` (the OpenInference instrumentor alone, as a team already tracing
with it would have) and ``both``. Every adapter is driven the same way: ``instrument()`` before,
``uninstrument()`` after, nothing passed to the agent code. Each run goes: agent code -> framework ->
gateway (scripted policy, real SmolLM2 token ids) -> spans over OTLP into the store ->
``spans_to_transitions``. The checks are the same for every case.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agl_core import semconv
from agl_core.pipeline.credit import select_agents
from agl_core.pipeline.spantree import LLM, TOOL, SpanTree, kind_of, source_of
from agl_core.pipeline.transitions import spans_to_transitions
from agl_core.records import Span, Transition
from agl_core.testing import AglTestStack, otlp_tracer_provider, tool_call
from agl_core.tracing import emit_reward, rollout_scope

from . import _agents
from ._agents import FINAL_ANSWER, ROUTE_TEXT, scenario_script

for module in (
    "langchain_openai",
    "langgraph",
    "agents",
    "autogen_agentchat",
    "autogen_ext.models.openai",
    "openinference.instrumentation.langchain",
    "openinference.instrumentation.openai_agents",
    "openinference.instrumentation.autogen_agentchat",
):
    pytest.importorskip(module)

FRAMEWORKS = ("langchain", "openai_agents", "autogen")
SOURCES = ("agl", "openinference", "both")
AGL_SOURCE = {
    "langchain": semconv.SOURCE_LANGCHAIN,
    "openai_agents": semconv.SOURCE_OPENAI_AGENTS,
    "autogen": semconv.SOURCE_AUTOGEN,
}
QUESTION = "What is 2 + 3?"
ADD = tool_call("add", {"a": 2, "b": 3})
DIVIDE = tool_call("divide", {"a": 1, "b": 0})
HANDOFF = tool_call("transfer_to_solver", {})
SOLVER_CALLS = [("solver", ADD), ("solver", DIVIDE), ("solver", FINAL_ANSWER)]
#: ``(agent, reply)`` of every LLM call, in order.
EXPECTED = {
    ("langchain", "single"): SOLVER_CALLS,
    ("langchain", "multi"): [("triage", ROUTE_TEXT), *SOLVER_CALLS],
    ("openai_agents", "single"): SOLVER_CALLS,
    ("openai_agents", "multi"): [("triage", HANDOFF), *SOLVER_CALLS],
    ("autogen", "single"): SOLVER_CALLS,
    ("autogen", "multi"): [("triage", HANDOFF), *SOLVER_CALLS],
}


@pytest.fixture(scope="module", name="stack")
def fixture_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AglTestStack]:
    """The store, the gateway in front of :func:`~tests._agents.scenario_script` (real SmolLM2 token ids)
    and an agent-side provider batching its spans to the store, as production does."""
    from agl_trainer.model import load_tokenizer

    with AglTestStack(
        script=scenario_script,
        tokenizer=load_tokenizer("tiny"),
        model_name="tiny",
        path=tmp_path_factory.mktemp("conformance") / "store.sqlite",
        batch=True,
    ) as kit:
        yield kit


def _adapter(framework: str) -> Any:
    """The agl adapter package of ``framework`` (each has ``instrument`` / ``uninstrument`` /
    ``is_instrumented``)."""
    import agl_autogen
    import agl_langchain
    import agl_openai_agents

    return {"langchain": agl_langchain, "openai_agents": agl_openai_agents, "autogen": agl_autogen}[framework]


@contextlib.contextmanager
def instrumented(framework: str, source: str, provider: Any) -> Iterator[None]:
    """Instrument ``framework`` with the given source(s) for the block, uninstrument after.

    With ``both``, OpenInference comes first (a team already tracing with it adds agl afterwards)."""
    undo = []
    if source in ("openinference", "both"):
        instrumentor = _openinference(framework)
        instrumentor.instrument(tracer_provider=provider)
        undo.append(instrumentor.uninstrument)
    if source in ("agl", "both"):
        adapter = _adapter(framework)
        adapter.instrument(tracer_provider=provider, capture_content=True)
        undo.append(adapter.uninstrument)
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()


def _openinference(framework: str) -> Any:
    if framework == "langchain":
        from openinference.instrumentation.langchain import LangChainInstrumentor

        return LangChainInstrumentor()
    if framework == "openai_agents":
        from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor

        return OpenAIAgentsInstrumentor()
    from openinference.instrumentation.autogen_agentchat import AutogenAgentChatInstrumentor

    return AutogenAgentChatInstrumentor()


def run_rollout(
    stack: AglTestStack,
    framework: str,
    scenario: str,
    rollout_id: str,
    callbacks: Sequence[Any] = (),
    question: str = QUESTION,
) -> str:
    """Run the agent of ``framework`` / ``scenario`` in a rollout; ``callbacks`` go to LangChain runs."""
    with rollout_scope(rollout_id, f"{rollout_id}-a1", f"task-{scenario}", tracer_provider=stack.provider):
        base_url = stack.base_url(rollout_id, f"{rollout_id}-a1")
        output = _agents.RUNNERS[framework][scenario](base_url, question, callbacks)
        emit_reward(1.0, tracer_provider=stack.provider)
    return output


# --- what the framework saw ---------------------------------------------------------------------------
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def _as_seen(text: str) -> Any:
    """A reply as a framework sees it: its text, or its tool calls as ``[(name, arguments)]``."""
    calls = _TOOL_CALL.findall(text)
    return [(json.loads(c)["name"], json.loads(c)["arguments"]) for c in calls] if calls else text


def _args(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def seen_by_framework(span: Span) -> Any:
    """What a framework LLM span says the model answered, in the form of :func:`_as_seen`."""
    attrs = span.attributes
    if semconv.GEN_AI_OUTPUT_MESSAGES in attrs:  # agl adapters: OpenAI-style message dicts
        (message,) = json.loads(attrs[semconv.GEN_AI_OUTPUT_MESSAGES])
        calls = message.get("tool_calls") or []
        if calls:
            return [
                ((c.get("function") or c)["name"], _args((c.get("function") or c)["arguments"]))
                for c in calls
            ]
        return message.get("content")
    prefix = "llm.output_messages.0.message."  # OpenInference: flattened attributes
    names = sorted(k for k in attrs if k.startswith(prefix + "tool_calls.") and k.endswith("function.name"))
    if names:
        return [
            (attrs[k], _args(attrs.get(k.replace("function.name", "function.arguments"), "{}")))
            for k in names
        ]
    return attrs.get(prefix + "content")


# --- the checks -----------------------------------------------------------------------------------------
def check_rollout(
    stack: AglTestStack,
    spans: list[Span],
    framework: str,
    source: str,
    scenario: str,
    output: str,
    question: str = QUESTION,
) -> list[Transition]:
    expected = EXPECTED[(framework, scenario)]
    result = spans_to_transitions(spans)
    assert result.problems == (), result.problems
    transitions = list(result.transitions)

    # one transition per LLM call, token ids decoding to what the model was scripted to say ...
    assert [stack.decode(t.response_ids) for t in transitions] == [reply for _, reply in expected]
    assert output == FINAL_ANSWER
    for t, (agent, _) in zip(transitions, expected, strict=True):
        prompt = stack.decode(t.prompt_ids)
        assert question in prompt and f"ROLE={agent}" in prompt
        assert t.response_logprobs is not None and len(t.response_logprobs) == len(t.response_ids)

    # ... and to what each source's framework span says the framework saw, call by call
    tree = SpanTree(spans)
    sources = {"agl": [AGL_SOURCE[framework]], "openinference": [semconv.SOURCE_OPENINFERENCE]}.get(
        source, [AGL_SOURCE[framework], semconv.SOURCE_OPENINFERENCE]
    )
    for name in sources:
        calls = [s for s in tree.spans if kind_of(s) == LLM and source_of(s) == name]
        assert len(calls) == len(transitions), name
        for call, t in zip(calls, transitions, strict=True):
            assert seen_by_framework(call) == _as_seen(stack.decode(t.response_ids)), name

    # agent names, agent selection
    assert [t.agent_name for t in transitions] == [agent for agent, _ in expected]
    solver_only = select_agents(transitions, ["solver"])
    assert solver_only == [t for t in transitions if t.agent_name == "solver"] and len(solver_only) == 3
    assert {t.agent_name for t in select_agents(transitions, ["tri*"])} <= {"triage"}

    # tool spans: under their agent's step, failures recorded with status
    for name in sources:
        tools = {}
        for span in tree.spans:
            if (
                kind_of(span) == TOOL
                and source_of(span) == name
                and span.name.split(" ")[-1].split(".")[-1] in ("add", "divide")
            ):
                tools[span.name.split(" ")[-1].split(".")[-1]] = span
        assert set(tools) == {"add", "divide"}, name
        for tool in tools.values():
            step = tree.agent_step(tool)
            assert step is not None and tree.agent_name(tool) == "solver", (name, tool.name)
        assert not tools["add"].is_error
        if (framework, name) == ("autogen", semconv.SOURCE_OPENINFERENCE):
            # openinference-instrumentation-autogen-agentchat records a failed tool call with status OK
            # (the failure is only in its output text), so there is no status to check.
            continue
        assert tools["divide"].is_error, name

    # the reward emitted inside the rollout is attached to it and to every transition
    rewards = [s for s in spans if s.name == semconv.SPAN_REWARD]
    assert len(rewards) == 1 and rewards[0].rollout_id == transitions[0].rollout_id
    assert {t.reward for t in transitions} == {1.0}
    return transitions


CASES = [(f, s) for f in FRAMEWORKS for s in SOURCES]


@pytest.mark.parametrize("scenario", ["single", "multi"])
@pytest.mark.parametrize(("framework", "source"), CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_conformance(stack: AglTestStack, framework: str, source: str, scenario: str) -> None:
    rollout_id = f"ro-{framework}-{source}-{scenario}"
    with instrumented(framework, source, stack.provider):
        output = run_rollout(stack, framework, scenario, rollout_id)
    check_rollout(stack, stack.spans(rollout_id), framework, source, scenario, output)


@pytest.mark.parametrize("source", ["agl", "openinference"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_sixteen_concurrent_rollouts_never_mix(stack: AglTestStack, framework: str, source: str) -> None:
    """16 rollouts at once in one process: in threads (every framework) and in asyncio tasks (the
    asyncio-native ones)."""
    n = 16
    prefix = f"ro-par-{framework}-{source}"
    with instrumented(framework, source, stack.provider):
        with ThreadPoolExecutor(n) as pool:
            outputs = list(
                pool.map(
                    lambda i: run_rollout(
                        stack, framework, "single", f"{prefix}-t{i}", question=f"{QUESTION} (#t{i})"
                    ),
                    range(n),
                )
            )
        if framework in _agents.ASYNC_SINGLE:
            outputs += asyncio.run(_async_rollouts(stack, framework, prefix, n))
    assert outputs == [FINAL_ANSWER] * len(outputs)
    kinds = ["t"] + (["a"] if framework in _agents.ASYNC_SINGLE else [])
    for kind in kinds:
        for i in range(n):
            rollout_id = f"{prefix}-{kind}{i}"
            spans = stack.spans(rollout_id)
            check_rollout(stack, spans, framework, source, "single", FINAL_ANSWER, f"{QUESTION} (#{kind}{i})")
            root = next(s for s in spans if s.name == semconv.SPAN_ROLLOUT)
            framework_spans = [
                s for s in spans if source_of(s) not in ("", semconv.SOURCE_GATEWAY, semconv.SOURCE_RUNNER)
            ]
            assert {s.trace_id for s in framework_spans} == {root.trace_id}


async def _async_rollouts(stack: AglTestStack, framework: str, prefix: str, n: int) -> list[str]:
    async def one(i: int) -> str:
        rollout_id = f"{prefix}-a{i}"
        with rollout_scope(rollout_id, f"{rollout_id}-a1", "task-single", tracer_provider=stack.provider):
            base_url = stack.base_url(rollout_id, f"{rollout_id}-a1")
            output = await _agents.ASYNC_SINGLE[framework](base_url, f"{QUESTION} (#a{i})")
            emit_reward(1.0, tracer_provider=stack.provider)
        return output

    return list(await asyncio.gather(*(one(i) for i in range(n))))


# --- adapters never break the agent; uninstrument restores ----------------------------------------------
class _ExplodingTracer:
    def start_span(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("tracer exploded")

    start_as_current_span = start_span


class _ExplodingProvider:
    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        return _ExplodingTracer()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_failing_hook_never_breaks_the_agent(
    stack: AglTestStack, framework: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    with instrumented(framework, "agl", _ExplodingProvider()):
        output = run_rollout(stack, framework, "multi", f"ro-explode-{framework}")
    assert output == FINAL_ANSWER
    failures = [
        r.getMessage() for r in caplog.records if "agl:" in r.getMessage() and "failed" in r.getMessage()
    ]
    assert failures and len(failures) == len(set(failures)), failures  # each failing hook logged once


def _autogen_bindings() -> dict[tuple[Any, str], Any]:
    """``{(module or class, attribute): value}`` of everything agl_autogen may patch."""
    import sys

    from autogen_agentchat.teams import BaseGroupChat
    from autogen_ext.models.openai import BaseOpenAIChatCompletionClient

    found: dict[tuple[Any, str], Any] = {
        (module, attr): value
        for name, module in list(sys.modules.items())
        if module is not None and name.startswith(("autogen_agentchat", "autogen_core"))
        for attr, value in vars(module).items()
        if attr in ("trace_invoke_agent_span", "trace_tool_span")
    }
    for cls in (BaseGroupChat, BaseOpenAIChatCompletionClient):
        for attr in ("run_stream", "create", "create_stream"):
            if attr in cls.__dict__:
                found[(cls, attr)] = cls.__dict__[attr]
    return found


def _sdk_processors() -> tuple[Any, ...]:
    from agents.tracing import get_trace_provider

    provider: Any = get_trace_provider()  # the SDK has no public way to list its processors
    return tuple(provider._multi_processor._processors)


def _langchain_handlers() -> tuple[Any, ...]:
    """The handlers LangChain gives a run started with no ``callbacks`` that listen to chain events."""
    from langchain_core.callbacks import CallbackManager

    return tuple(h for h in CallbackManager.configure().handlers if not h.ignore_chain)


SNAPSHOTS = {
    "langchain": _langchain_handlers,
    "openai_agents": _sdk_processors,
    "autogen": _autogen_bindings,
}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_instrument_twice_is_harmless_and_uninstrument_restores(stack: AglTestStack, framework: str) -> None:
    module = _adapter(framework)
    snapshot = SNAPSHOTS[framework]
    before = snapshot()
    assert not module.is_instrumented()
    first = module.instrument(tracer_provider=stack.provider)
    during = snapshot()
    assert module.instrument(tracer_provider=stack.provider) is first and snapshot() == during
    assert during != before and module.is_instrumented()
    module.uninstrument()
    module.uninstrument()
    assert snapshot() == before and not module.is_instrumented()

    # user processors stay; replace_processors=True replaces them until uninstrument
    if framework == "openai_agents":
        processor = module.instrument(tracer_provider=stack.provider, replace_processors=True)
        assert _sdk_processors() == (processor,)
        module.uninstrument()
        assert _sdk_processors() == before

    # nothing of agl's is recorded after uninstrument
    output = run_rollout(stack, framework, "single", f"ro-after-{framework}")
    assert output == FINAL_ANSWER
    assert {source_of(s) for s in stack.spans(f"ro-after-{framework}")} <= {
        semconv.SOURCE_RUNNER,
        semconv.SOURCE_GATEWAY,
        "",
    }


def _tree_shape(spans: list[Span]) -> list[tuple[Any, ...]]:
    """The rollout's span tree without ids, times or rollout-specific values: depth-first, one row per
    span (depth, name, source, operation, agent, tool, status)."""
    return [
        (
            depth,
            span.name,
            source_of(span),
            span.attributes.get(semconv.GEN_AI_OPERATION_NAME),
            span.attributes.get(semconv.GEN_AI_AGENT_NAME),
            span.attributes.get(semconv.GEN_AI_TOOL_NAME),
            span.status_code,
        )
        for depth, span in SpanTree(spans).walk()
    ]


@pytest.mark.parametrize("scenario", ["single", "multi"])
def test_langchain_instrument_records_what_the_explicit_handler_records_and_nothing_twice(
    stack: AglTestStack, scenario: str
) -> None:
    import agl_langchain
    from agl_langchain import AglCallbackHandler

    shapes = {}
    rollout_id = f"ro-lc-explicit-{scenario}"
    handler = AglCallbackHandler(tracer_provider=stack.provider, capture_content=True)
    output = run_rollout(stack, "langchain", scenario, rollout_id, [handler])
    shapes["explicit"] = _tree_shape(check_rollout_spans(stack, rollout_id, scenario, output))
    langchain_rows = sum(row[2] == semconv.SOURCE_LANGCHAIN for row in shapes["explicit"])
    assert langchain_rows > 0
    with instrumented("langchain", "agl", stack.provider):
        rollout_id = f"ro-lc-instrumented-{scenario}"
        output = run_rollout(stack, "langchain", scenario, rollout_id)
        shapes["instrumented"] = _tree_shape(check_rollout_spans(stack, rollout_id, scenario, output))

        # A run also given agl's handler explicitly is recorded once, by that handler: its own provider
        # (exporting to the same store) ends every LangChain span, the instrumented one none.
        rollout_id = f"ro-lc-both-{scenario}"
        memory = InMemorySpanExporter()
        provider = otlp_tracer_provider(stack.collector.url, rollout_spans=False)
        provider.add_span_processor(SimpleSpanProcessor(memory))
        handler = AglCallbackHandler(tracer_provider=provider, capture_content=True)
        output = run_rollout(stack, "langchain", scenario, rollout_id, [handler])
        shapes["both"] = _tree_shape(check_rollout_spans(stack, rollout_id, scenario, output))
        assert len(memory.get_finished_spans()) == langchain_rows
        assert agl_langchain.is_instrumented()
        provider.shutdown()
    assert shapes["instrumented"] == shapes["explicit"] and shapes["both"] == shapes["explicit"]


def check_rollout_spans(stack: AglTestStack, rollout_id: str, scenario: str, output: str) -> list[Span]:
    spans = stack.spans(rollout_id)
    check_rollout(stack, spans, "langchain", "agl", scenario, output)
    return spans


@pytest.mark.parametrize("kind", ["round_robin", "selector", "swarm"])
def test_autogen_teams_name_their_agents(stack: AglTestStack, kind: str) -> None:
    import agl_autogen

    rollout_id = f"ro-team-{kind}"
    agl_autogen.instrument(tracer_provider=stack.provider)
    try:
        with rollout_scope(rollout_id, tracer_provider=stack.provider):
            output = asyncio.run(_agents.autogen_team_async(kind, stack.base_url(rollout_id), QUESTION))
            emit_reward(1.0, tracer_provider=stack.provider)
    finally:
        agl_autogen.uninstrument()
    assert output == FINAL_ANSWER
    result = spans_to_transitions(stack.spans(rollout_id))
    assert result.problems == ()
    team = {"round_robin": "RoundRobinGroupChat", "selector": "SelectorGroupChat", "swarm": "Swarm"}[kind]
    first = {"round_robin": ["triage"], "selector": [team], "swarm": ["triage"]}[kind]
    assert [t.agent_name for t in result.transitions] == [*first, "solver", "solver", "solver"]


def test_autogen_uninstrumented_out_of_order_keeps_the_other_instrumentor_working(
    stack: AglTestStack,
) -> None:
    import agl_autogen

    before = _autogen_bindings()
    oi = _openinference("autogen")
    try:
        agl_autogen.instrument(tracer_provider=stack.provider)
        oi.instrument(tracer_provider=stack.provider)
        agl_autogen.uninstrument()  # OpenInference wrapped after agl: agl switches itself off instead
        output = run_rollout(stack, "autogen", "single", "ro-out-of-order")
        assert output == FINAL_ANSWER
        sources = {source_of(s) for s in stack.spans("ro-out-of-order")}
        assert semconv.SOURCE_OPENINFERENCE in sources and semconv.SOURCE_AUTOGEN not in sources
    finally:
        oi.uninstrument()
        for (owner, attr), value in before.items():  # leave the exact originals for the other tests
            setattr(owner, attr, value)


def test_agl_inspect_prints_the_tree_the_transitions_and_why_a_call_made_none(
    stack: AglTestStack, capsys: pytest.CaptureFixture[str]
) -> None:
    from langchain_openai import ChatOpenAI

    from agl_core.cli import main
    from agl_langchain import AglCallbackHandler

    rollout_id = "ro-inspect"
    handler = AglCallbackHandler(tracer_provider=stack.provider)
    output = run_rollout(stack, "langchain", "multi", rollout_id, [handler])
    assert output == FINAL_ANSWER
    with rollout_scope(rollout_id, tracer_provider=stack.provider):
        # a call that bypasses the rollout's gateway URL: the gateway cannot attribute it to the rollout
        stray = ChatOpenAI(base_url=stack.gateway_url + "/v1", api_key="x", model="tiny", max_retries=0)
        stray.invoke([("system", "ROLE=triage"), ("user", "hi")], config={"callbacks": [handler]})
    stack.provider.force_flush()

    assert main(["inspect", rollout_id, "--store", stack.client.url]) == 0
    out = capsys.readouterr().out
    assert f"rollout {rollout_id}: " in out and "4 LLM calls through the gateway, 4 transitions" in out
    assert "      triage  [agent, langchain, agent=triage]" in out and "agent=solver" in out
    assert "execute_tool divide  [tool, langchain, agent=solver, ERROR ZeroDivisionError" in out
    for i in range(4):  # on the framework's LLM span and on the gateway's
        assert out.count(f"-> transition {i}]") == 2
    assert out.count("-> no transition: LLM call has no gateway span with token ids") == 1
    assert "problems\n  span " in out

    assert main(["inspect", "ro-nothing", "--store", stack.client.url]) == 1
    assert "has no rollout 'ro-nothing' and no spans of it" in capsys.readouterr().err
