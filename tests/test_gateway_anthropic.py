"""The Anthropic Messages API of the gateway (``agl_core.gateway.protocols.anthropic``): the real
``anthropic`` SDK, sync and async, streamed and not, against the real gateway in front of a scripted policy;
the exact token ids, logprobs and policy version on each call's span; Anthropic-shaped errors for every
malformed request."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import anthropic
import httpx
import pytest

from agl_core import LLM, semconv
from agl_core.gateway import BackendError, ChatRequest, ChoiceDelta, Completion, Event
from agl_core.gateway._schema import RequestError
from agl_core.gateway.protocols.anthropic import INVALID_ARGUMENTS_KEY, parse_messages, stop_reason
from agl_core.testing import GatewayServer, ScriptedBackend, tool_call

R = semconv
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ANSWER = "It is sunny in Paris."
LOOKING = "Let me look."
COUNTING = "one two STOP three"
STORY = "Once upon a time, " * 60
BAD_ARGUMENTS = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": "}\n</tool_call>'


def _policy(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> str:
    """Answers the weather after a tool result, calls the weather tool when asked, else by keyword."""
    last = messages[-1]
    if last["role"] == "tool":
        return ANSWER
    text = str(last.get("content") or "")
    if "weather" in text and tools:
        return LOOKING + "\n" + tool_call("get_weather", {"city": "Paris"})
    for keyword, reply in (
        ("count", COUNTING),
        ("story", STORY),
        ("sloppy", BAD_ARGUMENTS),
        ("break", "FAIL"),
    ):
        if keyword in text:
            return reply
    return f"echo: {text}"


class _Policy(ScriptedBackend):
    """The scripted policy served as a sampling backend serves it: cut at ``max_tokens`` (finish
    ``length``) or at the first stop sequence (finish ``stop``, its tokens kept in the response), streamed
    in pieces of four characters (``delay`` seconds apart, tool calls as OpenAI-style pieces). A reply
    ``FAIL`` fails, mid-stream when streamed."""

    def __init__(self) -> None:
        super().__init__(_policy)
        self.policy_version = 3
        self.delay = 0.0

    def complete(self, request: ChatRequest, index: int = 0) -> Completion:
        result = super().complete(request, index)
        decode = self.tokenizer.decode
        generated = decode(result.response_ids[:-1])  # without the end-of-turn token
        found = [(generated.find(s), s) for s in request.stop if s in generated]
        if found:
            at, stop = min(found)
            return self._cut(
                result, self.tokenizer.encode(generated[: at + len(stop)]), generated[:at], "stop"
            )
        if request.max_tokens and len(result.response_ids) > request.max_tokens:
            ids = result.response_ids[: request.max_tokens]
            return self._cut(result, ids, decode(ids), "length")
        return result

    def _cut(self, result: Completion, ids: Sequence[int], text: str, finish: str) -> Completion:
        return dataclasses.replace(
            result,
            text=text,
            finish_reason=finish,
            response_ids=tuple(ids),
            response_logprobs=tuple(-0.5 for _ in ids),
            response_tokens=tuple(self.tokenizer.decode([i]) for i in ids),
            tool_calls=(),
            tool_call_unparseable=False,
        )

    async def generate(self, model: str, request: ChatRequest) -> AsyncIterator[Event]:
        result = await asyncio.to_thread(self.complete, request)
        failing = result.text == "FAIL"
        if failing and not request.stream:
            raise BackendError("the policy server went away")
        if request.stream:
            text = result.text or ""
            for at in range(0, len(text), 4):
                yield ChoiceDelta(0, text[at : at + 4])
                await asyncio.sleep(self.delay)
            if failing:
                raise BackendError("the policy server went away")
            for i, call in enumerate(result.tool_calls):
                arguments = call["function"]["arguments"]
                opening = {"name": call["function"]["name"], "arguments": ""}
                yield ChoiceDelta(0, tool_calls=({"index": i, "id": call["id"], "function": opening},))
                for at in range(0, len(arguments), 5):
                    piece = {"index": i, "function": {"arguments": arguments[at : at + 5]}}
                    yield ChoiceDelta(0, tool_calls=(piece,))
        yield result


@pytest.fixture
def gw() -> Iterator[GatewayServer]:
    with GatewayServer(_Policy()) as gateway:
        yield gateway


def _root(url: str) -> str:
    """The Anthropic SDK's base URL of a gateway base URL (the SDK appends ``/v1/messages``)."""
    return LLM(base_url=url, model="scripted").anthropic_base_url


