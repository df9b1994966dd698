"""The interface between the gateway and whatever serves the model.

A backend turns one validated :class:`ChatRequest` into a stream of events: zero or more
:class:`ChoiceDelta` (text or tool-call pieces of one choice, only when ``request.stream`` is set) and,
for each of the ``n`` choices, exactly one final :class:`Completion` carrying the exact tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailableError",
    "ChatRequest",
    "ChoiceDelta",
    "Completion",
    "ContextTooLongError",
    "Event",
    "PolicyUpdate",
    "UpstreamError",
]


class BackendError(Exception):
    """The backend failed to serve a request it accepted (answered 502 by the gateway)."""


class BackendUnavailableError(BackendError):
    """The backend cannot be reached or is not running (answered 503 by the gateway)."""


class UpstreamError(BackendError):
    """The backend (or the server behind it) refused the request; ``status`` is the HTTP status to answer
    with (4xx: the client's request was at fault)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


class ContextTooLongError(BackendError):
    def __init__(self, prompt_tokens: int, max_tokens: int, context_window: int) -> None:
        super().__init__(
            f"the prompt has {prompt_tokens} tokens and {max_tokens} more were asked for, but the model's"
            f" context window is {context_window} tokens; shorten the messages or lower max_tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_window = context_window


ToolChoice: TypeAlias = Literal["none", "auto", "required"] | Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A validated generation request.

    ``messages`` are OpenAI-style dicts with string content (chat); ``prompt`` is set instead for a plain
    text completion (a string, or token ids). ``logprobs`` / ``top_logprobs`` only decide what the client
    is shown: backends always report the sampled tokens' logprobs when they can.
    """

    messages: Sequence[Mapping[str, Any]] = ()
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: Sequence[str] = ()
    seed: int | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    prompt: str | Sequence[int] | None = None
    #: The calling agent's name (from the request's URL or ``x-agl-agent-name``), set by the gateway; a
    #: backend serving a policy per agent picks the policy by it.
    agent: str | None = None

    @property
    def is_chat(self) -> bool:
        return self.prompt is None

    @property
    def tools_enabled(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> str | None:
        """The function name a ``{"type": "function", "function": {"name": ...}}`` tool_choice forces."""
        if isinstance(self.tool_choice, Mapping):
            function = self.tool_choice.get("function") or {}
            name = function.get("name") if isinstance(function, Mapping) else None
            return str(name) if name else None
        return None


@dataclasses.dataclass(frozen=True)
class ChoiceDelta:
    """A streamed piece of choice ``index``: new content text and / or OpenAI-shaped tool-call deltas
    (``{"index", "id", "type", "function": {"name", "arguments"}}``, fields after the first optional).
    ``logprobs`` are the OpenAI logprob entries of the tokens whose text this delta releases."""

    index: int
    text: str = ""
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    logprobs: tuple[Mapping[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class Completion:
    """What the model produced for one choice, with the exact tokens on both sides.

    ``response_logprobs[i]`` is the log-probability of ``response_ids[i]`` under the serving policy
    (temperature 1), one per token. ``text`` is the content shown to the client (tool-call markup
    removed); ``tool_calls`` are OpenAI-shaped (``{"id", "type": "function", "function": {"name",
    "arguments"}}``). Backends that cannot see tokens leave ``prompt_ids`` / ``response_ids`` empty.
    """

    text: str | None
    finish_reason: str
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...] | None
    policy_version: int
    response_tokens: tuple[str, ...] = ()
    index: int = 0
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    #: Per response token, the most likely alternatives as ``(token, logprob)`` (only when asked for).
    top_logprobs: tuple[tuple[tuple[str, float], ...], ...] | None = None
    #: How many leading response tokens were forced (a named / required ``tool_choice``), not sampled.
    forced_tokens: int = 0
    #: The model name the serving engine reports (for example a LoRA adapter of one policy version).
    served_model: str | None = None
    #: The model opened a tool call in its text (the format's opening marker) that could not be parsed;
    #: ``text`` then holds the raw output. Set by backends that parse tool calls themselves.
    tool_call_unparseable: bool = False
    #: The policy that served the call when the backend serves a policy per agent (``base``: the base
    #: model); ``None`` when one policy serves every call.
    policy_name: str | None = None


Event: TypeAlias = ChoiceDelta | Completion


@dataclasses.dataclass(frozen=True)
class PolicyUpdate:
    """A new policy version for a backend to serve: a LoRA adapter directory or a full model directory.

    ``policy`` names the policy the adapter belongs to when the backend serves a policy per agent: the
    adapter then replaces that policy's previous one only, and the others keep serving their agents."""

    version: int
    path: str
    kind: Literal["lora", "full"] = "lora"
    policy: str | None = None


@runtime_checkable
class Backend(Protocol):
    """Serves one or more model names behind the gateway.

    ``generate`` yields :data:`Event` values; it is cancelled (``aclose``) when the client goes away and
    must then stop generating. Errors are :class:`BackendError` subclasses.
    """

    #: Short name of the kind of backend (``"hf"``, ``"vllm"``, ``"openai"``), recorded on spans.
    kind: str

    @property
    def model_names(self) -> Sequence[str]: ...

    @property
    def trainable(self) -> bool:
        """Whether the tokens it reports come from a policy agl is training."""

    def generate(self, model: str, request: ChatRequest) -> AsyncIterator[Event]: ...
