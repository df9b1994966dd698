"""Tool calling for models served from their chat template: prompt side and parse side (pure functions).

Prompt side: a template that renders ``tools`` and ``tool_calls`` itself is used as it is. For one that
does not (SmolLM2's plain ChatML, for example), :func:`prepare_messages` writes the tool definitions into
the system message and turns earlier tool calls / tool results into text, Hermes-style::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Parse side: :func:`parse_tool_calls` finds calls in generated text in the Hermes format (also the format
of Qwen 2.5 / 3 and SmolLM3 templates), Mistral's ``[TOOL_CALLS] [...]`` and Llama 3's bare JSON
``{"name": ..., "parameters": ...}``; :func:`tool_format_of` picks the format a template uses.
:func:`malformed_tool_calls` says which calls of a response a client cannot run (the gateway records it
on the call's span, an input to automatic intermediate rewards).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from .. import semconv

__all__ = [
    "HERMES_CLOSE",
    "HERMES_OPEN",
    "ToolFormat",
    "forced_prefix",
    "held_back",
    "malformed_tool_calls",
    "parse_tool_calls",
    "prepare_messages",
    "template_handles",
    "tool_call_start",
    "tool_format_of",
]

ToolFormat = Literal["hermes", "mistral", "llama3_json"]
HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
_MISTRAL_OPEN = "[TOOL_CALLS]"
_STARTS: dict[str, str] = {"hermes": HERMES_OPEN, "mistral": _MISTRAL_OPEN, "llama3_json": '{"name"'}

_SYSTEM_TOOLS = (
    "You can call functions. Their signatures are listed as JSON between <tools> and </tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, answer with a JSON object holding its name and arguments between <tool_call> tags:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n</tool_call>'
)


def template_handles(template: str | None, what: str) -> bool:
    """Whether a Jinja chat template mentions ``what`` (``"tools"`` / ``"tool_calls"``) at all."""
    return bool(template) and what in template  # type: ignore[operator]


def tool_format_of(template: str | None) -> ToolFormat:
    """The tool-call format a chat template teaches; Hermes when it teaches none (agl then adds it)."""
    if template and _MISTRAL_OPEN in template:
        return "mistral"
    if template and ("<|python_tag|>" in template or "ipython" in template) and HERMES_OPEN not in template:
        return "llama3_json"
    return "hermes"


def tool_call_start(fmt: ToolFormat) -> str:
    """The text that opens a tool call in ``fmt``: streamed content stops there."""
    return _STARTS[fmt]


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = tool.get("function", tool)
    return fn if isinstance(fn, Mapping) else {}


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _hermes_call(call: Mapping[str, Any]) -> str:
    fn = _function(call)
    body = {"name": fn.get("name"), "arguments": _arguments_object(fn.get("arguments", {}))}
    return f"{HERMES_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{HERMES_CLOSE}"


def prepare_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template: str | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)`` to hand to ``apply_chat_template``.

    When the template renders tools itself, both go through unchanged (``None`` content becomes ``""``).
    Otherwise tools are described in the system message and ``tool_calls`` / ``tool`` messages become
    Hermes-style text, so the model sees the calls in the same format it is asked to produce.
    """
    native_tools = template_handles(template, "tools")
    native_calls = template_handles(template, "tool_calls")
    out: list[dict[str, Any]] = []
    for message in messages:
        m = dict(message)
        if m.get("content") is None:
            m["content"] = ""
        if not native_calls and m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_hermes_call(c) for c in m.pop("tool_calls"))
            m["content"] = f"{m['content']}\n{calls}" if m["content"] else calls
        elif not native_calls and m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if not tools:
        return out, None
    if native_tools:
        return out, [dict(t) for t in tools]
    listing = "\n".join(json.dumps(dict(t), ensure_ascii=False) for t in tools)
    block = _SYSTEM_TOOLS.format(tools=listing)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None


def forced_prefix(fmt: ToolFormat, function_name: str | None) -> str:
    """Text a response must start with for ``tool_choice`` "required" (no name) or a named function."""
    if fmt == "mistral":
        return (
            f'{_MISTRAL_OPEN}[{{"name": "{function_name}", "arguments": ' if function_name else _MISTRAL_OPEN
        )
    if fmt == "llama3_json":
        return f'{{"name": "{function_name}", "parameters": ' if function_name else '{"name": "'
    return f'{HERMES_OPEN}\n{{"name": "{function_name}", "arguments": ' if function_name else HERMES_OPEN


def _call(name: Any, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": str(name), "arguments": arguments},
    }


_decoder = json.JSONDecoder()