@pytest.fixture
def client(gw: GatewayServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=_root(gw.base_url("ro-a", "at-a")), api_key="x", max_retries=0) as c:
        yield c


def _prompt_ids(gw: GatewayServer, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    backend: Any = gw.backend
    ids: list[int] = backend.tokenizer.apply_chat_template(backend.render(messages))
    return ids


def _response_ids(gw: GatewayServer, text: str, *, end: bool = True) -> list[int]:
    tokenizer: Any = gw.backend.tokenizer
    return [*tokenizer.encode(text), *([tokenizer.eos_token_id] if end else [])]


def _span(gw: GatewayServer, response_id: str) -> dict[str, Any]:
    (span,) = gw.spans(response_id)
    return dict(span.attributes or {})


def _check_span(
    gw: GatewayServer, response_id: str, messages: list[dict[str, Any]], reply: str, *, end: bool = True
) -> dict[str, Any]:
    """The call's span holds the exact prompt and response ids, their logprobs and the policy version."""
    attrs = _span(gw, response_id)
    assert attrs[R.GATEWAY_PROTOCOL] == "messages" and attrs[R.GEN_AI_RESPONSE_ID] == response_id
    assert json.loads(attrs[R.GEN_AI_INPUT_MESSAGES]) == messages
    assert list(attrs[R.PROMPT_TOKEN_IDS]) == _prompt_ids(gw, messages)
    assert list(attrs[R.RESPONSE_TOKEN_IDS]) == _response_ids(gw, reply, end=end)
    assert list(attrs[R.RESPONSE_LOGPROBS]) == [-0.5] * len(attrs[R.RESPONSE_TOKEN_IDS])
    assert attrs[R.POLICY_VERSION] == 3 and attrs[R.ROLLOUT_ID] == "ro-a"
    return attrs


# --- served ---------------------------------------------------------------------------------------------
def test_a_message_with_a_system_prompt(gw, client):
    reply = client.messages.create(
        model="scripted",
        max_tokens=100,
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": " Be kind."}],
        messages=[{"role": "user", "content": "hello"}],
        metadata={"user_id": "u-1"},
        extra_body={"temperature": 0.5, "top_k": 5},  # anthropic >= 1.0 sends sampling options this way
    )
    assert reply.id.startswith("msg_") and (reply.type, reply.role, reply.model) == (
        "message",
        "assistant",
        "scripted",
    )
    assert [(b.type, b.text) for b in reply.content] == [("text", "echo: hello")]
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    messages = [{"role": "system", "content": "Be brief. Be kind."}, {"role": "user", "content": "hello"}]
    attrs = _check_span(gw, reply.id, messages, "echo: hello")
    assert reply.usage.model_dump(exclude_none=True) == {
        "input_tokens": len(attrs[R.PROMPT_TOKEN_IDS]),
        "output_tokens": len(attrs[R.RESPONSE_TOKEN_IDS]),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    assert attrs[R.GEN_AI_REQUEST_TEMPERATURE] == 0.5 and attrs[R.GEN_AI_REQUEST_MAX_TOKENS] == 100


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_and_its_result_round_trip_under_the_backends_call_id(gw, client, streamed):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    if streamed:
        with client.messages.stream(
            model="scripted", max_tokens=200, messages=question, tools=[WEATHER]
        ) as s:
            kinds = [event.type for event in s]
            first = s.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    else:
        first = client.messages.create(model="scripted", max_tokens=200, messages=question, tools=[WEATHER])
    text, use = first.content
    assert (text.type, text.text) == ("text", LOOKING)
    assert (use.type, use.id, use.name, use.input) == ("tool_use", "call_1", "get_weather", {"city": "Paris"})
    assert first.stop_reason == "tool_use"
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    attrs = _check_span(gw, first.id, question, LOOKING + "\n" + tool_call("get_weather", {"city": "Paris"}))
    assert json.loads(attrs[R.GEN_AI_OUTPUT_MESSAGES]) == [
        {"role": "assistant", "content": LOOKING, "tool_calls": [call]}
    ]
    assert attrs[R.TOOL_CALL_MALFORMED] is False and attrs[R.STREAM] is streamed
    assert first.usage.input_tokens == len(attrs[R.PROMPT_TOKEN_IDS])

    follow_up = [
        *question,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "sunny"}]}
            ],
        },
    ]
    second = client.messages.create(model="scripted", max_tokens=200, messages=follow_up, tools=[WEATHER])
    assert [b.text for b in second.content] == [ANSWER]
    internal = [
        *question,
        {"role": "assistant", "content": LOOKING, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    _check_span(gw, second.id, internal, ANSWER)


def test_async_streams_raw_events_and_the_stream_helper(gw):
    async def main() -> tuple[list[Any], Any]:
        async with anthropic.AsyncAnthropic(
            base_url=_root(gw.base_url("ro-a", "at-a")), api_key="x", max_retries=0
        ) as c:
            raw = await c.messages.create(
                model="scripted",
                max_tokens=200,
                messages=[{"role": "user", "content": "What is the weather?"}],
                tools=[WEATHER],
                stream=True,
            )
            events = [event async for event in raw]
            async with c.messages.stream(
                model="scripted", max_tokens=200, messages=[{"role": "user", "content": "hi there"}]
            ) as s:
                final = await s.get_final_message()
        return events, final

    events, final = asyncio.run(main())
    assert [(e.type, getattr(e, "index", None)) for e in events] == [
        ("message_start", None),
        ("content_block_start", 0),
        *[("content_block_delta", 0)] * 3,  # "Let me look." in pieces of four
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("message_delta", None),
        ("message_stop", None),
    ]
    start, delta = events[0], events[-2]
    attrs = _span(gw, start.message.id)
    assert start.message.content == [] and start.message.stop_reason is None
    # the policy streams: its prompt's count is not known yet when the first text goes out
    assert (start.message.usage.input_tokens, start.message.usage.output_tokens) == (0, 0)
    assert "".join(e.delta.text for e in events[2:5]) == LOOKING
    assert events[6].content_block.model_dump(exclude_none=True) == {
        "type": "tool_use",
        "id": "call_1",
        "name": "get_weather",
        "input": {},
    }
    assert json.loads(events[7].delta.partial_json) == {"city": "Paris"}
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("tool_use", None)
    assert (delta.usage.input_tokens, delta.usage.output_tokens) == (
        len(attrs[R.PROMPT_TOKEN_IDS]),
        len(attrs[R.RESPONSE_TOKEN_IDS]),
    )
    assert [b.text for b in final.content] == ["echo: hi there"] and final.stop_reason == "end_turn"
    assert _span(gw, final.id)[R.STREAM] is True


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_stop_sequence_and_max_tokens_end_the_message(gw, client, streamed):
    def ask(content: str, **options: Any) -> Any:
        messages = [{"role": "user", "content": content}]
        if not streamed:
            return client.messages.create(model="scripted", messages=messages, **options)
        with client.messages.stream(model="scripted", messages=messages, **options) as s:
            return s.get_final_message()

    stopped = ask("count please", max_tokens=100, stop_sequences=["NEVER", "STOP"])
    assert [b.text for b in stopped.content] == ["one two "]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "STOP")
    _check_span(gw, stopped.id, [{"role": "user", "content": "count please"}], "one two STOP", end=False)

    cut = ask("a story please", max_tokens=7)
    assert [b.text for b in cut.content] == [STORY[:7]]
    assert (cut.stop_reason, cut.stop_sequence) == ("max_tokens", None) and cut.usage.output_tokens == 7
    _check_span(gw, cut.id, [{"role": "user", "content": "a story please"}], STORY[:7], end=False)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_call_whose_arguments_do_not_parse_is_a_valid_block_and_marked(gw, client, streamed):
    messages = [{"role": "user", "content": "Be sloppy."}]
    if streamed:
        with client.messages.stream(
            model="scripted", max_tokens=200, messages=messages, tools=[WEATHER]
        ) as s:
            reply = s.get_final_message()
    else:
        reply = client.messages.create(model="scripted", max_tokens=200, messages=messages, tools=[WEATHER])
    (use,) = reply.content
    assert (use.type, use.id, use.name) == ("tool_use", "call_1", "get_weather")
    assert use.input == {INVALID_ARGUMENTS_KEY: '{"city": '}
    attrs = _check_span(gw, reply.id, messages, BAD_ARGUMENTS)
    assert attrs[R.TOOL_CALL_MALFORMED] is True
    assert list(attrs[R.TOOL_CALL_MALFORMED_REASONS]) == [R.TOOL_CALL_INVALID_ARGUMENTS]
    assert list(attrs[R.TOOL_CALL_MALFORMED_IDS]) == ["call_1"]


def test_an_agent_scoped_url_names_the_agent(gw):
    llm = LLM(base_url=gw.base_url("ro-a", "at-a"), model="scripted").for_agent("solver")
    with anthropic.Anthropic(base_url=llm.anthropic_base_url, api_key="x", max_retries=0) as c:
        reply = c.messages.create(
            model="scripted", max_tokens=20, messages=[{"role": "user", "content": "hi"}]
        )
    attrs = _span(gw, reply.id)
    assert (attrs[R.GEN_AI_AGENT_NAME], attrs[R.ROLLOUT_ID], attrs[R.ATTEMPT_ID]) == (
        "solver",
        "ro-a",
        "at-a",
    )
    assert 'endpoint="messages",code="200"' in httpx.get(gw.url + "/metrics").text


# --- refused ----------------------------------------------------------------------------------------------
def _body(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "scripted",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}],
    }
    body.update(changes)
    return {k: v for k, v in body.items() if v is not None}


