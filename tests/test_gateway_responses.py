"""The Responses API door (``POST /v1/responses``) with the real ``openai`` client against the real gateway,
in front of scripted policies (``agl_core.testing``): the answers and events the client parses, the spans
with the exact token ids, ``previous_response_id``, and every request it must refuse."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import httpx
import pytest
from openai import BadRequestError, OpenAI

from agl_core import semconv
from agl_core.gateway import BackendError, ChatRequest, ChoiceDelta, Completion, Event
from agl_core.gateway._door import logprob_entries
from agl_core.gateway.protocols.responses import ResponseLog
from agl_core.pipeline.transitions import NO_LLM_CALL, spans_to_transitions
from agl_core.testing import AglTestStack, GatewayServer, ScriptedBackend, tool_call
from agl_core.tracing import emit_reward, rollout_scope

R = semconv
QUESTION = "What is the weather in Paris?"
INSTRUCTIONS = "You answer weather questions."
LOOKUP = "Let me look that up."
ANSWER = "It is sunny in Paris."
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}
CALL_REPLY = LOOKUP + "\n" + tool_call("get_weather", {"city": "Paris"})


def weather_script(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> str:
    """Calls get_weather (after a few words) until a tool result is in the conversation, then answers;
    a question naming another tool calls that one; "ramble" gets a long text."""
    last = str(messages[-1].get("content") or "")
    if messages[-1]["role"] == "tool":
        return ANSWER
    if "Use multiply" in last:
        return tool_call("multiply", {"a": 2})
    if "ramble" in last:
        return "la " * 200
    return CALL_REPLY


class PieceBackend(ScriptedBackend):
    """The scripted policy, streamed in pieces as an OpenAI-compatible server streams: text four characters
    at a time (with their logprob entries), then each tool call as an opening delta (id, name) and pieces
    of its arguments. Tool call ids are ``call_<name>_<n>``, the same for the same reply. ``max_tokens``
    cuts the reply (finish reason ``length``); ``pause`` waits between pieces; ``fail_after`` pieces in,
    the backend fails."""

    def __init__(self, script: Any, *, pause: float = 0.0, fail_after: int | None = None) -> None:
        super().__init__(script)
        self.pause = pause
        self.fail_after = fail_after

    def complete(self, request: ChatRequest, index: int = 0) -> Completion:
        result = super().complete(request, index)
        calls = tuple(
            {**c, "id": f"call_{c['function']['name']}_{n}"} for n, c in enumerate(result.tool_calls)
        )
        result = dataclasses.replace(result, tool_calls=calls)
        if request.max_tokens and len(result.response_ids) > request.max_tokens:
            ids = result.response_ids[: request.max_tokens]
            result = dataclasses.replace(
                result,
                text=self.tokenizer.decode(list(ids)),
                tool_calls=(),
                finish_reason="length",
                response_ids=ids,
                response_logprobs=(result.response_logprobs or ())[: len(ids)],
                response_tokens=result.response_tokens[: len(ids)],
            )
        return result

    async def generate(self, model: str, request: ChatRequest) -> AsyncIterator[Event]:
        result = await asyncio.to_thread(self.complete, request)
        if request.stream:
            entries = logprob_entries(result, request.top_logprobs) if request.logprobs else []
            text = result.text or ""
            pieces: list[ChoiceDelta] = [
                ChoiceDelta(0, text[k : k + 4], logprobs=tuple(entries[k : k + 4]))  # one byte per token
                for k in range(0, len(text), 4)
            ]
            for i, call in enumerate(result.tool_calls):
                fn = call["function"]
                opening = {"index": i, "id": call["id"], "type": "function", "function": {"name": fn["name"]}}
                pieces.append(ChoiceDelta(0, tool_calls=(opening,)))
                args = fn["arguments"]
                pieces += [
                    ChoiceDelta(0, tool_calls=({"index": i, "function": {"arguments": args[k : k + 5]}},))
                    for k in range(0, len(args), 5)
                ]
            for n, piece in enumerate(pieces):
                if self.fail_after is not None and n == self.fail_after:
                    raise BackendError("the policy server went away")
                yield piece
                await asyncio.sleep(self.pause)
        yield result


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayServer]:
    with GatewayServer(ScriptedBackend(weather_script)) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def pieces() -> Iterator[GatewayServer]:
    with GatewayServer(PieceBackend(weather_script)) as gateway:
        yield gateway


def client(gateway: GatewayServer, rollout_id: str, attempt_id: str | None = "at-1") -> OpenAI:
    return OpenAI(base_url=gateway.base_url(rollout_id, attempt_id), api_key="x", max_retries=0)


def expected_prompt(gateway: GatewayServer, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt ids the scripted backend renders for these internal messages."""
    backend = gateway.backend
    assert isinstance(backend, ScriptedBackend)
    ids = backend.tokenizer.apply_chat_template(backend.render(messages), add_generation_prompt=True)
    assert isinstance(ids, list)
    return ids


