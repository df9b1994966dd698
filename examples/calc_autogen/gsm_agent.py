"""The AutoGen calculator agent on GSM-style problems (reasoning-gym's ``gsm_symbolic``).

The same kind of agent as ``agent.py``, for problems of several steps: one ``AssistantAgent`` with the
``calculator`` tool that may call it up to ``MAX_TOOL_ITERATIONS`` times, each result going back to the
model, and then answers in text (``reflect_on_tool_use=True``). Before the problem it sees the calculator
agent's four worked examples (``agent.EXAMPLES``: a question and the calculator call that answers it) as
earlier turns: without them SmolLM2-135M never called the calculator (0 of 908 training rollouts) and
computed in text. The one agl line is ``agl_autogen.instrument()``, in ``agent.py``, whose model client
and examples this module shares.

The answer is what the reply puts in ``<answer>`` tags (reasoning-gym's ``extract_answer``), else the last
number of the reply; the reward is the generator's own scorer on it (``score_answer``: 1 for the right
number, 0.01 for another number, 0 for no number). A task that names another generator (the curriculum's
``basic_arithmetic``, whose scorer wants the exact answer string and gives partial credit to an answer
that contains it) is scored by that generator's scorer. The held-out score counts only right answers (1
or 0), the benchmark's accuracy. Training rollouts sample (``TEMPERATURE``); validation rollouts
(``llm.evaluating``) decode greedily.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Any

# The calculator agent's module, which also calls agl_autogen.instrument().
from agent import example_messages, model_client
from calc_tool import calculator, parse_answer

SYSTEM_PROMPT = (
    "You solve math word problems step by step. Use the calculator for every computation."
    " When you know the result, reply with it between answer tags, for example <answer>42</answer>."
)
TEMPERATURE = 0.7
MAX_TOKENS = 128
#: Model calls that may end in calculator calls before the answer.
MAX_TOOL_ITERATIONS = 3


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one attempt did: its answer text, the scorer's verdict and the calculator calls made."""

    answer: str | None
    score: float
    tool_calls: int
    final_text: str


#: The generators whose scorer a task may name (``task["generator"]``); gsm_symbolic when it names none.
GENERATORS = ("gsm_symbolic", "basic_arithmetic")


@functools.cache
def _scorer(generator: str = "gsm_symbolic") -> Any:
    if generator not in GENERATORS:
        raise ValueError(f"unknown generator {generator!r} in a task: use one of {', '.join(GENERATORS)}")
    try:
        import reasoning_gym
    except ImportError:
        raise RuntimeError(
            "reasoning-gym is not installed: pip install 'agl[gsm]' (reasoning-gym==0.1.25)"
        ) from None
    return reasoning_gym.create_dataset(generator, seed=0, size=1)


def answer_of(text: str) -> str | None:
    """The reply's answer: inside ``<answer>`` tags, else its last number, else ``None``."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(text)
    if tagged:
        return tagged.strip()
    number = parse_answer(text)
    if number is None:
        return None
    return str(int(number)) if number.is_integer() else str(number)


def score(answer: str | None, expected: str, generator: str = "gsm_symbolic") -> float:
    """The generator's own scorer; ``gsm_symbolic``'s: 1.0 right, 0.01 another number, 0.0 no number."""
    return float(_scorer(generator).score_answer(answer, {"answer": expected}))


async def run_agent(
    question: str,
    expected: str,
    llm: Any,
    *,
    temperature: float = TEMPERATURE,
    generator: str = "gsm_symbolic",
) -> Outcome:
    """Run the agent on one problem against the endpoint in ``llm`` and score its answer."""
    from autogen_agentchat.agents import AssistantAgent
    from autogen_core.model_context import UnboundedChatCompletionContext

    client = model_client(llm, temperature=temperature, max_tokens=MAX_TOKENS)
    try:
        agent = AssistantAgent(
            "gsm_agent",
            client,
            tools=[calculator],
            system_message=SYSTEM_PROMPT,
            reflect_on_tool_use=True,
            max_tool_iterations=MAX_TOOL_ITERATIONS,
            model_context=UnboundedChatCompletionContext(initial_messages=example_messages()),
        )
        result = await agent.run(task=question)
    finally:
        await client.close()
    calls = sum(len(m.content) for m in result.messages if type(m).__name__ == "ToolCallRequestEvent")
    final = result.messages[-1]
    text = final.content if isinstance(final.content, str) else str(final.content)
    answer = answer_of(text)
    return Outcome(answer, score(answer, expected, generator), calls, text)


def solve(task: dict, llm: Any) -> float:
    """One rollout: the scorer's reward while training; 1 or 0 when the trainer scores the held-out set."""
    evaluating = bool(getattr(llm, "evaluating", False))
    generator = task.get("generator", "gsm_symbolic")
    _scorer(generator)  # an unknown generator fails before any model call
    outcome = asyncio.run(
        run_agent(
            task["question"],
            task["answer"],
            llm,
            temperature=0.0 if evaluating else TEMPERATURE,
            generator=generator,
        )
    )
    return float(outcome.score == 1.0) if evaluating else outcome.score
