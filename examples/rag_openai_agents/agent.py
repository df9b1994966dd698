"""A retrieval agent written with the OpenAI Agents SDK, made trainable by ``agl_openai_agents.instrument()``.

The agent answers questions about the fictional world of ``corpus.jsonl`` with one tool, ``search``
(BM25 over the corpus; the top passages as text). A task allows ``task["hops"]`` searches (default 1).
Two entry points for the trainer, each ``(task, llm) -> reward`` (``reward.score``: answer F1 plus a
small format term):

- :func:`solve` (the CPU example): the agent makes the first search itself, with the question as the
  query, and hands the passages to the model with the question; the model answers, and may call
  ``search`` for the task's remaining hops. A one-hop task is one model call. This is for models too
  small to write a tool call (SmolLM2-135M cannot produce the JSON arguments of one).
- :func:`solve_agentic` (the GPU example): the model makes every search itself; its first call must
  call ``search`` (the SDK's ``tool_choice``), then it searches again or answers.

Either way the searches are the SDK's tool runs (``execute_tool search`` spans), and the model's calls
go through agl's gateway.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    RunContextWrapper,
    Runner,
    function_tool,
    trace,
)
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from agents.tracing import function_span
from bm25 import load_index
from openai import AsyncOpenAI
from reward import score

import agl_openai_agents

# The one agl line: record the SDK's agents, model calls and tool runs as spans. agl's is the only trace
# processor, so nothing tries to send traces to OpenAI.
agl_openai_agents.instrument(replace_processors=True)

CORPUS = Path(__file__).resolve().parent / "corpus.jsonl"
#: Passages per search: the one-hop CPU agent reads the best passage only (SmolLM2-135M is easily
#: distracted by a second one); the model-driven agent gets three per search.
TOP_K, TOP_K_AGENTIC = 1, 3
#: Sampling temperature of every model call (training and evaluation alike).
TEMPERATURE = 0.7
INSTRUCTIONS = (
    "You answer questions about a fictional world. Reply with one line: Answer: <the answer in a few words>"
)
SEARCH_HINT = " Call the search tool to look up a person, city or company in the encyclopedia."

_index = None


def search_passages(query: str, k: int) -> str:
    """The ``k`` best passages for ``query``, one per line as ``Title: text``."""
    global _index
    if _index is None:
        _index = load_index(CORPUS)
    hits = _index.search(query, k)
    if not hits:
        return "No passage matches this query."
    return "\n".join(f"{doc['title']}: {doc['text']}" for _, doc in hits)


@dataclasses.dataclass
class Budget:
    """Run context: searches the task still allows, passages per search."""

    searches_left: int
    top_k: int


def _can_search(ctx: RunContextWrapper[Budget], agent: Agent[Budget]) -> bool:
    return ctx.context.searches_left > 0


@function_tool(is_enabled=_can_search)
def search(ctx: RunContextWrapper[Budget], query: str) -> str:
    """Search the encyclopedia and return the best matching passages.

    Args:
        query: Words to look for, such as the name of a person, city or company.
    """
    ctx.context.searches_left -= 1
    return search_passages(query, ctx.context.top_k)


def _instructions(ctx: RunContextWrapper[Budget], agent: Agent[Budget]) -> str:
    return INSTRUCTIONS + (SEARCH_HINT if ctx.context.searches_left > 0 else "")


def build_agent(client: AsyncOpenAI, model_name: str, *, first_call_searches: bool) -> Agent[Budget]:
    """The agent, its model served by the OpenAI-compatible endpoint of ``client`` (agl's gateway).

    Requests set no ``max_tokens``: the gateway's ``default_max_tokens`` (a config key) decides.
    """
    model = OpenAIChatCompletionsModel(model=model_name, openai_client=client)
    return Agent[Budget](
        name="researcher",
        instructions=_instructions,
        model=model,
        tools=[search],
        # After a tool run the SDK resets tool_choice to "auto" (reset_tool_choice), so only the first
        # call is forced to search.
        model_settings=ModelSettings(
            tool_choice="search" if first_call_searches else None, temperature=TEMPERATURE
        ),
    )


def _search_in_code(query: str, budget: Budget) -> str:
    """Run the search tool from the agent's code, recorded like a run the model asked for."""
    budget.searches_left -= 1
    with function_span("search", input=json.dumps({"query": query})) as span:
        passages = search_passages(query, budget.top_k)
        span.span_data.output = passages
    return passages


async def answer(task: dict, llm, *, agentic: bool = False) -> str:
    """The agent's final reply to ``task["question"]``."""
    question = task["question"]
    budget = Budget(searches_left=int(task.get("hops", 1)), top_k=TOP_K_AGENTIC if agentic else TOP_K)
    # closed inside the event loop it was used in (asyncio.run closes the loop on return)
    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
        agent = build_agent(client, llm.model, first_call_searches=agentic)
        return await _run(agent, question, budget, agentic)


async def _run(agent: Agent[Budget], question: str, budget: Budget, agentic: bool) -> str:
    with trace("rag_openai_agents"):
        if agentic:
            prompt = question
        else:
            passages = _search_in_code(question, budget)
            prompt = f"{passages}\n\nQuestion: {question}\nReply with one line: Answer: <answer>"
        result = await Runner.run(
            agent,
            prompt,
            context=budget,
            max_turns=budget.searches_left + 1,
            run_config=RunConfig(workflow_name="rag_openai_agents"),
        )
    return str(result.final_output or "")


def _reward(task: dict, llm, agentic: bool) -> float:
    try:
        reply = asyncio.run(answer(task, llm, agentic=agentic))
    except (MaxTurnsExceeded, ModelBehaviorError):
        return 0.0  # the model kept calling tools or wrote a call the SDK cannot run: no answer
    return score(reply, task["answer"])


def solve(task: dict, llm) -> float:
    """One rollout: the agent searches for the question, the model answers (and may search more)."""
    return _reward(task, llm, agentic=False)


def solve_agentic(task: dict, llm) -> float:
    """One rollout where the model makes every search itself."""
    return _reward(task, llm, agentic=True)
