"""Pure parts of the gateway: tool-call formats, incremental text, the upstream HTTP client."""

from __future__ import annotations

import asyncio
import json

import pytest

from agl_core import semconv
from agl_core.gateway._http import ConnectFailed, Pool, TimedOut
from agl_core.gateway.assemble import TextAssembler
from agl_core.gateway.tools import (
    forced_prefix,
    held_back,
    malformed_tool_calls,
    parse_tool_calls,
    prepare_messages,
    tool_format_of,
)

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}


@pytest.mark.parametrize(
    "text, fmt, content, calls",
    [
        (
            'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
            "hermes",
            "Sure.\n",
            [("f", {"x": 1})],
        ),
        (
            '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "g", "arguments": {"y": "z"}}</tool_call>',
            "hermes",
            "",
            [("f", {}), ("g", {"y": "z"})],
        ),
        (
            '<tool_call>\n{"name": "f", "arguments": {"x": 1}}',
            "hermes",
            "",
            [("f", {"x": 1})],
        ),  # cut at the end-of-turn
        ("<tool_call>\nnot json\n</tool_call>", "hermes", "<tool_call>\nnot json\n</tool_call>", []),
        ("no calls here", "hermes", "no calls here", []),
        ('[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}]', "mistral", "", [("f", {"x": 1})]),
        ('{"name": "f", "parameters": {"x": 1}}', "llama3_json", "", [("f", {"x": 1})]),
        ('<|python_tag|>{"name": "f", "parameters": {}}', "llama3_json", "", [("f", {})]),
        (
            'I think {"name": "f", "parameters": {}}',
            "llama3_json",
            'I think {"name": "f", "parameters": {}}',
            [],
        ),
    ],
)
def test_parse_tool_calls(text, fmt, content, calls):
    got_content, got_calls = parse_tool_calls(text, fmt)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)


def test_forced_call_keeps_invalid_arguments_as_text():
    text = forced_prefix("hermes", "f") + "oops"
    _, (call,) = parse_tool_calls(text, "hermes", forced_name="f")
    assert call["function"] == {"name": "f", "arguments": "oops"}


