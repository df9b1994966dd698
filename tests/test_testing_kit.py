"""The test kit used as a user would: instrument a plain function, run it against the kit's gateway and
read back what the collector got."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
from opentelemetry import propagate, trace

from agl_core import semconv
from agl_core.pipeline.transitions import spans_to_transitions
from agl_core.testing import (
    AglTestStack,
    ByteTokenizer,
    Collector,
    InMemoryTracing,
    ScriptedBackend,
    tool_call,
)
from agl_core.tracing import emit_reward, rollout_scope


def ask_weather(client: openai.OpenAI, tracer: trace.Tracer) -> str:
    """The user's code: one instrumented step that asks the model, runs the tool it asks for, answers.
    Its calls carry the W3C ``traceparent`` of the step, so the gateway's spans hang under it."""
    with tracer.start_as_current_span("agent weather") as step:
        headers: dict[str, str] = {}
        propagate.inject(headers)
        messages: list[dict[str, object]] = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.chat.completions.create(model="scripted", messages=messages, extra_headers=headers)  # type: ignore[arg-type]
        (call,) = first.choices[0].message.tool_calls or []
        step.set_attribute("weather.tool", call.function.name)
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        second = client.chat.completions.create(model="scripted", messages=messages, extra_headers=headers)  # type: ignore[arg-type]
        return second.choices[0].message.content or ""


def test_a_user_function_through_the_kit_gateway_lands_in_the_collector():
    script = [tool_call("get_weather", {"city": "Paris"}), "It is sunny in Paris."]
    with AglTestStack(script=script) as stack:
        tracer = stack.provider.get_tracer("user-code")
        with rollout_scope("ro-kit", "at-kit", "task-kit", tracer_provider=stack.provider):
            client = openai.OpenAI(base_url=stack.base_url("ro-kit", "at-kit"), api_key="x", max_retries=0)
            answer = ask_weather(client, tracer)
            emit_reward(1.0, tracer_provider=stack.provider)
        spans = stack.wait_for_spans(5, "ro-kit")  # rollout, step, two LLM calls, reward

    assert answer == "It is sunny in Paris."
    assert {s.rollout_id for s in spans} == {"ro-kit"}
    (rollout,) = [s for s in spans if s.name == semconv.SPAN_ROLLOUT]
    (step,) = [s for s in spans if s.name == "agent weather"]
    assert step.parent_span_id == rollout.span_id and step.attributes["weather.tool"] == "get_weather"
    calls = sorted(
        (s for s in spans if s.attributes.get(semconv.SOURCE) == semconv.SOURCE_GATEWAY),
        key=lambda s: s.start_ns,
    )
    assert [c.name for c in calls] == ["chat scripted", "chat scripted"]
    tokenizer = ByteTokenizer()
    for call, reply in zip(calls, script, strict=True):
        assert call.parent_span_id == step.span_id and call.attempt_id == "at-kit"
        ids = list(call.attributes[semconv.RESPONSE_TOKEN_IDS])
        assert tokenizer.decode(ids, skip_special_tokens=True) == reply
        assert ids[-1] == tokenizer.eos_token_id
        assert list(call.attributes[semconv.RESPONSE_LOGPROBS]) == [-0.5] * len(ids)
        assert "Weather in Paris?" in tokenizer.decode(list(call.attributes[semconv.PROMPT_TOKEN_IDS]))
    output = json.loads(calls[0].attributes[semconv.GEN_AI_OUTPUT_MESSAGES])
    assert output[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    # the second prompt holds the first reply as the model wrote it, then the tool's result
    second_prompt = tokenizer.decode(list(calls[1].attributes[semconv.PROMPT_TOKEN_IDS]))
    assert script[0] in second_prompt and "sunny" in second_prompt

    result = spans_to_transitions(spans)
    assert result.problems == () and len(result.transitions) == 2
    assert [(t.task_id, t.reward) for t in result.transitions] == [("task-kit", 1.0)] * 2


def test_scripted_backend_streams_and_reports_logprobs():
    with AglTestStack(script=["one two"]) as stack:
        client = openai.OpenAI(base_url=stack.gateway.v1, api_key="x", max_retries=0)
        chunks = list(
            client.chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": "hi"}], stream=True, logprobs=True
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        (span,) = stack.gateway.spans()
    assert text == "one two"
    assert len(span.attributes[semconv.RESPONSE_TOKEN_IDS]) == len("one two") + 1


def test_the_script_running_out_is_an_error_the_client_sees():
    with AglTestStack(script=["only once"]) as stack:
        client = openai.OpenAI(base_url=stack.gateway.v1, api_key="x", max_retries=0)
        ask = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
        assert client.chat.completions.create(**ask).choices[0].message.content == "only once"  # type: ignore[call-overload]
        with pytest.raises(openai.APIStatusError, match="used up"):
            client.chat.completions.create(**ask)  # type: ignore[call-overload]


ADD_TOOL = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}


def test_a_half_written_tool_call_is_flagged_malformed():
    broken = '<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>'
    with AglTestStack(script=[broken]) as stack:
        client = openai.OpenAI(base_url=stack.base_url("ro-bad"), api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "add"}], tools=[ADD_TOOL]
        )
        (span,) = stack.wait_for_spans(1, "ro-bad")
    assert reply.choices[0].message.content == broken and not reply.choices[0].message.tool_calls
    assert list(span.attributes[semconv.TOOL_CALL_MALFORMED_REASONS]) == [semconv.TOOL_CALL_UNPARSEABLE]