def _user(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(blocks)}]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
REFUSED = [
    ("bad-json", b'{"model": "scripted",', 400, "invalid_request_error", "the body is not valid JSON"),
    ("not-an-object", b"[1, 2]", 400, "invalid_request_error", "the body must be a JSON object"),
    ("no-max-tokens", _body(max_tokens=None), 400, "invalid_request_error", "max_tokens: Field required"),
    (
        "zero-max-tokens",
        _body(max_tokens=0),
        400,
        "invalid_request_error",
        "max_tokens: Input should be greater",
    ),
    (
        "no-messages",
        _body(messages=[]),
        400,
        "invalid_request_error",
        "messages: List should have at least 1",
    ),
    (
        "system-role",
        _body(messages=[{"role": "system", "content": "x"}]),
        400,
        "invalid_request_error",
        "messages.0.role: Input should be 'user' or 'assistant'",
    ),
    (
        "content-number",
        _body(messages=[{"role": "user", "content": 5}]),
        400,
        "invalid_request_error",
        "messages.0.content: must be a string or a list",
    ),
    (
        "image",
        _body(messages=_user({"type": "text", "text": "what is this?"}, IMAGE)),
        400,
        "invalid_request_error",
        "messages.0.content.1: content blocks of type 'image' are not supported",
    ),
    (
        "image-in-tool-result",
        _body(messages=_user({"type": "tool_result", "tool_use_id": "c1", "content": [IMAGE]})),
        400,
        "invalid_request_error",
        "messages.0.content.0.content.0: content blocks of type 'image'",
    ),
    (
        "document",
        _body(messages=_user({"type": "document", "source": {}})),
        400,
        "invalid_request_error",
        "type 'document' are not supported",
    ),
    (
        "tool-use-from-user",
        _body(messages=_user({"type": "tool_use", "id": "c", "name": "f", "input": {}})),
        400,
        "invalid_request_error",
        "messages.0.content.0: a tool_use block belongs in an assistant message",
    ),
    (
        "prefill",
        _body(
            messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
        ),
        400,
        "invalid_request_error",
        "continuing a prefilled assistant turn is not supported",
    ),
    (
        "server-tool",
        _body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        400,
        "invalid_request_error",
        "tools of type 'web_search_20250305' are Anthropic server tools",
    ),
    (
        "bash-tool",
        _body(tools=[{"type": "bash_20250124", "name": "bash"}]),
        400,
        "invalid_request_error",
        "'bash_20250124'",
    ),
    (
        "tool-name",
        _body(tools=[{**WEATHER, "name": "get weather"}]),
        400,
        "invalid_request_error",
        "tools.0.name: String should match pattern",
    ),
    (
        "tool-schema",
        _body(tools=[{**WEATHER, "input_schema": {"type": "thing"}}]),
        400,
        "invalid_request_error",
        "tools.0.input_schema: input_schema.type must be one of",
    ),
    (
        "no-schema",
        _body(tools=[{"name": "f"}]),
        400,
        "invalid_request_error",
        "tools.0.input_schema: Field required",
    ),
    (
        "repeated-tools",
        _body(tools=[WEATHER, WEATHER]),
        400,
        "invalid_request_error",
        "repeated: get_weather",
    ),
    (
        "choice-unknown-tool",
        _body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}),
        400,
        "invalid_request_error",
        "tool_choice names tool 'nope'",
    ),
    (
        "choice-any-no-tools",
        _body(tool_choice={"type": "any"}),
        400,
        "invalid_request_error",
        'tool_choice "any" needs at least one tool',
    ),
    (
        "choice-type",
        _body(tool_choice={"type": "required"}),
        400,
        "invalid_request_error",
        'tool_choice.type must be "auto", "any", "tool" or "none"',
    ),
    (
        "temperature",
        _body(temperature=1.5),
        400,
        "invalid_request_error",
        "temperature: Input should be less than or equal to 1",
    ),
    (
        "unknown-model",
        _body(model="claude-nope"),
        404,
        "not_found_error",
        "model 'claude-nope' does not exist here",
    ),
]


