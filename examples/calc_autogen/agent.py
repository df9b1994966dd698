"""An AutoGen AgentChat agent that solves arithmetic word problems with a calculator tool.

The agent is ordinary AutoGen code: one ``AssistantAgent`` with a ``calculator`` tool, talking to an
OpenAI-compatible endpoint through ``OpenAIChatCompletionClient``. The only agl-specific line is
``agl_autogen.instrument()``. The trainer calls ``solve(task, llm)`` once per rollout; the returned number
is the reward: 1 for the exact answer, 0 otherwise. Training rollouts sample (``TEMPERATURE``); validation
rollouts (``llm.evaluating``) decode greedily, so the before/after scores measure the policy itself.

The model is asked to call the calculator with the expression the problem needs; the agent returns the
calculator's result as its answer (AutoGen's ``reflect_on_tool_use=False``: one model call per problem).
A model that answers in text instead is scored on the last integer of its reply. A calculator call with an
invalid expression raises ``ValueError``, which AutoGen reports back as a failed tool call and agl records
as a tool span with ERROR status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from calc_tool import calculator, call_text, parse_answer

import agl_autogen

agl_autogen.instrument()

SYSTEM_PROMPT = "You solve arithmetic word problems with a calculator."
#: Worked examples put before the problem, one per operation: a question and the calculator call that
#: answers it. SmolLM2's chat template has no tool support, so the gateway describes the tools in the system
#: message and parses Hermes-style ``<tool_call>`` text from the reply; the examples show the model that text
#: verbatim. With only the addition example, training drifted to one operator for every problem (README).
EXAMPLES = [
    ("Ann has 25 pens and buys 17 more. How many pens does Ann have now?", "25 + 17"),
    ("A bus has 48 seats and 19 of them are taken. How many seats are free?", "48 - 19"),
    ("A hall has 6 rows of 14 chairs. How many chairs are in the hall?", "6 * 14"),
    ("72 eggs are split equally into 8 cartons. How many eggs are in each carton?", "72 / 8"),
]
#: What AutoGen needs to know about a model it has no built-in entry for.
MODEL_INFO = {
    "vision": False,
    "function_calling": True,
    "json_output": False,
    "family": "unknown",
    "structured_output": False,
}
#: Sampling settings for training rollouts; ``evaluate.py`` may pass others.
TEMPERATURE = 0.5
MAX_TOKENS = 40


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one attempt did: the answer it gave and how it got there."""

    answer: float | None
    reward: float
    tool_calls: int
    tool_errors: int
    final_text: str
    #: The expression of each calculator call, in order ("" where the arguments were not JSON).
    expressions: tuple[str, ...] = ()


def example_messages(examples: list[tuple[str, str]] = EXAMPLES) -> list[Any]:
    """The worked examples as earlier turns of the conversation: the question, then the call as text."""
    from autogen_core.models import AssistantMessage, UserMessage

    messages: list[Any] = []
    for question, expression in examples:
        messages += [
            UserMessage(content=question, source="user"),
            AssistantMessage(content=call_text(expression), source="calculator_agent"),
        ]
    return messages


def model_client(
    llm: Any, *, temperature: float, max_tokens: int, headers: dict[str, str] | None = None
) -> Any:
    """AutoGen's OpenAI client for the endpoint in ``llm`` (no retries: a failed call fails the rollout)."""
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    return OpenAIChatCompletionClient(
        model=llm.model,
        base_url=llm.base_url,
        api_key=llm.api_key,
        model_info=MODEL_INFO,
        temperature=temperature,
        max_tokens=max_tokens,
        max_retries=0,
        default_headers=headers,
    )


async def run_agent(
    question: str,
    answer: int,
    llm: Any,
    *,
    temperature: float = TEMPERATURE,
    max_tokens: int = MAX_TOKENS,
    headers: dict[str, str] | None = None,
) -> Outcome:
    """Run the agent on one problem against the endpoint in ``llm`` and score its answer. ``headers`` go
    with every model call (``distill.py`` names each episode's session with ``x-agl-session-id``)."""
    from autogen_agentchat.agents import AssistantAgent
    from autogen_core.model_context import UnboundedChatCompletionContext

    client = model_client(llm, temperature=temperature, max_tokens=max_tokens, headers=headers)
    try:
        agent = AssistantAgent(
            "calculator_agent",
            client,
            tools=[calculator],
            system_message=SYSTEM_PROMPT,
            reflect_on_tool_use=False,
            model_context=UnboundedChatCompletionContext(initial_messages=example_messages()),
        )
        result = await agent.run(task=question)
    finally:
        await client.close()
    calls = errors = 0
    expressions: list[str] = []
    value: float | None = None
    for message in result.messages:
        kind = type(message).__name__
        if kind == "ToolCallRequestEvent":
            calls += len(message.content)
            expressions += [_expression_of(call.arguments) for call in message.content]
        elif kind == "ToolCallExecutionEvent":
            for item in message.content:
                if item.is_error:
                    errors += 1
                else:
                    value = parse_answer(item.content)
    final = result.messages[-1]
    final_text = final.content if isinstance(final.content, str) else str(final.content)
    if calls == 0:
        value = parse_answer(final_text)
    reward = 1.0 if value is not None and value == answer else 0.0
    return Outcome(value, reward, calls, errors, final_text, tuple(expressions))


def _expression_of(arguments: str) -> str:
    try:
        expression = json.loads(arguments).get("expression", "")
    except (ValueError, AttributeError):
        return ""
    return expression if isinstance(expression, str) else ""


def solve(task: dict, llm: Any) -> float:
    """One rollout: sampled during training, greedy when the trainer scores the held-out split."""
    temperature = 0.0 if getattr(llm, "evaluating", False) else TEMPERATURE
    return asyncio.run(run_agent(task["question"], task["answer"], llm, temperature=temperature)).reward