def test_byte_tokenizer_round_trips_text_and_special_tokens():
    tokenizer = ByteTokenizer()
    text = "<|im_start|>user\nhé<|im_end|>\n"
    ids = tokenizer.encode(text)
    assert ids[0] == 256 and 257 in ids and tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhé\n"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hé"}], tokenize=False) == (
        text + "<|im_start|>assistant\n"
    )


def test_collector_alone_with_a_batching_provider(tmp_path):
    with Collector(path=tmp_path / "s.sqlite") as collector:
        provider = collector.tracer_provider(batch=True)
        with rollout_scope("ro-batch", tracer_provider=provider):
            provider.get_tracer("t").start_span("work").end()
        provider.force_flush()
        spans = collector.wait_for_spans(2, "ro-batch", timeout_s=5)
        assert sorted(s.name for s in spans) == sorted(["work", semconv.SPAN_ROLLOUT])
        assert collector.client.query_spans(rollout_ids=["ro-batch"]) == spans
        with pytest.raises(TimeoutError, match="2 of 3 spans"):
            collector.wait_for_spans(3, "ro-batch", timeout_s=0.1)
    assert (tmp_path / "s.sqlite").exists()


def test_in_memory_tracing_stamps_the_rollout():
    with InMemoryTracing(rollout_spans=True) as tracing:
        with rollout_scope("ro-mem", tracer_provider=tracing.provider):
            tracing.provider.get_tracer("t").start_span("inner").end()
        (inner,) = tracing.spans("inner")
        assert inner.attributes[semconv.ROLLOUT_ID] == "ro-mem"
        tracing.clear()
        assert tracing.spans() == []


def test_a_given_backend_and_a_script_are_exclusive():
    with pytest.raises(ValueError, match="backend, or a script"):
        AglTestStack(ScriptedBackend(), script=["x"])


# --- the pytest fixtures (tests/conftest.py opts in to them) ---------------------------------------------
@pytest.fixture
def agl_script():
    return ["Hello from the fixture."]


def test_the_agl_stack_fixture_serves_the_overridden_script(agl_stack):
    client = openai.OpenAI(base_url=agl_stack.base_url("ro-fixture"), api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "Hello from the fixture."
    (span,) = agl_stack.spans("ro-fixture")
    assert span.attributes[semconv.ROLLOUT_ID] == "ro-fixture"


def test_the_collector_and_memory_fixtures(agl_collector, agl_memory):
    assert agl_collector.spans() == [] and agl_memory.spans() == []
    with rollout_scope("ro-f", tracer_provider=agl_memory.provider):
        pass
    assert [s.name for s in agl_memory.spans()] == [semconv.SPAN_ROLLOUT]


def test_import_agl_core_does_not_import_the_kit():
    code = "import sys, agl_core; print('agl_core.testing' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
