"""agl's side of the single-call task: one OpenAI-client call per problem through the gateway. Training
rollouts sample (``task.TEMPERATURE``) and return the partial-credit reward; held-out rollouts decode
greedily and return 1 or 0 (accuracy), the figure bench/learning_ab.py compares."""

from __future__ import annotations

from typing import Any

from openai import OpenAI
from task import MAX_TOKENS, TEMPERATURE, correct, messages, reward


def solve(task: dict[str, Any], llm: Any) -> float:
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    reply = client.chat.completions.create(
        model=llm.model,
        messages=messages(task["question"]),  # type: ignore[arg-type]
        temperature=0.0 if llm.evaluating else TEMPERATURE,
        max_tokens=MAX_TOKENS,
    )
    text = reply.choices[0].message.content or ""
    if llm.evaluating:
        return 1.0 if correct(text, task["answer"]) else 0.0
    return reward(text, task["answer"])
