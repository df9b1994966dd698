"""A function-calling agent on BFCL's single-turn entries, written with the plain OpenAI client.

For each entry the agent sends BFCL's user turn with the entry's functions as tools, in one chat
completion, and reads the tool calls of the reply. Nothing in it is agl's: the trainer hands it an
``llm`` whose ``base_url`` is the gateway's, which records every call with its token ids; any client that
speaks the OpenAI protocol is trainable this way.

BFCL's function names may hold dots (``math.factorial``), which OpenAI's tool names may not: the agent
offers them with ``_`` for ``.``, as BFCL does for OpenAI models, and maps the names of the calls back.
BFCL's parameter types become JSON Schema's (``dict`` -> ``object``, ``float`` -> ``number``, ``tuple`` ->
``array``, ``any`` -> ``string``).

The held-out score is BFCL's AST accuracy (``bfcl_check.check``): 1 when the calls match the ground
truth, else 0. While training (not when the trainer evaluates), a reply whose calls name exactly the
expected functions but get an argument wrong earns ``PARTIAL_NAMES`` (0.1): partial credit for the right
function, so that a group whose replies are all wrong still has something to learn from.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bfcl_check import check, offered_calls, tool_name  # noqa: E402

#: Sampling temperature while training (the trainer evaluates greedily).
TEMPERATURE = 0.8
MAX_TOKENS = 160
#: Partial credit for the right functions with a wrong argument, while training (module docstring).
PARTIAL_NAMES = 0.1
#: ``tool_choice`` of every call: the agent's job is to call functions, so a reply must open with a call
#: (the gateway starts the reply with its tool-call tag); which ones, how many and their arguments are the
#: model's.
TOOL_CHOICE = "required"
#: BFCL's declared types as JSON Schema's.
SCHEMA_TYPES = {
    "dict": "object",
    "float": "number",
    "tuple": "array",
    "any": "string",
    "list": "array",
    "bool": "boolean",
}


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one reply did: its calls (BFCL's names, decoded arguments), whether they match, and why not."""

    calls: tuple[tuple[str, Any], ...]
    correct: bool
    reason: str
    reward: float


def _schema(node: Any) -> Any:
    """A BFCL parameter description as JSON Schema: types renamed, recursively."""
    if isinstance(node, list):
        return [_schema(item) for item in node]
    if not isinstance(node, Mapping):
        return node
    out = {key: _schema(value) for key, value in node.items()}
    if isinstance(out.get("type"), str):
        out["type"] = SCHEMA_TYPES.get(out["type"], out["type"])
    return out


def tools_of(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entry's functions as OpenAI chat tools."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool_name(f["name"]),
                "description": f.get("description", ""),
                "parameters": _schema(f["parameters"]),
            },
        }
        for f in functions
    ]


def read_calls(message: Any, functions: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """The reply's tool calls as (BFCL's function name, arguments); arguments that are not a JSON
    object stay as their text, which no ground truth accepts."""
    calls = []
    for call in message.tool_calls or ():
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except ValueError:
            arguments = call.function.arguments
        calls.append((call.function.name, arguments))
    return offered_calls(calls, functions)


def score(task: dict[str, Any], calls: list[tuple[str, Any]], *, training: bool) -> Outcome:
    """BFCL's verdict on ``calls`` for ``task``, and the reward it earns (partial credit only in training)."""
    if any(not isinstance(arguments, dict) for _, arguments in calls):
        correct, reason = False, "arguments that are not a JSON object"
    else:
        correct, reason = check(task["category"], task["functions"], calls, task["ground_truth"])
    reward = 1.0 if correct else 0.0
    if not correct and training:
        expected = Counter(next(iter(call)) for call in task["ground_truth"])
        if Counter(name for name, _ in calls) == expected:
            reward = PARTIAL_NAMES
    return Outcome(tuple(calls), correct, reason, reward)


def run_agent(task: dict[str, Any], llm: Any, *, temperature: float, max_tokens: int = MAX_TOKENS) -> Any:
    """One chat completion for ``task`` against the endpoint in ``llm``: its reply message."""
    with OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
        response = client.chat.completions.create(
            model=llm.model,
            messages=task["messages"],
            tools=tools_of(task["functions"]),
            tool_choice=TOOL_CHOICE,
            temperature=temperature,
            max_tokens=max_tokens,
        )
    return response.choices[0].message


def solve(task: dict[str, Any], llm: Any) -> float:
    """One rollout: sampled during training, greedy when the trainer scores the held-out split."""
    evaluating = bool(getattr(llm, "evaluating", False))
    message = run_agent(task, llm, temperature=0.0 if evaluating else TEMPERATURE)
    return score(task, read_calls(message, task["functions"]), training=not evaluating).reward
