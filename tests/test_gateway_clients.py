"""Agent frameworks nobody here wrote, talking to the gateway over HTTP with the tiny model.

Each agent asks for the weather, gets a tool call (the tiny random model is steered to well-formed replies
by a script, see ``gateway_helpers.Script``), runs the tool, sends its result back and gets the answer.
Each test checks that the token ids the gateway recorded decode to exactly what the client received.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from agl_core import semconv
from agl_core.gateway import rollout_base_url
from agl_core.testing import GatewayServer

from .gateway_helpers import WEATHER_ANSWER, WEATHER_CALL, WEATHER_SCRIPT, Script, decode

QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def gw(tiny_policy):
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    backend = HFBackend(
        model,
        tokenizer,
        model_name="tiny",
        default_max_tokens=48,
        logits_processor=Script(tokenizer, WEATHER_SCRIPT),
    )
    with GatewayServer(backend) as gateway:
        yield gateway
    backend.close()


def weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def _rollout_spans(gw, rollout_id):
    spans = [s for s in gw.spans() if s.attributes.get(semconv.ROLLOUT_ID) == rollout_id]
    return sorted(spans, key=lambda s: s.start_time)


def _assert_weather_dialogue(gw, rollout_id, attempt_id=None):
    """Two gateway calls: the first produced the tool call, the second the answer, token for token."""
    first, second = _rollout_spans(gw, rollout_id)
    tokenizer = gw.backend.tokenizer
    assert decode(tokenizer, first.attributes[semconv.RESPONSE_TOKEN_IDS]) == WEATHER_CALL
    (call,) = json.loads(first.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert decode(tokenizer, second.attributes[semconv.RESPONSE_TOKEN_IDS]) == WEATHER_ANSWER
    # the tool's result reached the model in the second prompt
    assert "sunny in Paris" in tokenizer.decode(list(second.attributes[semconv.PROMPT_TOKEN_IDS]))
    for span in (first, second):
        assert len(span.attributes[semconv.RESPONSE_LOGPROBS]) == len(
            span.attributes[semconv.RESPONSE_TOKEN_IDS]
        )
        if attempt_id:
            assert span.attributes[semconv.ATTEMPT_ID] == attempt_id
    return first, second


@pytest.fixture
def agents_sdk_untraced():
    """The Agents SDK with its tracing off for this test only (the setting is process-wide)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    yield agents
    agents.set_tracing_disabled(False)


def test_openai_agents_sdk_chat_completions_model(gw, agents_sdk_untraced):
    agents = agents_sdk_untraced
    from openai import AsyncOpenAI

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return weather(city)

    async def run(rollout_id: str, streamed: bool):
        client = AsyncOpenAI(
            base_url=rollout_base_url(gw.url, rollout_id, "at-1"), api_key="x", max_retries=0
        )
        model = agents.OpenAIChatCompletionsModel(model="tiny", openai_client=client)
        agent = agents.Agent(
            name="forecaster", instructions="Answer weather questions.", model=model, tools=[get_weather]
        )
        if streamed:
            result = agents.Runner.run_streamed(agent, QUESTION)
            async for _ in result.stream_events():
                pass
        else:
            result = await agents.Runner.run(agent, QUESTION)
        await client.close()
        return result

    for rollout_id, streamed in (("ro-agents", False), ("ro-agents-stream", True)):
        result = asyncio.run(run(rollout_id, streamed))
        assert result.final_output == WEATHER_ANSWER
        tool_outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
        assert tool_outputs == ["sunny in Paris"]
        _, second = _assert_weather_dialogue(gw, rollout_id, "at-1")
        assert second.attributes[semconv.STREAM] is streamed


def test_autogen_openai_chat_completion_client(gw):
    pytest.importorskip("autogen_agentchat")
    from autogen_agentchat.agents import AssistantAgent
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    async def run():
        client = OpenAIChatCompletionClient(
            model="tiny",
            base_url=rollout_base_url(gw.url, "ro-autogen"),
            api_key="x",
            model_info={
                "vision": False,
                "function_calling": True,
                "json_output": False,
                "family": "unknown",
                "structured_output": False,
            },
        )
        agent = AssistantAgent(
            "forecaster", model_client=client, tools=[weather_tool], reflect_on_tool_use=True
        )
        result = await agent.run(task=QUESTION)
        await client.close()
        return result

    async def get_weather(city: str) -> str:
        """The weather in a city."""
        return weather(city)

    from autogen_core.tools import FunctionTool

    weather_tool = FunctionTool(get_weather, description="The weather in a city.", name="get_weather")
    result = asyncio.run(run())
    assert result.messages[-1].content == WEATHER_ANSWER
    calls = [m for m in result.messages if type(m).__name__ == "ToolCallRequestEvent"]
    assert [c.content[0].name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].content[0].arguments) == {"city": "Paris"}
    _assert_weather_dialogue(gw, "ro-autogen")


def test_langchain_chat_openai_streaming_with_tools(gw):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return weather(city)

    chat = ChatOpenAI(
        base_url=rollout_base_url(gw.url, "ro-lc-tools"),
        api_key="x",
        model="tiny",
        max_retries=0,
        streaming=True,
    ).bind_tools([get_weather])
    messages = [HumanMessage(QUESTION)]
    first = chat.invoke(messages)
    (call,) = first.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}
    messages += [first, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    second = chat.invoke(messages)
    assert second.content == WEATHER_ANSWER
    spans = _assert_weather_dialogue(gw, "ro-lc-tools")
    assert all(s.attributes[semconv.STREAM] is True for s in spans)


def test_openai_client_plain_text_decodes_to_what_it_received(gw):
    from openai import OpenAI

    client = OpenAI(base_url=rollout_base_url(gw.url, "ro-plain"), api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=10, seed=3
    )
    (span,) = _rollout_spans(gw, "ro-plain")
    assert (
        decode(gw.backend.tokenizer, span.attributes[semconv.RESPONSE_TOKEN_IDS])
        == reply.choices[0].message.content
    )
    assert span.attributes[semconv.GEN_AI_RESPONSE_ID] == reply.id
