"""The gateway in front of the tiny model, called by LangChain's ChatOpenAI with the agl callback."""

from __future__ import annotations

import httpx
import pytest

from agl_core import semconv
from agl_core.gateway import rollout_base_url
from agl_core.pipeline.transitions import spans_to_transitions
from agl_core.testing import AglTestStack
from agl_core.tracing import emit_reward, rollout_scope

pytest.importorskip("langchain_openai")


@pytest.fixture
def stack(tiny_policy, store):
    """``(gateway, backend, agent tracer provider, store client)`` over each store backend."""
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    backend = HFBackend(model, tokenizer, model_name="tiny", default_max_tokens=12)
    with AglTestStack(backend, store=store) as kit:
        yield kit.gateway, backend, kit.provider, kit.client


def test_langchain_call_through_gateway_yields_a_transition_with_exact_tokens(stack):
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    from agl_langchain import AglCallbackHandler

    gateway, backend, provider, client = stack
    handler = AglCallbackHandler(agent_name="solver", tracer_provider=provider)
    with rollout_scope("ro-lc", "at-lc", "task-lc", tracer_provider=provider):
        chat = ChatOpenAI(
            base_url=rollout_base_url(gateway.url, "ro-lc", "at-lc"),
            api_key="x",
            model="tiny",
            max_tokens=8,
            max_retries=0,
            temperature=1.0,
        )
        chain = ChatPromptTemplate.from_messages([("user", "What is {a} + {b}?")]) | chat | StrOutputParser()
        reply = chain.invoke({"a": 2, "b": 3}, config={"callbacks": [handler]})
        emit_reward(1.0, tracer_provider=provider)

    spans = client.query_spans(rollout_ids=["ro-lc"])
    names = sorted(s.name for s in spans)
    assert "chat tiny" in names and "RunnableSequence" in names and semconv.SPAN_ROLLOUT in names
    framework = [s for s in spans if s.attributes.get(semconv.SOURCE) == semconv.SOURCE_LANGCHAIN]
    gateway_spans = [s for s in spans if s.attributes.get(semconv.SOURCE) == semconv.SOURCE_GATEWAY]
    assert len(gateway_spans) == 1
    llm_span = next(
        s for s in framework if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == semconv.OP_CHAT
    )
    assert (
        llm_span.attributes[semconv.GEN_AI_RESPONSE_ID]
        == gateway_spans[0].attributes[semconv.GEN_AI_RESPONSE_ID]
    )
    assert gateway_spans[0].attempt_id == "at-lc"

    result = spans_to_transitions(spans)
    assert result.problems == ()
    (transition,) = result.transitions
    tokenizer = backend.tokenizer
    assert tokenizer.decode(list(transition.response_ids), skip_special_tokens=True) == reply
    assert "What is 2 + 3?" in tokenizer.decode(list(transition.prompt_ids))
    assert transition.agent_name == "solver" and transition.reward == 1.0 and transition.task_id == "task-lc"

    # the recorded behaviour logprobs are the model's own: recomputing them gives the same numbers
    import torch

    from agl_trainer.learning.algo import Advantaged
    from agl_trainer.learning.update import response_logprobs

    with torch.no_grad():
        (recomputed,) = response_logprobs(backend.model, [Advantaged(transition, 0.0)], pad_id=0)
    assert torch.allclose(recomputed, torch.tensor(transition.response_logprobs), atol=1e-4)


def test_header_attribution_and_traceparent_parenting(stack):
    gateway, _, _, client = stack
    trace_id, parent_id = "ab" * 16, "cd" * 8
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 3,
            "logprobs": True,
            "seed": 1,
        },
        headers={semconv.HEADER_ROLLOUT_ID: "ro-hdr", "traceparent": f"00-{trace_id}-{parent_id}-01"},
    )
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "chat.completion" and data["usage"]["completion_tokens"] == len(
        data["choices"][0]["logprobs"]["content"]
    )
    (span,) = client.query_spans(rollout_ids=["ro-hdr"])
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent_id)
    assert len(span.attributes[semconv.RESPONSE_LOGPROBS]) == len(span.attributes[semconv.RESPONSE_TOKEN_IDS])


def test_same_seed_same_tokens(stack):
    gateway, *_ = stack
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "seed": 42}
    first = httpx.post(gateway.url + "/v1/chat/completions", json=body).json()
    second = httpx.post(gateway.url + "/v1/chat/completions", json=body).json()
    assert first["choices"][0]["message"] == second["choices"][0]["message"]


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
        ({"model": "tiny", "messages": []}, 400, "messages"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 9},
            400,
            "temperature",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000},
            400,
            "context window",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "text content",
        ),
    ],
)
def test_gateway_errors_use_openai_format(stack, body, status, fragment):
    gateway, *_ = stack
    response = httpx.post(gateway.url + "/v1/chat/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_invalid_json_and_real_openai_client_errors(stack):
    import openai

    gateway, *_ = stack
    response = httpx.post(
        gateway.url + "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    oa = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in oa.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "hi"}])
    ok = oa.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2
    )
    assert len(ok.choices) == 2 and ok.usage.completion_tokens >= 2


def test_callback_never_breaks_the_agent(stack, caplog):
    from agl_langchain import AglCallbackHandler

    class Exploding:
        def get_tracer(self, *a, **k):
            raise RuntimeError("tracer exploded")

    handler = AglCallbackHandler(tracer_provider=Exploding())  # type: ignore[arg-type]
    from langchain_core.runnables import RunnableLambda

    assert RunnableLambda(lambda x: x + 1).invoke(1, config={"callbacks": [handler]}) == 2
    assert sum("on_chain_start failed" in r.getMessage() for r in caplog.records) == 1
