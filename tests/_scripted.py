"""A scripted policy behind the real gateway, for tests that need an agent to call tools.

The tiny random model writes gibberish, so it cannot drive a multi-step agent. :class:`ScriptedBackend`
implements the gateway's ``Backend`` protocol: a script picks the reply, and the real SmolLM2 tokenizer
turns prompt and reply into token ids, so the ids on the gateway span are exactly what the client got.

A reply that calls tools is written the way tool-calling chat models write it (Hermes style)::

    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

and :func:`with_tool_call_parsing` wraps the gateway's ASGI app so such replies reach the client as OpenAI
``tool_calls`` (what a tool-call parser in front of a real model does). Assistant messages that carry
``tool_calls`` are rendered back into the same text in the next prompt, so the policy sees its own output.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agl_core.gateway import ChatRequest, Completion

__all__ = [
    "ScriptedBackend",
    "Script",
    "render_tool_call",
    "scenario_script",
    "with_tool_call_parsing",
]

#: ``script(messages, tools) -> reply text`` (OpenAI-style message dicts, tool schemas or None).
Script = Callable[[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]] | None], str]

_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def render_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": dict(arguments)}) + "\n</tool_call>"


class ScriptedBackend:
    """Serves ``model_name`` with replies chosen by ``script``; token ids from the real tokenizer."""

    trainable = True

    def __init__(self, tokenizer: Any, script: Script, *, model_name: str = "tiny") -> None:
        self.tokenizer = tokenizer
        self.script = script
        self._names = (model_name,)
        self._end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.calls = 0

    @property
    def model_names(self) -> Sequence[str]:
        return self._names

    def render(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
        out = []
        for m in messages:
            content = m.get("content") or ""
            for call in m.get("tool_calls") or []:
                fn = call.get("function") or {}
                args = fn.get("arguments") or "{}"
                content += render_tool_call(
                    fn.get("name", ""), json.loads(args) if isinstance(args, str) else args
                )
            out.append({"role": str(m["role"]), "content": content})
        return out

    def chat(self, model: str, request: ChatRequest) -> Completion:
        self.calls += 1
        prompt_ids = self.tokenizer.apply_chat_template(
            self.render(request.messages), add_generation_prompt=True, tokenize=True
        )
        if isinstance(prompt_ids, Mapping) or hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
        text = self.script(request.messages, request.tools)
        response_ids = [*self.tokenizer.encode(text, add_special_tokens=False), self._end]
        return Completion(
            text=text,
            finish_reason="stop",
            prompt_ids=tuple(int(i) for i in prompt_ids),
            response_ids=tuple(int(i) for i in response_ids),
            response_logprobs=tuple(-0.5 for _ in response_ids),
            policy_version=0,
        )


def with_tool_call_parsing(app: Any) -> Any:
    """ASGI middleware: turn ``<tool_call>`` blocks in chat completion replies into OpenAI ``tool_calls``."""

    async def middleware(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/chat/completions"):
            await app(scope, receive, send)
            return
        start: dict[str, Any] = {}
        body = bytearray()

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            body.extend(message.get("body", b""))
            if message.get("more_body"):
                return
            data = bytes(body)
            if start.get("status") == 200:
                data = _parse_tool_calls(data)
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(data)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": data})

        await app(scope, receive, capture)

    return middleware


def _parse_tool_calls(raw: bytes) -> bytes:
    payload = json.loads(raw)
    for choice in payload.get("choices", []):
        message = choice["message"]
        text = message.get("content") or ""
        calls = _TOOL_CALL.findall(text)
        if not calls:
            continue
        message["tool_calls"] = [
            {
                "id": f"call_{payload['id'][-8:]}_{i}",
                "type": "function",
                "function": {
                    "name": json.loads(c)["name"],
                    "arguments": json.dumps(json.loads(c)["arguments"]),
                },
            }
            for i, c in enumerate(calls)
        ]
        message["content"] = _TOOL_CALL.sub("", text).strip() or None
        choice["finish_reason"] = "tool_calls"
    return json.dumps(payload).encode()


# --- the scenario every conformance agent runs -----------------------------------------------------
#: The solver's final answer.
FINAL_ANSWER = "The answer is 5."
#: What the triage agent says when the framework gives it no handoff tool (it routes by text).
ROUTE_TEXT = "ROUTE solver"


def _called_tools(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    names = []
    for m in messages:
        for call in m.get("tool_calls") or []:
            names.append((call.get("function") or {}).get("name", ""))
    return names


def scenario_script(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> str:
    """Two agents. ``ROLE=triage`` hands over to the solver (with a ``transfer_to_*`` tool when it has one).
    ``ROLE=solver`` calls ``add(2, 3)``, then ``divide(1, 0)`` (which fails), then answers.
    A prompt asking to pick the next speaker (a selector team) gets the solver's name."""
    system = " ".join(str(m.get("content") or "") for m in messages if m.get("role") == "system")
    tool_names = [(t.get("function") or {}).get("name", "") for t in tools or []]
    if (
        "select the next role" in system.lower()
        or "select the next role" in str(messages[-1].get("content", "")).lower()
    ):
        return "solver"
    if "ROLE=triage" in system:
        handoff = next((n for n in tool_names if n.startswith("transfer_to_")), None)
        return render_tool_call(handoff, {}) if handoff else ROUTE_TEXT
    called = _called_tools(messages)
    if "add" not in called:
        return render_tool_call("add", {"a": 2, "b": 3})
    if "divide" not in called:
        return render_tool_call("divide", {"a": 1, "b": 0})
    return FINAL_ANSWER