def _json_prefix(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of ``text`` (after whitespace) and where it ends, or ``None``."""
    start = len(text) - len(text.lstrip())
    try:
        value, end = _decoder.raw_decode(text, start)
    except ValueError:
        return None
    return value, end


def _from_objects(values: Any, args_key: str) -> list[dict[str, Any]] | None:
    items = values if isinstance(values, list) else [values]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(_call(item["name"], item.get(args_key, item.get("arguments", {}))))
    return calls


def _parse_hermes(text: str, forced_name: str | None) -> tuple[str, list[dict[str, Any]]] | None:
    first = text.find(HERMES_OPEN)
    if first < 0:
        return None
    calls: list[dict[str, Any]] = []
    pos = first
    while pos >= 0:
        body_start = pos + len(HERMES_OPEN)
        close = text.find(HERMES_CLOSE, body_start)
        body = text[body_start:close] if close >= 0 else text[body_start:]
        parsed = _json_prefix(body)
        if parsed is not None and isinstance(parsed[0], dict) and isinstance(parsed[0].get("name"), str):
            calls.append(_call(parsed[0]["name"], parsed[0].get("arguments", {})))
        elif forced_name is not None and not calls:
            calls.append(_call(forced_name, _forced_arguments(body, forced_name)))
        else:
            return None
        if close < 0:
            break
        pos = text.find(HERMES_OPEN, close + len(HERMES_CLOSE))
    return text[:first], calls


def _forced_arguments(body: str, name: str) -> str:
    """The raw arguments text of a forced call whose JSON did not parse (OpenAI: arguments may be invalid)."""
    head = f'{{"name": "{name}", "arguments": '
    raw = body.strip()
    raw = raw[len(head) :] if raw.startswith(head) else raw
    return raw[:-1].rstrip() if raw.endswith("}") else raw


def parse_tool_calls(
    text: str, fmt: ToolFormat = "hermes", *, forced_name: str | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """``(content, tool_calls)`` from generated text. Content is the text before the first call; with no
    parseable call it is the whole text and the list is empty. ``forced_name`` (a named ``tool_choice``)
    keeps a call of that function even when its arguments are not valid JSON."""
    if fmt == "hermes":
        found = _parse_hermes(text, forced_name)
        return found if found is not None else (text, [])
    if fmt == "mistral":
        at = text.find(_MISTRAL_OPEN)
        if at >= 0:
            parsed = _json_prefix(text[at + len(_MISTRAL_OPEN) :])
            calls = _from_objects(parsed[0], "arguments") if parsed else None
            if calls:
                return text[:at], calls
        return text, []
    stripped = text.lstrip()
    if stripped.startswith("<|python_tag|>"):
        stripped = stripped[len("<|python_tag|>") :]
    parsed = _json_prefix(stripped)
    if parsed is not None and not stripped[parsed[1] :].strip(" \n;"):
        calls = _from_objects(parsed[0], "parameters")
        if calls:
            return "", calls
    return text, []


_WS_TAIL = re.compile(r"\s+$")


def held_back(text: str, markers: Sequence[str], *, whitespace: bool = False) -> int:
    """How many characters at the end of ``text`` a stream must hold back: any suffix that could be the
    start of one of ``markers`` (a stop string or a tool-call opener) and, with ``whitespace``, the
    trailing whitespace before it (content before a tool call is sent without it)."""
    hold = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:size]):
                hold = max(hold, size)
                break
    if not whitespace:
        return hold
    ws = _WS_TAIL.search(text[: len(text) - hold])
    return hold + (len(ws.group(0)) if ws else 0)


def malformed_tool_calls(
    tool_calls: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    unparseable: bool = False,
) -> list[tuple[str, str | None]]:
    """``(reason, call id)`` for each malformed tool call of one response; empty when all are well formed.

    ``tool_calls`` are OpenAI-shaped calls as the client receives them, ``tools`` the request's tool
    definitions. A call naming a function that is not among ``tools`` is ``unknown_tool``; one whose
    arguments are not a JSON object is ``invalid_arguments``. ``unparseable`` (the backend saw a tool
    call opened in the text that it could not parse) adds one ``unparseable`` entry with no call id.
    """
    found: list[tuple[str, str | None]] = []
    if unparseable:
        found.append((semconv.TOOL_CALL_UNPARSEABLE, None))
    offered = {_function(t).get("name") for t in tools or ()}
    for call in tool_calls:
        fn = _function(call)
        call_id = call.get("id")
        call_id = str(call_id) if call_id else None
        if fn.get("name") not in offered:
            found.append((semconv.TOOL_CALL_UNKNOWN_TOOL, call_id))
            continue
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(arguments, Mapping):
            found.append((semconv.TOOL_CALL_INVALID_ARGUMENTS, call_id))
    return found
