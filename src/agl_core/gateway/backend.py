"""The interface between the gateway and whatever serves the model."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["Backend", "BackendError", "ChatRequest", "Completion", "ContextTooLongError"]


class BackendError(Exception):
    """The backend could not serve the request (it is down, or failed)."""


class ContextTooLongError(BackendError):
    def __init__(self, prompt_tokens: int, max_tokens: int, context_window: int) -> None:
        super().__init__(
            f"the prompt has {prompt_tokens} tokens and {max_tokens} more were asked for, but the model's context"
            f" window is {context_window} tokens; shorten the messages or lower max_tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.context_window = context_window


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A validated chat request. ``messages`` are OpenAI-style dicts with string content."""

    messages: Sequence[Mapping[str, Any]]
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: Sequence[str] = ()
    seed: int | None = None
    tools: Sequence[Mapping[str, Any]] | None = None


@dataclasses.dataclass(frozen=True)
class Completion:
    """What the model produced for one choice, with the exact tokens on both sides.

    ``response_logprobs[i]`` is the log-probability of ``response_ids[i]`` under the serving policy
    (temperature 1), one per token.
    """

    text: str
    finish_reason: str
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...] | None
    policy_version: int
    response_tokens: tuple[str, ...] = ()


class Backend(Protocol):
    """Serves one or more model names. ``chat`` blocks; the gateway calls it off the event loop."""

    @property
    def model_names(self) -> Sequence[str]: ...

    @property
    def trainable(self) -> bool:
        """Whether the tokens it reports come from a policy agl is training."""

    def chat(self, model: str, request: ChatRequest) -> Completion: ...
