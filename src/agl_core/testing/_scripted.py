"""A scripted policy for the gateway: replies chosen by a script, token ids from a real tokenizer.

A reply that calls tools is written the way tool-calling chat models write it (Hermes style, see
:func:`tool_call`)::

    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

:class:`ScriptedBackend` parses such replies with the gateway's own parser, so the client receives OpenAI
``tool_calls`` while the recorded response ids hold the reply exactly as written. Assistant messages that
carry ``tool_calls`` are rendered back into the same text in the next prompt, so the policy sees its own
output.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol

from ..gateway.backend import BackendError, ChatRequest, Completion, Event, UpstreamError
from ..gateway.tools import HERMES_OPEN, parse_tool_calls

__all__ = [
    "ByteTokenizer",
    "ChatTokenizer",
    "Script",
    "ScriptedBackend",
    "echo",
    "replies",
    "tool_call",
]

#: ``script(messages, tools) -> reply text``: OpenAI-style message dicts as the client sent them, and the
#: request's tool definitions (``None`` when it offered none).
Script = Callable[[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]] | None], str]


class ChatTokenizer(Protocol):
    """What :class:`ScriptedBackend` needs of a tokenizer; a Hugging Face tokenizer with a chat template
    and an end-of-turn ``eos_token`` (SmolLM2, Qwen) has it, and so has :class:`ByteTokenizer`."""

    @property
    def eos_token_id(self) -> int | None:
        """The id that ends an assistant turn (appended to every reply)."""

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = ...,
        tokenize: bool = ...,
    ) -> Any:
        """The prompt's token ids (a list, or a mapping / encoding holding ``input_ids``)."""


class ByteTokenizer:
    """A dependency-free tokenizer: one id per UTF-8 byte (0-255), ``<|im_start|>`` = 256 and
    ``<|im_end|>`` = 257, and a ChatML chat template. Deterministic; enough to check token ids end to end
    without downloading a model's tokenizer."""

    IM_START = "<|im_start|>"
    IM_END = "<|im_end|>"
    _SPECIAL = {IM_START: 256, IM_END: 257}
    _NAMES = {v: k for k, v in _SPECIAL.items()}

    @property
    def eos_token_id(self) -> int:
        return self._SPECIAL[self.IM_END]

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Bytes of ``text``; the special token strings in it become their ids."""
        ids: list[int] = []
        rest = text
        while rest:
            at, token = min(((rest.find(t), t) for t in self._SPECIAL if t in rest), default=(len(rest), ""))
            ids.extend(rest[:at].encode())
            if token:
                ids.append(self._SPECIAL[token])
            rest = rest[at + len(token) :]
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        out: list[str] = []
        run = bytearray()
        for i in token_ids:
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode(errors="replace"))
            run.clear()
            if not skip_special_tokens:
                out.append(self._NAMES.get(i, ""))
        out.append(run.decode(errors="replace"))
        return "".join(out)

    def render(self, conversation: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The ChatML text of ``conversation``."""
        text = "".join(f"{self.IM_START}{m['role']}\n{m['content']}{self.IM_END}\n" for m in conversation)
        return text + (f"{self.IM_START}assistant\n" if add_generation_prompt else "")

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
    ) -> list[int] | str:
        text = self.render(conversation, add_generation_prompt=add_generation_prompt)
        return self.encode(text) if tokenize else text


def tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The reply text calling ``name(**arguments)``, in the Hermes format :class:`ScriptedBackend` parses."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": dict(arguments)}) + "\n</tool_call>"


