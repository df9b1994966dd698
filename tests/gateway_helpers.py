"""Shared pieces of the gateway tests over the tiny model: a script that steers the tiny random model to
fixed replies (so tool-calling clients get well-formed calls). The gateway itself is served with
:class:`agl_core.testing.GatewayServer`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_ANSWER = "It is sunny in Paris."


class Script:
    """A logits processor forcing a fixed reply (then ``<|im_end|>``) when the prompt contains a trigger.

    Rules are tried in order; prompts matching none are sampled from the model untouched. The recorded
    logprobs remain the raw model's, as for any processor."""

    def __init__(self, tokenizer: Any, rules: Sequence[tuple[str, str]]) -> None:
        self.tokenizer = tokenizer
        self.rules = list(rules)
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._targets: dict[tuple[int, ...], list[int] | None] = {}

    def __call__(self, prompt_ids: Sequence[int], response_ids: Sequence[int], logits: Any) -> Any:
        key = tuple(prompt_ids)
        if key not in self._targets:
            text = self.tokenizer.decode(list(prompt_ids))
            reply = next((r for trigger, r in self.rules if trigger in text), None)
            self._targets[key] = None if reply is None else [*self.tokenizer.encode(reply), self.end]
        target = self._targets[key]
        if (
            target is None
            or len(response_ids) >= len(target)
            or list(response_ids) != target[: len(response_ids)]
        ):
            return logits
        forced = logits.new_full(logits.shape, float("-inf"))
        forced[target[len(response_ids)]] = 0.0
        return forced


WEATHER_SCRIPT = [("<tool_response>", WEATHER_ANSWER), ("weather", WEATHER_CALL)]


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """What a client is shown for these response ids (special tokens are not text)."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)