@pytest.mark.parametrize(
    ("body", "status", "kind", "fragment"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_a_malformed_request_gets_anthropics_error_shape_and_the_gateway_keeps_serving(
    gw, body, status, kind, fragment
):
    url = gw.base_url("ro-a", "at-a") + "/messages"
    with httpx.Client(timeout=10) as http:
        refused = http.post(url, **({"content": body} if isinstance(body, bytes) else {"json": body}))
        assert refused.status_code == status
        error = refused.json()
        assert error["type"] == "error" and set(error) == {"type", "error"}
        assert error["error"]["type"] == kind and fragment in error["error"]["message"], error
        assert http.post(url, json=_body()).json()["content"] == [{"type": "text", "text": "echo: hi"}]
    assert gw.spans() and all(R.ERROR_TYPE not in (s.attributes or {}) for s in gw.spans())


def test_the_sdk_raises_its_own_errors(gw, client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model="scripted",
            max_tokens=10,
            messages=_user(IMAGE),
        )
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="claude-nope", max_tokens=10, messages=[{"role": "user", "content": "x"}]
        )


def test_an_oversized_body_is_413_request_too_large(gw):
    big = (
        b'{"model": "scripted", "max_tokens": 5, "messages": [{"role": "user", "content": "'
        + b"x" * (9 << 20)
        + b'"}]}'
    )
    with httpx.Client(timeout=30) as http:
        refused = http.post(gw.v1 + "/messages", content=big, headers={"content-type": "application/json"})
        assert refused.status_code == 413 and refused.json()["error"]["type"] == "request_too_large"
        assert http.post(gw.v1 + "/messages", json=_body()).status_code == 200


def test_a_backend_failure_is_an_api_error_whole_or_mid_stream(gw, client):
    with pytest.raises(anthropic.APIStatusError) as whole:
        client.messages.create(
            model="scripted", max_tokens=50, messages=[{"role": "user", "content": "break it"}]
        )
    assert whole.value.status_code == 502
    assert whole.value.body["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError) as streamed:
        with client.messages.stream(
            model="scripted", max_tokens=50, messages=[{"role": "user", "content": "break it now"}]
        ) as s:
            for _ in s:
                pass
    assert streamed.value.body == {
        "type": "error",
        "error": {"type": "api_error", "message": "the model backend failed: the policy server went away"},
    }
    failed = [s.attributes or {} for s in gw.spans()]
    assert [a[R.ERROR_TYPE] for a in failed] == ["backend_error", "backend_error"]
    assert not any(R.RESPONSE_TOKEN_IDS in a for a in failed)
    assert client.messages.create(
        model="scripted", max_tokens=20, messages=[{"role": "user", "content": "ok"}]
    )


def test_a_stream_cut_off_by_the_client_records_no_span_that_trains(gw):
    gw.backend.delay = 0.01
    before = gw.metrics.client_disconnects
    body = _body(max_tokens=2000, stream=True, messages=[{"role": "user", "content": "a long story"}])
    with httpx.stream("POST", gw.base_url("ro-gone") + "/messages", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == "event: content_block_delta":
                break
    deadline = time.monotonic() + 10
    while gw.metrics.client_disconnects == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gw.metrics.client_disconnects == before + 1 and gw.metrics.inflight == 0
    (span,) = [s for s in gw.spans() if (s.attributes or {}).get(R.ROLLOUT_ID) == "ro-gone"]
    attrs = dict(span.attributes or {})
    assert attrs[R.ERROR_TYPE] == "client_disconnected" and attrs[R.GATEWAY_PROTOCOL] == "messages"
    assert R.RESPONSE_TOKEN_IDS not in attrs and R.PROMPT_TOKEN_IDS not in attrs


@pytest.mark.timing
def test_count_tokens_is_refused_with_a_501_the_sdk_does_not_retry(gw, client):
    started = time.monotonic()
    with pytest.raises(anthropic.APIStatusError) as refused:
        client.with_options(max_retries=2).messages.count_tokens(
            model="scripted", messages=[{"role": "user", "content": "hi"}]
        )
    assert refused.value.status_code == 501 and time.monotonic() - started < 2
    assert refused.value.body["error"]["type"] == "api_error"
    assert gw.backend.calls == 0


# --- the request as the backends see it -------------------------------------------------------------------
def _parse(**changes: Any) -> ChatRequest:
    return parse_messages(json.dumps(_body(**changes)).encode())[1]


def test_blocks_become_the_internal_chat_messages():
    chat = _parse(
        system="Be brief.",
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "redacted_thinking", "data": "..."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Nice"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": "no such city",
                        "is_error": True,
                    },
                    {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}},
                ],
            },
        ],
        tools=[{**WEATHER, "cache_control": {"type": "ephemeral"}}],
        stop_sequences=["END", ""],
        top_p=0.9,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    calls = [
        {
            "id": f"toolu_{i}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": c})},
        }
        for i, c in ((1, "Paris"), (2, "Nice"))
    ]
    assert list(chat.messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "no such city"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    (tool,) = chat.tools or ()
    assert tool == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"],
        },
    }
    assert (chat.stop, chat.top_p, chat.temperature, chat.max_tokens, chat.n) == (("END",), 0.9, 1.0, 10, 1)
    assert chat.tool_choice is None and not chat.stream and not chat.logprobs


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any", "disable_parallel_tool_use": True}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
def test_tool_choice_maps_to_the_internal_one(choice, expected):
    chat = _parse(tools=[WEATHER], tool_choice=choice)
    assert chat.tool_choice == expected
    assert chat.forced_tool == (choice.get("name") if choice["type"] == "tool" else None)
    assert chat.tools_enabled is (choice["type"] != "none")


