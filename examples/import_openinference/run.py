"""Learning from traces agl did not produce: an OpenInference-traced LangGraph agent, its LLM calls
captured by the gateway, its spans imported from an OTLP file, joined in one store.

    python examples/import_openinference/run.py [--out DIR]

1. A store and a capturing gateway start on 127.0.0.1 (the gateway serves a scripted policy that
   tokenises with SmolLM2's tokenizer, so token ids are real and the run is offline and takes seconds).
2. The agent (a LangGraph graph, nodes ``solver`` and ``checker``) is traced ONLY by OpenInference's
   ``LangChainInstrumentor``; its spans go to an OTLP JSON-lines file written by agl's
   :class:`~agl_core.otel.otlp_file.OtlpJsonLinesExporter`, the shape the OpenTelemetry Collector's
   ``file`` exporter writes. Each episode names its session twice: ``using_session`` on the spans,
   ``x-agl-session-id`` on the calls. The last episode calls another endpoint directly.
3. ``agl import FILE --store STORE`` puts the OpenInference spans next to the gateway's, under the
   rollout id the session id decides; ``agl reward`` rates one episode late; ``agl inspect`` shows what
   joined and what did not; ``spans_to_transitions`` makes the transitions.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from agl_core import semconv
from agl_core.cli import main as agl
from agl_core.gateway.capture import Capture
from agl_core.importer import session_rollout_id
from agl_core.otel.otlp_file import OtlpJsonLinesExporter
from agl_core.pipeline.transitions import TransitionResult, spans_to_transitions
from agl_core.store import SqliteStore
from agl_core.testing import ByteTokenizer, ChatTokenizer, Collector, GatewayServer, ScriptedBackend

MODEL = "policy"
#: (session id, question, through the gateway?)
EPISODES = [
    ("support-1", "What is 17 + 25?", True),
    ("support-2", "What is 48 + 56?", True),
    ("support-3", "What is 9 + 4?", False),  # this one calls another endpoint directly
]
#: The episode a user rates later (``agl reward``).
RATED = "support-1"


# -- the agent: ordinary LangGraph code, no agl in it ----------------------------------------------------
class State(TypedDict, total=False):
    question: str
    answer: str
    verdict: str


def build_agent(base_url: str, session_id: str) -> Any:
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    model = ChatOpenAI(
        base_url=base_url,
        api_key="unused",
        model=MODEL,
        max_retries=0,
        default_headers={semconv.HEADER_SESSION_ID: session_id},  # one session per episode
    )

    def solver(state: State) -> State:
        reply = model.invoke(
            [("system", "You are a calculator. Reply with the number only."), ("user", state["question"])]
        )
        return {"answer": str(reply.content)}

    def checker(state: State) -> State:
        prompt = f"Question: {state['question']}\nProposed answer: {state['answer']}\nIs it right? yes or no."
        return {"verdict": str(model.invoke([("user", prompt)]).content)}

    graph = StateGraph(State)
    graph.add_node("solver", solver)
    graph.add_node("checker", checker)
    graph.add_edge(START, "solver")
    graph.add_edge("solver", "checker")
    graph.add_edge("checker", END)
    return graph.compile()


# -- the scripted policy behind the gateway ---------------------------------------------------------------
_SUM = re.compile(r"(\d+) \+ (\d+)")


def policy(messages: Sequence[Mapping[str, Any]], tools: Any) -> str:
    """Answers sums (wrongly above 100) and checks a proposed answer."""
    text = str(messages[-1].get("content"))
    a, b = map(int, _SUM.findall(text)[0])
    proposed = re.search(r"Proposed answer: (-?\d+)", text)
    if proposed is not None:
        return "yes" if int(proposed.group(1)) == a + b else "no"
    return str(a + b if a + b <= 100 else a + b + 1)


def default_tokenizer() -> ChatTokenizer:
    """SmolLM2's tokenizer (the trainer's extra); the byte tokenizer without it."""
    try:
        from agl_trainer.model import load_tokenizer
    except ImportError:
        return ByteTokenizer()
    tokenizer: ChatTokenizer = load_tokenizer("smollm2")
    return tokenizer


# -- the run ----------------------------------------------------------------------------------------------
@dataclass
class GatewayCall:
    response_id: str
    rollout_id: str
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]


@dataclass
class Result:
    store: Path
    trace_file: Path
    #: session id -> rollout id
    rollouts: dict[str, str]
    #: the gateway's own record of each call it served, in order
    gateway_calls: list[GatewayCall]
    transitions: TransitionResult
    #: each agl command's argv (without "agl") and what it printed
    commands: list[tuple[list[str], str]] = field(default_factory=list)


def _run_agl(argv: list[str], result: Result, echo: Callable[[str], None]) -> str:
    echo("$ agl " + " ".join(argv))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = agl(argv)
    if code != 0:
        raise RuntimeError(f"agl {' '.join(argv)} exited with {code}:\n{out.getvalue()}")
    echo(out.getvalue().rstrip())
    result.commands.append((argv, out.getvalue()))
    return out.getvalue()


def run_episodes(out: Path, tokenizer: ChatTokenizer, echo: Callable[[str], None]) -> Result:
    from openinference.instrumentation import using_session
    from openinference.instrumentation.langchain import LangChainInstrumentor

    store_path, trace_file = out / "store.sqlite", out / "openinference.jsonl"
    result = Result(store_path, trace_file, {}, [], TransitionResult((), (), {}, ()))
    provider = TracerProvider(resource=Resource.create({"service.name": "arith-support-agent"}))
    provider.add_span_processor(BatchSpanProcessor(OtlpJsonLinesExporter(trace_file)))
    instrumentor = LangChainInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        with (
            Collector(path=store_path) as store,
            GatewayServer(
                ScriptedBackend(policy, tokenizer=tokenizer, model_name=MODEL),
                export_to=store.url,
                capture=Capture(store.url, debounce_s=0.01),
            ) as gateway,
            # "another endpoint": any OpenAI-compatible server that is not the capturing gateway
            GatewayServer(ScriptedBackend(policy, model_name=MODEL)) as elsewhere,
        ):
            echo(
                f"store {store.url} ({store_path}), capturing gateway {gateway.url},"
                f" other endpoint {elsewhere.url}"
            )
            for session_id, question, through_gateway in EPISODES:
                agent = build_agent(gateway.v1 if through_gateway else elsewhere.v1, session_id)
                with using_session(session_id):
                    state = agent.invoke({"question": question})
                where = "through the gateway" if through_gateway else "straight to the other endpoint"
                echo(
                    f"episode {session_id} ({where}): {question} -> {state['answer']},"
                    f" checker: {state['verdict']}"
                )
            if gateway.capture is None or not gateway.capture.flush():
                raise RuntimeError("the gateway did not register its sessions in the store")
            for span in gateway.spans():
                attrs = span.attributes or {}
                result.gateway_calls.append(
                    GatewayCall(
                        str(attrs[semconv.GEN_AI_RESPONSE_ID]),
                        str(attrs[semconv.ROLLOUT_ID]),
                        _ids(attrs[semconv.PROMPT_TOKEN_IDS]),
                        _ids(attrs[semconv.RESPONSE_TOKEN_IDS]),
                    )
                )
    finally:
        provider.shutdown()  # flushes the last batch to the file
        instrumentor.uninstrument()
    result.rollouts = {session: session_rollout_id(session) for session, _, _ in EPISODES}
    echo(f"the gateway captured {len(result.gateway_calls)} calls; {trace_file.name}: {_lines(trace_file)}")
    return result


def _ids(value: Any) -> tuple[int, ...]:
    return tuple(int(i) for i in value)


def _lines(path: Path) -> str:
    lines = path.read_text().splitlines()
    spans = sum(
        len(scope["spans"])
        for line in lines
        for resource in json.loads(line)["resourceSpans"]
        for scope in resource["scopeSpans"]
    )
    return f"{len(lines)} ExportTraceServiceRequest line(s), {spans} OpenInference spans"


def main(out: Path, *, tokenizer: ChatTokenizer | None = None, echo: Callable[[str], None] = print) -> Result:
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("store.sqlite", "store.sqlite-wal", "store.sqlite-shm", "openinference.jsonl"):
        (out / stale).unlink(missing_ok=True)
    echo("== 1. the agent runs, traced only by OpenInference, its calls captured by the gateway")
    result = run_episodes(out, tokenizer if tokenizer is not None else default_tokenizer(), echo)
    store = str(result.store)

    echo("\n== 2. import the OpenInference file into the gateway's store")
    _run_agl(["import", str(result.trace_file), "--store", store, "--quiet"], result, echo)
    with contextlib.closing(SqliteStore(result.store)) as sqlite:
        records = {r.rollout_id: r for r in sqlite.get_rollouts(list(result.rollouts.values()))}
    for session_id, rollout_id in result.rollouts.items():
        echo(
            f"  session {session_id} -> rollout {rollout_id}"
            f" (record made by: {records[rollout_id].metadata['source']})"
        )

    echo("\n== 3. a user rates one episode, later")
    rated = result.rollouts[RATED]
    _run_agl(
        ["reward", rated, "1", "--source", "user", "--id", "thumbs-up-1", "--store", store], result, echo
    )

    echo("\n== 4. what joined: an episode through the gateway")
    _run_agl(["inspect", rated, "--store", store], result, echo)
    echo("\n== 5. what did not: the episode that called another endpoint")
    _run_agl(["inspect", result.rollouts[EPISODES[-1][0]], "--store", store], result, echo)

    echo("\n== 6. spans_to_transitions over every rollout in the store")
    with contextlib.closing(SqliteStore(result.store)) as sqlite:
        spans = sqlite.query_spans(rollout_ids=list(result.rollouts.values()))
    result.transitions = spans_to_transitions(spans)
    echo(f"{len(result.transitions.transitions)} transitions")
    for t in result.transitions.transitions:
        echo(
            f"  {t.rollout_id} call {t.call_index}: agent={t.agent_name} reward={t.reward}"
            f" prompt_ids={len(t.prompt_ids)} response_ids={list(t.response_ids)}"
        )
    echo("not trained on:")
    for p in result.transitions.problems:
        echo(f"  {p.rollout_id} {f'span {p.span_id}' if p.span_id else 'rollout'}: {p.reason}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("runs/import_openinference"))
    main(parser.parse_args().out)