def reply_ids(gateway: GatewayServer, text: str) -> list[int]:
    backend = gateway.backend
    assert isinstance(backend, ScriptedBackend)
    return [*backend.tokenizer.encode(text), backend.tokenizer.eos_token_id]


def internal_call(call_id: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }


FIRST_TURN = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]


# --- answers, spans, conversations -------------------------------------------------------------------------
def test_a_response_with_instructions_and_a_function_tool(gw):
    r = client(gw, "ro-resp-1").responses.create(
        model="scripted", instructions=INSTRUCTIONS, input=QUESTION, tools=[TOOL]
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    message, call = r.output
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "completed"
    assert r.output_text == LOOKUP and message.content[0].logprobs == []
    assert call.type == "function_call" and call.id.startswith("fc_") and call.status == "completed"
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert r.instructions == INSTRUCTIONS and r.tool_choice == "auto" and r.parallel_tool_calls is True
    assert r.tools[0].name == "get_weather" and r.tools[0].strict is True

    (span,) = gw.spans(r.id)
    attrs = span.attributes
    assert attrs[R.GATEWAY_PROTOCOL] == "responses" and attrs[R.GEN_AI_OPERATION_NAME] == R.OP_CHAT
    assert attrs[R.ROLLOUT_ID] == "ro-resp-1" and attrs[R.ATTEMPT_ID] == "at-1"
    assert list(attrs[R.PROMPT_TOKEN_IDS]) == expected_prompt(gw, FIRST_TURN)
    assert list(attrs[R.RESPONSE_TOKEN_IDS]) == reply_ids(gw, CALL_REPLY)
    assert list(attrs[R.RESPONSE_LOGPROBS]) == [-0.5] * len(attrs[R.RESPONSE_TOKEN_IDS])
    assert attrs[R.POLICY_VERSION] == 0 and attrs[R.TOOL_CALL_MALFORMED] is False
    # the call id the client got is the one the span records: tool spans are matched by it
    (recorded,) = json.loads(attrs[R.GEN_AI_OUTPUT_MESSAGES])[0]["tool_calls"]
    assert recorded["id"] == call.call_id
    assert json.loads(attrs[R.GEN_AI_TOOL_DEFINITIONS])[0]["function"]["name"] == "get_weather"
    usage = r.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens) == (
        len(attrs[R.PROMPT_TOKEN_IDS]),
        len(attrs[R.RESPONSE_TOKEN_IDS]),
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_structured_output_is_accepted_and_echoed_like_chat_response_format(gw):
    """An Agents SDK agent with an ``output_type`` asks for a JSON schema; it is served (not enforced, as
    Chat Completions' ``response_format`` is not) and the format is echoed back."""
    fmt = {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}
    r = client(gw, "ro-resp-json").responses.create(
        model="scripted",
        input=QUESTION,
        text={"format": fmt},  # type: ignore[arg-type]
    )
    assert r.status == "completed" and r.text is not None and r.text.format is not None
    assert r.text.format.type == "json_schema"
    (span,) = gw.spans(r.id)
    assert span.attributes[R.RESPONSE_TOKEN_IDS]


def test_a_function_call_output_follow_up_sends_the_whole_turn_back(gw):
    """The client sends the conversation back as items: the assistant's text and its function call make
    one assistant turn again, so the policy sees its own answer as it wrote it."""
    oa = client(gw, "ro-resp-2")
    first = oa.responses.create(model="scripted", instructions=INSTRUCTIONS, input=QUESTION, tools=[TOOL])
    call = first.output[1]
    items: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "reasoning", "id": "rs_1", "summary": []},  # ignored
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    second = oa.responses.create(model="scripted", instructions=INSTRUCTIONS, input=items, tools=[TOOL])
    assert second.output_text == ANSWER and [o.type for o in second.output] == ["message"]
    (span,) = gw.spans(second.id)
    conversation = [
        *FIRST_TURN,
        {"role": "assistant", "content": LOOKUP, "tool_calls": [internal_call(call.call_id)]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    assert json.loads(span.attributes[R.GEN_AI_INPUT_MESSAGES]) == conversation
    assert list(span.attributes[R.PROMPT_TOKEN_IDS]) == expected_prompt(gw, conversation)
    assert list(span.attributes[R.RESPONSE_TOKEN_IDS]) == reply_ids(gw, ANSWER)


def test_previous_response_id_continues_with_the_same_prompt_as_the_full_input(gw):
    oa = client(gw, "ro-resp-3")
    first = oa.responses.create(model="scripted", instructions=INSTRUCTIONS, input=QUESTION, tools=[TOOL])
    call_id = first.output[1].call_id
    output = {"type": "function_call_output", "call_id": call_id, "output": "sunny"}
    second = oa.responses.create(
        model="scripted",
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        input=[output],
        tools=[TOOL],
    )
    assert second.output_text == ANSWER and second.previous_response_id == first.id
    conversation = [
        *FIRST_TURN,
        {"role": "assistant", "content": LOOKUP, "tool_calls": [internal_call(call_id)]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]
    (span,) = gw.spans(second.id)
    assert list(span.attributes[R.PROMPT_TOKEN_IDS]) == expected_prompt(gw, conversation)
    # a chain of continuations; instructions are not carried over (the Responses API's rule)
    third = oa.responses.create(model="scripted", previous_response_id=second.id, input="And tomorrow?")
    (span,) = gw.spans(third.id)
    assert json.loads(span.attributes[R.GEN_AI_INPUT_MESSAGES]) == [
        *conversation[1:],
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "And tomorrow?"},
    ]

    # another rollout, another attempt, or no rollout at all cannot continue it
    for other in (
        client(gw, "ro-resp-other"),
        client(gw, "ro-resp-3", "at-2"),
        client(gw, "ro-resp-3", None),
    ):
        with pytest.raises(BadRequestError) as refused:
            other.responses.create(model="scripted", previous_response_id=first.id, input=[output])
        assert refused.value.body["param"] == "previous_response_id"
        assert "send the full input" in refused.value.body["message"]
    # the rollout header attributes (and scopes) a call too
    headed = OpenAI(base_url=gw.v1, api_key="x", max_retries=0, default_headers={R.HEADER_ROLLOUT_ID: "ro-h"})
    start = headed.responses.create(model="scripted", input=QUESTION)
    assert headed.responses.create(model="scripted", previous_response_id=start.id, input="ok").status == (
        "completed"
    )
    # store=false: nothing to continue from
    unstored = oa.responses.create(model="scripted", input=QUESTION, store=False)
    assert unstored.store is False
    with pytest.raises(BadRequestError):
        oa.responses.create(model="scripted", previous_response_id=unstored.id, input="ok")


def test_the_response_log_keeps_the_most_recently_used():
    log = ResponseLog(capacity=2)
    scope = ("ro", "at")
    log.put(scope, "resp_a", ({"role": "user", "content": "a"},))
    log.put(scope, "resp_b", ())
    assert log.get(scope, "resp_a") is not None  # now the most recently used
    log.put(scope, "resp_c", ())
    assert len(log) == 2 and log.get(scope, "resp_b") is None and log.get(scope, "resp_a") is not None
    assert log.get(("ro", None), "resp_a") is None
    with pytest.raises(ValueError, match="capacity"):
        ResponseLog(capacity=0)


def test_logprobs_are_shown_when_asked(gw):
    oa = client(gw, "ro-resp-logprobs")
    r = oa.responses.create(
        model="scripted", input="Say hi", include=["message.output_text.logprobs"], top_logprobs=0
    )
    (span,) = gw.spans(r.id)
    entries = r.output[0].content[0].logprobs
    assert entries is not None
    assert [e.logprob for e in entries] == list(span.attributes[R.RESPONSE_LOGPROBS])
    assert "".join(e.token for e in entries[:-1]) == CALL_REPLY  # then the end-of-turn token
    assert r.top_logprobs == 0
    plain = oa.responses.create(model="scripted", input="Say hi")
    assert plain.output[0].content[0].logprobs == []


def test_a_malformed_tool_call_is_marked_and_still_delivered(gw):
    r = client(gw, "ro-resp-bad").responses.create(
        model="scripted", input="Use multiply: 2 * 3", tools=[TOOL]
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "multiply"
    (span,) = gw.spans(r.id)
    assert span.attributes[R.TOOL_CALL_MALFORMED] is True
    assert list(span.attributes[R.TOOL_CALL_MALFORMED_REASONS]) == [R.TOOL_CALL_UNKNOWN_TOOL]
    assert list(span.attributes[R.TOOL_CALL_MALFORMED_IDS]) == [call.call_id]


def test_tool_choice_forms(gw):
    oa = client(gw, "ro-resp-choice")
    named = oa.responses.create(
        model="scripted",
        input=QUESTION,
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert named.tool_choice.name == "get_weather"
    (span,) = gw.spans(named.id)
    assert span.attributes[R.TOOL_CALL_MALFORMED] is False
    off = oa.responses.create(model="scripted", input=QUESTION, tools=[TOOL], tool_choice="none")
    assert off.tool_choice == "none"
    (span,) = gw.spans(off.id)
    assert R.TOOL_CALL_MALFORMED not in span.attributes  # tools switched off: nothing to check


# --- streaming --------------------------------------------------------------------------------------------
def _events(gateway: GatewayServer, body: dict[str, Any], rollout_id: str) -> list[dict[str, Any]]:
    """The server-sent events of a streamed request, checking each ``event:`` line names its data."""
    events = []
    with httpx.stream(
        "POST", gateway.base_url(rollout_id) + "/responses", json={**body, "stream": True}, timeout=30
    ) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == kind
                events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _without_ids(items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Output items but for their own ids (each response has its own)."""
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


@pytest.mark.parametrize("backend", ["whole", "pieces"])
def test_a_streamed_response_ends_equal_to_the_non_streamed_one(gw, pieces, backend):
    gateway = gw if backend == "whole" else pieces
    oa = client(gateway, f"ro-resp-stream-{backend}")
    kwargs: dict[str, Any] = {
        "model": "scripted",
        "instructions": INSTRUCTIONS,
        "input": QUESTION,
        "tools": [TOOL],
        "include": ["message.output_text.logprobs"],
    }
    with oa.responses.stream(**kwargs) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == LOOKUP and final.output_text == LOOKUP and final.status == "completed"
    assert [o.type for o in final.output] == ["message", "function_call"]
    (span,) = gateway.spans(final.id)
    assert span.attributes[R.STREAM] is True and span.attributes[R.GATEWAY_PROTOCOL] == "responses"
    assert list(span.attributes[R.RESPONSE_TOKEN_IDS]) == reply_ids(gateway, CALL_REPLY)
    assert json.loads(span.attributes[R.GEN_AI_OUTPUT_MESSAGES])[0]["tool_calls"][0]["id"] == (
        final.output[1].call_id
    )
    logprobs = final.output[0].content[0].logprobs
    assert [e.logprob for e in logprobs] == list(span.attributes[R.RESPONSE_LOGPROBS])

    events = _events(gateway, kwargs, f"ro-resp-stream-{backend}-raw")
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.completed" and events[-1]["response"]["status"] == "completed"
    for kind in (
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    ):
        assert kind in kinds
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1] and added[1]["item"]["status"] == "in_progress"
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Paris"}
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert all(e["item_id"] == added[0]["item"]["id"] and e["content_index"] == 0 for e in deltas)
    assert events[-1]["response"]["output"][1]["arguments"] == arguments
    if backend == "pieces":  # its call ids depend on the reply only: the non-streamed items are the same
        whole = httpx.post(gateway.base_url("ro-resp-whole") + "/responses", json=kwargs).json()
        assert _without_ids(events[-1]["response"]["output"]) == _without_ids(whole["output"])
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert _without_ids(done) == _without_ids(whole["output"])


def test_the_openai_client_streams_with_create_too(pieces):
    oa = client(pieces, "ro-resp-create-stream")
    kinds = [e.type for e in oa.responses.create(model="scripted", input="hello", stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


def test_max_output_tokens_makes_an_incomplete_response(pieces):
    oa = client(pieces, "ro-resp-length")
    cut = oa.responses.create(model="scripted", input="hello", max_output_tokens=5)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens" and cut.output_text == LOOKUP[:5]
    assert cut.max_output_tokens == 5
    events = _events(pieces, {"model": "scripted", "input": "hello", "max_output_tokens": 5}, "ro-resp-len2")
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    (span,) = pieces.spans(events[-1]["response"]["id"])
    assert span.attributes[R.GEN_AI_REQUEST_MAX_TOKENS] == 5
    assert list(span.attributes[R.GEN_AI_RESPONSE_FINISH_REASONS]) == ["length"]


def test_a_backend_failure_mid_stream_is_a_failed_response():
    with GatewayServer(PieceBackend(weather_script, fail_after=2)) as gateway:
        events = _events(gateway, {"model": "scripted", "input": QUESTION}, "ro-resp-fail")
        assert events[-1]["type"] == "response.failed"
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and "went away" in failed["error"]["message"]
        assert failed["error"]["code"] == "server_error"
        (span,) = gateway.spans(failed["id"])
        assert (
            span.attributes[R.ERROR_TYPE] == "backend_error" and R.RESPONSE_TOKEN_IDS not in span.attributes
        )
        # the failed response cannot be continued, and the gateway serves on
        r = httpx.post(
            gateway.base_url("ro-resp-fail") + "/responses",
            json={"model": "scripted", "input": "x", "previous_response_id": failed["id"]},
        )
        assert r.status_code == 400
        gateway.backend.fail_after = None
        assert client(gateway, "ro-resp-fail", None).responses.create(model="scripted", input="x").output


def test_a_client_leaving_mid_stream_leaves_no_span_that_trains():
    rollout_id = "ro-resp-gone"
    with AglTestStack(PieceBackend(weather_script, pause=0.05)) as stack:
        gateway = stack.gateway
        with rollout_scope(rollout_id, "at-1", tracer_provider=stack.provider):
            body = {"model": "scripted", "input": "ramble please", "stream": True}
            with httpx.stream("POST", stack.base_url(rollout_id, "at-1") + "/responses", json=body) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line == "event: response.output_text.delta":
                        break
            deadline = time.monotonic() + 10
            while not gateway.spans() and time.monotonic() < deadline:
                time.sleep(0.02)
            emit_reward(1.0, tracer_provider=stack.provider)
        assert gateway.metrics.client_disconnects == 1 and gateway.metrics.inflight == 0
        (span,) = gateway.spans()
        assert span.attributes[R.ERROR_TYPE] == "client_disconnected"
        assert R.RESPONSE_TOKEN_IDS not in span.attributes
        spans = stack.wait_for_spans(3, rollout_id)  # the rollout, its reward and the failed call
        assert [s.is_error for s in spans if s.attributes.get(R.SOURCE) == R.SOURCE_GATEWAY] == [True]
        result = spans_to_transitions(spans)
        assert result.transitions == () and result.reasons() == {NO_LLM_CALL: 1}
        # nothing to continue from: the client never got the response whole
        r = httpx.post(
            stack.base_url(rollout_id, "at-1") + "/responses",
            json={**OK, "previous_response_id": span.attributes[R.GEN_AI_RESPONSE_ID]},
        )
        assert r.status_code == 400


# --- what is refused ----------------------------------------------------------------------------------------
OK = {"model": "scripted", "input": "hi"}


def _with(**fields: Any) -> dict[str, Any]:
    return {**OK, **fields}


def _image_input(kind: str, part: dict[str, Any]) -> dict[str, Any]:
    return _with(
        input=[{"role": "user", "content": [{"type": "input_text", "text": "see"}, {"type": kind, **part}]}]
    )


REFUSED: list[tuple[str, Any, int, str | None, str]] = [
    ("bad json", b'{"model": "scripted", "input": ', 400, None, "not valid JSON"),
    ("not an object", b"[1, 2]", 400, None, "invalid request"),
    ("model not a string", _with(model=5), 400, "model", "model"),
    ("no input", {"model": "scripted"}, 400, "input", "input is required"),
    ("input a number", _with(input=5), 400, "input", "input"),
    ("item not an object", _with(input=["hi"]), 400, "input", "input[0] must be an object"),
    ("temperature a word", _with(temperature="hot"), 400, "temperature", "temperature"),
    ("temperature too high", _with(temperature=3), 400, "temperature", "temperature"),
    ("max_output_tokens 0", _with(max_output_tokens=0), 400, "max_output_tokens", "max_output_tokens"),
    ("stream a list", _with(stream=[1]), 400, "stream", "stream"),
    ("n 2", _with(n=2), 400, "n", "n must be 1"),
    ("unknown model", _with(model="gpt-4o"), 404, "model", "does not exist here"),
    ("image input", _image_input("input_image", {"image_url": "data:,"}), 400, "input", "'input_image'"),
    ("file input", _image_input("input_file", {"file_id": "f"}), 400, "input", "'input_file'"),
    ("audio input", _image_input("input_audio", {"input_audio": {}}), 400, "input", "'input_audio'"),
    (
        "image tool output",
        _with(input=[{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]),
        400,
        "input",
        "'input_image'",
    ),
    ("tool role", _with(input=[{"role": "tool", "content": "x"}]), 400, "input", "role"),
    ("item without a type", _with(input=[{"content": "x"}]), 400, "input", "needs a 'type'"),
    (
        "text part without text",
        _with(input=[{"role": "user", "content": [{"type": "input_text"}]}]),
        400,
        "input",
        "content[0].text must be a string",
    ),
    (
        "unknown item",
        _with(input=[{"type": "web_search_call", "id": "w"}]),
        400,
        "input",
        "'web_search_call'",
    ),
    (
        "item reference",
        _with(input=[{"type": "item_reference", "id": "msg_1"}]),
        400,
        "input",
        "item_reference",
    ),
    (
        "function_call without call_id",
        _with(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]),
        400,
        "input",
        "call_id",
    ),
    (
        "unknown previous response",
        _with(previous_response_id="resp_nothing"),
        400,
        "previous_response_id",
        "send the full input",
    ),
    ("bad tool name", _with(tools=[{**TOOL, "name": "get weather!"}]), 400, "tools", "tools[0].name"),
    ("bad schema", _with(tools=[{**TOOL, "parameters": {"type": "dict"}}]), 400, "tools", "parameters"),
    ("tool twice", _with(tools=[TOOL, TOOL]), 400, "tools", "repeated: get_weather"),
    ("chat-shaped tool", _with(tools=[{"type": "function", "function": TOOL}]), 400, "tools", "name"),
    (
        "tool_choice names no tool",
        _with(tools=[TOOL], tool_choice={"type": "function", "name": "other"}),
        400,
        "tool_choice",
        "'other'",
    ),
    (
        "tool_choice built-in",
        _with(tool_choice={"type": "web_search_preview"}),
        400,
        "tool_choice",
        "web_search",
    ),
    ("required without tools", _with(tool_choice="required"), 400, "tool_choice", "needs at least one tool"),
    (
        "unknown text format",
        _with(text={"format": {"type": "yaml"}}),
        400,
        "text.format",
        "'yaml' is unknown",
    ),
    ("background", _with(background=True), 400, "background", "background"),
    ("conversation", _with(conversation="conv_1"), 400, "conversation", "conversations are not served"),
    ("prompt template", _with(prompt={"id": "pmpt_1"}), 400, "prompt", "prompt templates"),
    ("metadata not strings", _with(metadata={"k": 1}), 400, "metadata.k", "metadata"),
]
BUILT_IN = [
    {"type": "web_search"},
    {"type": "web_search_preview"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "image_generation"},
    {"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1:9"},
    {"type": "local_shell"},
]
REFUSED += [
    (
        f"built-in {t['type']}",
        _with(tools=[TOOL, t]),
        400,
        "tools",
        f"tools[1]: '{t['type']}' tools are not served",
    )
    for t in BUILT_IN
]


@pytest.mark.parametrize(
    ("body", "status", "param", "fragment"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_a_malformed_request_gets_its_error_and_the_gateway_serves_on(gw, body, status, param, fragment):
    served = gw.backend.calls
    url = gw.base_url("ro-resp-refused") + "/responses"
    r = httpx.post(url, content=body) if isinstance(body, bytes) else httpx.post(url, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and fragment in error["message"], error
    assert gw.backend.calls == served
    assert httpx.post(url, json=OK).status_code == 200


def test_an_oversized_body_is_refused(gw):
    big = b'{"model": "scripted", "input": "' + b"x" * (9 * 1024 * 1024) + b'"}'
    r = httpx.post(
        gw.v1 + "/responses", content=big, headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(gw.v1 + "/responses", json=OK).status_code == 200