def echo(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> str:
    """A :data:`Script` answering with the text of the last user message."""
    last = next((m for m in reversed(messages) if m.get("role") == "user"), None)
    return str(last.get("content") or "") if last is not None else ""


def replies(*texts: str) -> Script:
    """A :data:`Script` answering with ``texts`` in turn, one per call, whatever the prompt. A call past
    the last one fails (the gateway answers 502) with a message saying so."""
    lock = threading.Lock()
    calls = itertools.count()

    def script(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> str:
        with lock:
            n = next(calls)
        if n >= len(texts):
            raise BackendError(
                f"the scripted backend's {len(texts)} replies are used up (call {n + 1}); "
                "give replies() more, or pass a function as the script"
            )
        return texts[n]

    return script


def _text_content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # OpenAI content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


class ScriptedBackend:
    """A gateway backend serving ``model_name`` with replies chosen by ``script``.

    Each choice runs ``script(messages, tools)`` on a worker thread. The prompt ids are the tokenizer's
    chat template over the messages (tool calls rendered back as text); the response ids are the reply's
    tokens plus the tokenizer's ``eos_token_id``, each with logprob ``logprob``. A reply holding
    :func:`tool_call` blocks reaches the client as OpenAI ``tool_calls`` (finish reason ``tool_calls``,
    ids ``call_1``, ``call_2``, ... in order of creation); a reply that opens a call it does not complete
    in valid JSON is reported unparseable, as a real backend reports it. Sampling options (``max_tokens``,
    ``stop``, ``temperature``) are ignored: the reply is the script's, whole. Chat completions only.

    ``script`` is a :data:`Script` or a sequence of reply texts used in turn (:func:`replies`);
    ``tokenizer`` defaults to :class:`ByteTokenizer`. :attr:`calls` counts the choices served.
    """

    kind = "scripted"
    trainable = True
    policy_version = 0

    def __init__(
        self,
        script: Script | Sequence[str] = echo,
        *,
        tokenizer: ChatTokenizer | None = None,
        model_name: str = "scripted",
        logprob: float = -0.5,
    ) -> None:
        self.script: Script = replies(*script) if isinstance(script, Sequence) else script
        self.tokenizer: ChatTokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        end = self.tokenizer.eos_token_id
        if end is None:
            raise ValueError("ScriptedBackend needs a tokenizer with an eos_token_id (the end-of-turn token)")
        self._end = int(end)
        self._names = (model_name,)
        self._logprob = logprob
        self._call_ids = itertools.count(1)
        self._lock = threading.Lock()
        self.calls = 0

    @property
    def model_names(self) -> Sequence[str]:
        return self._names

    def render(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
        """``messages`` as plain role / content pairs, earlier tool calls written back as text."""
        out = []
        for m in messages:
            content = _text_content(m.get("content"))
            for call in m.get("tool_calls") or []:
                fn = call.get("function") or {}
                args = fn.get("arguments") or "{}"
                content += tool_call(fn.get("name", ""), json.loads(args) if isinstance(args, str) else args)
            out.append({"role": str(m["role"]), "content": content})
        return out

    def complete(self, request: ChatRequest, index: int = 0) -> Completion:
        """One choice for ``request`` (blocking: runs the script)."""
        if not request.is_chat:
            raise UpstreamError(400, "the scripted backend serves chat completions only")
        with self._lock:
            self.calls += 1
        prompt = self.tokenizer.apply_chat_template(
            self.render(request.messages), add_generation_prompt=True, tokenize=True
        )
        if isinstance(prompt, Mapping) or hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        text = self.script(request.messages, request.tools)
        response_ids = (*self.tokenizer.encode(text, add_special_tokens=False), self._end)
        content: str | None
        content, calls = parse_tool_calls(text, "hermes")
        if calls:
            content = content.rstrip() or None
            with self._lock:
                for call in calls:
                    call["id"] = f"call_{next(self._call_ids)}"
        return Completion(
            text=content,
            finish_reason="tool_calls" if calls else "stop",
            prompt_ids=tuple(int(i) for i in prompt),
            response_ids=tuple(int(i) for i in response_ids),
            response_logprobs=tuple(self._logprob for _ in response_ids),
            policy_version=self.policy_version,
            response_tokens=tuple(self.tokenizer.decode([i]) for i in response_ids),
            index=index,
            tool_calls=tuple(calls),
            tool_call_unparseable=not calls and HERMES_OPEN in text,
        )

    async def generate(self, model: str, request: ChatRequest) -> AsyncIterator[Event]:
        for index in range(request.n):
            yield await asyncio.to_thread(self.complete, request, index)
