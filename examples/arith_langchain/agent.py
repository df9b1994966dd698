"""A small LangChain agent that answers arithmetic questions, made trainable by one callback.

The agent is ordinary LangChain code; the only agl-specific line is ``AglCallbackHandler()`` in the run
config. The trainer calls ``solve(task, llm)`` for each rollout; the returned number is the reward:
1 for the exact sum, partial credit for a near miss (so a group of attempts rarely ties).
"""

from __future__ import annotations

import re

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_openai import ChatOpenAI

from agl_langchain import AglCallbackHandler

PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "You are a calculator. Reply with the result as a number and nothing else."),
        ("user", "{question}"),
    ]
)

_NUMBER = re.compile(r"-?\d+")


def parse_answer(text: str) -> int | None:
    """The last integer in the reply ("3 + 8 = 11" -> 11), or ``None``."""
    numbers = _NUMBER.findall(text.replace(",", ""))
    return int(numbers[-1]) if numbers else None


def solve(task: dict, llm) -> float:
    model = ChatOpenAI(
        base_url=llm.base_url,
        api_key=llm.api_key,
        model=llm.model,
        temperature=1.0,
        max_tokens=16,
        max_retries=0,
    )
    chain = PROMPT | model | StrOutputParser()
    reply = chain.invoke(
        {"question": task["question"]}, config={"callbacks": [AglCallbackHandler(agent_name="calculator")]}
    )
    return score(parse_answer(reply), task["answer"])


def score(predicted: int | None, answer: int) -> float:
    """1 for the exact answer, partial credit for a near miss, 0 when the reply has no number."""
    if predicted is None:
        return 0.0
    if predicted == answer:
        return 1.0
    return 0.5 / (1 + abs(predicted - answer))