def test_tool_format_follows_the_template():
    assert tool_format_of(None) == "hermes"
    assert tool_format_of("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert tool_format_of("<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert tool_format_of("{% if tools %}<tool_call>{% endif %}") == "hermes"


def test_prepare_messages_without_native_tool_support():
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    out, tools = prepare_messages(
        messages, [{"type": "function", "function": {"name": "f"}}], "{{ message['content'] }}"
    )
    assert tools is None
    assert (
        out[0]["role"] == "system" and '{"type": "function", "function": {"name": "f"}}' in out[0]["content"]
    )
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    native, native_tools = prepare_messages(
        messages, [{"type": "function", "function": {"name": "f"}}], "{{ tools }} {{ tool_calls }}"
    )
    assert native[1]["tool_calls"] == [CALL] and native[1]["content"] == "" and native_tools is not None


def test_held_back_covers_marker_prefixes_and_whitespace():
    assert held_back("hello <tool", ["<tool_call>"]) == 5
    assert held_back("hello  ", ["<tool_call>"]) == 0
    assert held_back("hello  ", ["<tool_call>"], whitespace=True) == 2
    assert held_back("abc", ["STOP"]) == 0 and held_back("abcST", ["STOP"]) == 2


def _decoder(pieces):
    """A decode function over fake token ids: id i decodes to pieces[i]; an odd byte count stays partial."""

    def decode(ids):
        raw = b"".join(pieces[i] for i in ids)
        return raw.decode("utf-8", errors="replace")

    return decode


def test_text_assembler_streams_exactly_the_final_text():
    pieces = [b"Hel", b"lo ", "\u00e9"[0].encode()[:1], "\u00e9".encode()[1:], b" wor", b"ld STO", b"P more"]
    assembler = TextAssembler(_decoder(pieces), stop=["STOP"])
    streamed = ""
    for i in range(len(pieces)):
        text, _ = assembler.push(i)
        assert "\ufffd" not in text  # half a UTF-8 character is never sent
        streamed += text
        if assembler.stopped:
            break
    content, calls, last, _ = assembler.finish()
    assert streamed + last == content == "Hello \u00e9 world " and calls == []


def test_text_assembler_holds_tool_calls_back():
    pieces = [b"Ok.", b" ", b"<tool", b'_call>{"name": "f", "arguments": {}}', b"</tool_call>"]
    assembler = TextAssembler(_decoder(pieces), tool_format="hermes")
    streamed = "".join(assembler.push(i)[0] for i in range(len(pieces)))
    content, calls, last, _ = assembler.finish()
    assert streamed == "Ok." and content == "Ok." and last == "" and calls[0]["function"]["name"] == "f"


def test_text_assembler_flags_a_tool_call_it_cannot_parse():
    broken = [b"Ok.", b" ", b"<tool", b'_call>{"name": "f", "arguments": {"x": ', b"</tool_call>"]
    assembler = TextAssembler(_decoder(broken), tool_format="hermes")
    for i in range(len(broken)):
        assembler.push(i)
    content, calls, _, _ = assembler.finish()
    assert calls == [] and content == b"".join(broken).decode() and assembler.tool_call_unparseable

    fine = TextAssembler(_decoder([b"no call at all"]))
    fine.push(0)
    fine.finish()
    assert not fine.tool_call_unparseable


def _call(name, arguments, call_id="call_1"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    "calls, unparseable, expected",
    [
        ([_call("f", '{"x": 1}')], False, []),
        ([], False, []),
        ([], True, [(semconv.TOOL_CALL_UNPARSEABLE, None)]),
        ([_call("g", "{}")], False, [(semconv.TOOL_CALL_UNKNOWN_TOOL, "call_1")]),
        ([_call("f", '{"x": ')], False, [(semconv.TOOL_CALL_INVALID_ARGUMENTS, "call_1")]),
        ([_call("f", "[1, 2]")], False, [(semconv.TOOL_CALL_INVALID_ARGUMENTS, "call_1")]),  # not an object
        ([_call("f", "")], False, [(semconv.TOOL_CALL_INVALID_ARGUMENTS, "call_1")]),
        ([_call("f", {"x": 1})], False, []),  # arguments already decoded
        ([_call("f", "{}", "a"), _call("nope", "{", "b")], False, [(semconv.TOOL_CALL_UNKNOWN_TOOL, "b")]),
    ],
)
def test_malformed_tool_calls(calls, unparseable, expected):
    assert malformed_tool_calls(calls, TOOLS, unparseable=unparseable) == expected


async def _serve(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_http_pool_reuses_connections_and_retries_a_closed_idle_one():
    async def main():
        connections = []

        async def handler(reader, writer):
            connections.append(writer)
            while True:
                try:
                    await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                body = b'{"ok": true}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                if len(connections) == 1:
                    await writer.drain()
                    writer.close()  # keep-alive dropped by the server after the first answer
                    return

        server, port = await _serve(handler)
        pool = Pool(f"http://127.0.0.1:{port}/v1")
        first = await pool.send("GET", "/models")
        await asyncio.sleep(0.05)
        second = await pool.send("GET", "/models")
        third = await pool.send("GET", "/models")
        pool.close()
        server.close()
        return first.json(), second.json(), third.json(), len(connections)

    first, second, third, opened = asyncio.run(main())
    assert first == second == third == {"ok": True}
    assert opened == 2  # the dropped one replaced once, then reused


def test_http_pool_reads_chunked_lines_and_times_out():
    async def main():
        async def handler(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            if b"/slow" in head:
                await asyncio.sleep(5)
                return
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for piece in (b"data: 1\n\nda", b"ta: 2\n\n", b"data: [DONE]\n\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")

        server, port = await _serve(handler)
        pool = Pool(f"http://127.0.0.1:{port}", timeout_s=0.3)
        async with pool.stream("POST", "/events", {"a": 1}) as response:
            lines = [line async for line in response.lines() if line]
        with pytest.raises(TimedOut):
            await pool.send("POST", "/slow", {})
        server.close()
        with pytest.raises(ConnectFailed):
            await Pool("http://127.0.0.1:9").send("GET", "/")
        return lines

    assert asyncio.run(main()) == [b"data: 1", b"data: 2", b"data: [DONE]"]


class _WholeAnswerBackend:
    """A backend that yields each choice as one ``Completion``, without streaming deltas."""

    kind = "whole"
    model_names = ("old",)
    trainable = True

    async def generate(self, model, request):
        from agl_core.gateway import Completion

        for index in range(request.n):
            yield Completion(
                text=f"echo {request.messages[-1]['content']}",
                finish_reason="stop",
                prompt_ids=(1, 2),
                response_ids=(3, 4),
                response_logprobs=(-0.5, -0.25),
                policy_version=7,
                index=index,
            )


def test_a_backend_without_deltas_serves_streamed_and_whole_calls():
    import openai

    from agl_core import semconv
    from agl_core.testing import GatewayServer

    with GatewayServer(_WholeAnswerBackend()) as gateway:
        client = openai.OpenAI(base_url=gateway.v1, api_key="x", max_retries=0)
        whole = client.chat.completions.create(model="old", messages=[{"role": "user", "content": "hi"}], n=2)
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model="old", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            if c.choices
        )
        spans = gateway.spans()
    assert [c.message.content for c in whole.choices] == ["echo hi", "echo hi"] and streamed == "echo hi"
    assert {s.attributes[semconv.POLICY_VERSION] for s in spans} == {7} and len(spans) == 3