def test_a_tool_result_must_name_its_call():
    with pytest.raises(RequestError, match="tool_use_id must be a non-empty string"):
        _parse(messages=_user({"type": "tool_result", "content": "x"}))


def _done(text: str | None, finish: str, tokens: Sequence[str] = (), calls: Sequence[Any] = ()) -> Completion:
    return Completion(
        text, finish, (1,), tuple(range(len(tokens))), None, 0, tuple(tokens), tool_calls=tuple(calls)
    )


@pytest.mark.parametrize(
    ("result", "stops", "expected"),
    [
        (None, (), ("end_turn", None)),
        (_done("hi", "stop", ["hi", "<|im_end|>"]), ("STOP",), ("end_turn", None)),
        (_done("a ", "stop", ["a", " S", "TOP"]), ("END", "STOP"), ("stop_sequence", "STOP")),
        (_done("a ", "stop", ["a", " ST"]), ("STOP", "ST"), ("stop_sequence", "ST")),
        (_done("a ", "stop", ["a", " STOP"]), ("ST", "STOP"), ("stop_sequence", "STOP")),  # the longer
        (_done("a", "length", ["a", "b"]), ("b",), ("max_tokens", None)),
        (_done(None, "tool_calls", ["x"], [{"id": "c"}]), (), ("tool_use", None)),
        (_done("", "content_filter"), (), ("refusal", None)),
    ],
)
def test_stop_reason(result, stops, expected):
    assert stop_reason(result, stops) == expected
