"""The gateway over the transformers backend (tiny model), called with the real ``openai`` client over
HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from agl_core import semconv
from agl_core.gateway import TemplateRenderer
from agl_core.testing import GatewayServer

from .gateway_helpers import WEATHER_CALL, WEATHER_SCRIPT, WEATHER_TOOL, Script, decode

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def gw(tiny_policy):
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    backend = HFBackend(
        model,
        tokenizer,
        model_name="tiny",
        default_max_tokens=16,
        logits_processor=Script(tokenizer, WEATHER_SCRIPT),
    )
    with GatewayServer(backend, renderer=TemplateRenderer(tokenizer)) as gateway:
        yield gateway
    backend.close()


@pytest.fixture(scope="module")
def oa(gw):
    return openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)


HI = [{"role": "user", "content": "hi"}]


def test_sync_client_gets_what_the_span_records(gw, oa):
    r = oa.chat.completions.create(
        model="tiny", messages=HI, max_tokens=8, n=2, seed=7, logprobs=True, top_logprobs=3
    )
    spans = gw.spans(r.id)
    assert [s.attributes[semconv.CHOICE_INDEX] for s in spans] == [0, 1]
    prompt = gw.backend.renderer.render(HI)
    for choice, span in zip(r.choices, spans, strict=True):
        a = span.attributes
        assert list(a[semconv.PROMPT_TOKEN_IDS]) == prompt
        assert decode(gw.backend.tokenizer, a[semconv.RESPONSE_TOKEN_IDS]) == choice.message.content
        assert [e.logprob for e in choice.logprobs.content] == list(a[semconv.RESPONSE_LOGPROBS])
        assert all(len(e.top_logprobs) == 3 for e in choice.logprobs.content)
        assert (
            a[semconv.POLICY_VERSION] == 0
            and a[semconv.TRAINABLE] is True
            and a[semconv.PROMPT_DRIFT] is False
        )
        assert a[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == (choice.finish_reason,)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == sum(len(s.attributes[semconv.RESPONSE_TOKEN_IDS]) for s in spans)


def test_stream_equals_non_stream_and_records_the_same(gw, oa):
    body = {"model": "tiny", "messages": HI, "max_tokens": 12, "seed": 11}
    whole = oa.chat.completions.create(**body)
    pieces, usage, finish, chunk_ids = [], None, None, set()
    for chunk in oa.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        chunk_ids.add(chunk.id)
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    (streamed,) = gw.spans(chunk_ids.pop())
    (plain,) = gw.spans(whole.id)
    assert streamed.attributes[semconv.STREAM] is True and plain.attributes[semconv.STREAM] is False
    for key in (semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS):
        assert streamed.attributes[key] == plain.attributes[key]
    # The same tokens; their logprobs agree to float32 rounding, not bit for bit: the first
    # call's first decoding step after a weight change runs the model's forward pass (to check
    # the direct decoding step against it), the second call's runs the direct step.
    assert streamed.attributes[semconv.RESPONSE_LOGPROBS] == pytest.approx(
        plain.attributes[semconv.RESPONSE_LOGPROBS], abs=1e-4
    )
    assert streamed.attributes[semconv.TIME_TO_FIRST_TOKEN] > 0


def test_async_client_concurrent_calls_are_batched_and_exact(gw):
    prompts = [f"question number {i}" for i in range(6)]

    async def run(concurrently: bool):
        client = openai.AsyncOpenAI(base_url=gw.v1, api_key="x", max_retries=0)
        calls = [
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": p}], max_tokens=6, temperature=0
            )
            for p in prompts
        ]
        if concurrently:
            out = await asyncio.gather(*calls)
        else:
            out = [await c for c in calls]
        await client.close()
        return out

    gw.backend.peak_batch = 0
    alone = asyncio.run(run(False))
    assert gw.backend.peak_batch == 1
    together = asyncio.run(run(True))
    assert gw.backend.peak_batch > 1
    for a, b in zip(alone, together, strict=True):
        assert a.choices[0].message.content == b.choices[0].message.content
        (sa,), (sb,) = gw.spans(a.id), gw.spans(b.id)
        assert sa.attributes[semconv.RESPONSE_TOKEN_IDS] == sb.attributes[semconv.RESPONSE_TOKEN_IDS]
        assert sa.attributes[semconv.RESPONSE_LOGPROBS] == pytest.approx(
            sb.attributes[semconv.RESPONSE_LOGPROBS], abs=1e-4
        )


def test_stop_strings_and_token_limits(gw, oa):
    free = oa.chat.completions.create(model="tiny", messages=HI, max_completion_tokens=12, temperature=0)
    text = free.choices[0].message.content
    stop = text[4:7]
    cut = oa.chat.completions.create(model="tiny", messages=HI, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    (span,) = gw.spans(cut.id)
    produced = decode(gw.backend.tokenizer, span.attributes[semconv.RESPONSE_TOKEN_IDS])
    assert produced.startswith(cut.choices[0].message.content) and stop in produced
    short = oa.chat.completions.create(model="tiny", messages=HI, max_completion_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


def test_text_completions_streamed_and_not(gw, oa):
    whole = oa.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, seed=5, logprobs=2)
    streamed = "".join(
        c.choices[0].text
        for c in oa.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=6, seed=5, stream=True
        )
        if c.choices
    )
    assert streamed == whole.choices[0].text
    (span,) = gw.spans(whole.id)
    assert span.attributes[semconv.GEN_AI_OPERATION_NAME] == semconv.OP_TEXT_COMPLETION
    assert list(span.attributes[semconv.PROMPT_TOKEN_IDS]) == gw.backend.tokenizer.encode("Once upon a time")
    assert whole.choices[0].logprobs.token_logprobs == list(span.attributes[semconv.RESPONSE_LOGPROBS])
    assert decode(gw.backend.tokenizer, span.attributes[semconv.RESPONSE_TOKEN_IDS]) == whole.choices[0].text


def test_tool_call_parsed_streamed_and_not(gw, oa):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oa.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER_TOOL], max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    (span,) = gw.spans(r.id)
    assert decode(gw.backend.tokenizer, span.attributes[semconv.RESPONSE_TOKEN_IDS]) == WEATHER_CALL
    assert (
        json.loads(span.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["tool_calls"][0]["function"]["name"]
        == "get_weather"
    )
    prompt = gw.backend.tokenizer.decode(list(span.attributes[semconv.PROMPT_TOKEN_IDS]))
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt

    names, args, finish, content = [], [], None, []
    for chunk in oa.chat.completions.create(
        model="tiny", messages=ask, tools=[WEATHER_TOOL], max_tokens=40, stream=True
    ):
        for c in chunk.choices:
            content.append(c.delta.content or "")
            for d in c.delta.tool_calls or []:
                names.append(d.function.name or "")
                args.append(d.function.arguments or "")
            finish = c.finish_reason or finish
    assert "".join(content) == "" and "".join(names) == "get_weather"
    assert json.loads("".join(args)) == {"city": "Paris"} and finish == "tool_calls"


def test_named_tool_choice_forces_a_call(gw, oa):
    r = oa.chat.completions.create(
        model="tiny",
        messages=HI,
        tools=[WEATHER_TOOL],
        max_tokens=30,
        seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    (span,) = gw.spans(r.id)
    forced = span.attributes[semconv.RESPONSE_FORCED_TOKENS]
    head = decode(gw.backend.tokenizer, span.attributes[semconv.RESPONSE_TOKEN_IDS][:forced])
    assert head == '<tool_call>\n{"name": "get_weather", "arguments": '


def test_tool_history_is_rendered_hermes_style(gw, oa):
    history = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = oa.chat.completions.create(model="tiny", messages=history, tools=[WEATHER_TOOL], max_tokens=30)
    assert r.choices[0].message.content == "It is sunny in Paris."
    (span,) = gw.spans(r.id)
    prompt = gw.backend.tokenizer.decode(list(span.attributes[semconv.PROMPT_TOKEN_IDS]))
    assert WEATHER_CALL in prompt and "<tool_response>\nsunny\n</tool_response>" in prompt


@pytest.mark.timing
def test_client_disconnect_mid_stream_is_recorded_and_harmless(gw, oa):
    before = gw.metrics.client_disconnects
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "a long story please"}],
        "max_tokens": 400,
        "stream": True,
    }
    with httpx.stream(
        "POST", gw.v1 + "/chat/completions", json=body, headers={semconv.HEADER_ROLLOUT_ID: "ro-gone"}
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:") and '"content"' in line:
                break
    deadline = time.monotonic() + 10
    while gw.metrics.client_disconnects == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gw.metrics.client_disconnects == before + 1
    spans = [s for s in gw.spans() if s.attributes.get(semconv.ROLLOUT_ID) == "ro-gone"]
    assert len(spans) == 1 and spans[0].attributes[semconv.ERROR_TYPE] == "client_disconnected"
    assert semconv.RESPONSE_TOKEN_IDS not in spans[0].attributes
    started = time.monotonic()  # the abandoned generation was stopped: the next call is not queued behind it
    assert oa.chat.completions.create(model="tiny", messages=HI, max_tokens=2).choices
    assert time.monotonic() - started < 5
    assert gw.metrics.inflight == 0


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        (
            {
                "model": "tiny",
                "messages": HI,
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            400,
            "not among the request's tools",
        ),
        ({"model": "tiny", "messages": HI, "tool_choice": "required"}, 400, "at least one tool"),
        ({"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, 400, "tool_call_id"),
        ({"model": "tiny", "messages": HI, "max_tokens": 2040}, 400, "window is 2048 tokens"),
        ({"model": "tiny", "prompt": ["a", "b"]}, 400, "one prompt per request"),
    ],
)
def test_request_errors(gw, body, status, fragment):
    path = "/completions" if "prompt" in body else "/chat/completions"
    response = httpx.post(gw.v1 + path, json=body)
    assert response.status_code == status, response.text
    assert fragment in response.json()["error"]["message"]


def test_invalid_json_unknown_model_and_stream_errors(gw, oa):
    bad = httpx.post(
        gw.v1 + "/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as err:
        oa.chat.completions.create(model="gpt-4o", messages=HI, stream=True)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model="tiny", messages=HI, stream=True, max_tokens=5000)
    assert "context window" in err.value.message


def test_close_fails_the_batch_being_decoded_and_waits_for_the_worker(tiny_policy):
    """close() while a long generation decodes: the request fails with a 503 at the batch's next step, and
    the worker has exited when close() returns (one left computing while the interpreter shuts down aborts
    the process with status 134)."""
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    backend = HFBackend(model, tokenizer, model_name="tiny")
    body = {"model": "tiny", "messages": HI, "max_tokens": 1000, "temperature": 1.0}
    replies: list[httpx.Response] = []
    running = set(threading.enumerate())  # other tests' backends have workers of their own
    with GatewayServer(backend, renderer=TemplateRenderer(tokenizer)) as gateway:
        url = gateway.v1 + "/chat/completions"
        client = threading.Thread(target=lambda: replies.append(httpx.post(url, json=body, timeout=120)))
        client.start()
        deadline = time.monotonic() + 60
        while backend.decode_steps < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backend.decode_steps >= 5, "the generation never started"
        backend.close()
        assert not [t for t in threading.enumerate() if t.name == "agl-hf-backend" and t not in running]
        client.join(60)
    assert backend.decode_steps < 1000  # stopped, not finished
    (reply,) = replies
    assert reply.status_code == 503 and "closed" in reply.json()["error"]["message"], reply.text


def test_backend_down_is_503(tiny_policy):
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    backend = HFBackend(model, tokenizer, model_name="tiny")
    backend.close()
    with GatewayServer(backend) as gateway:
        response = httpx.post(gateway.v1 + "/chat/completions", json={"model": "tiny", "messages": HI})
    assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"


class _Drifting:
    """A tokenizer whose chat template renders one token more than the served model's."""

    def __init__(self, tokenizer):
        self._t = tokenizer
        self.chat_template = tokenizer.chat_template

    def apply_chat_template(self, *args, **kwargs):
        ids = self._t.apply_chat_template(*args, **kwargs)
        return [*(ids["input_ids"] if hasattr(ids, "keys") else ids), 0]

    def encode(self, text):
        return self._t.encode(text)


def test_drift_check_flags_mismatches_and_counts_them(gw, tiny_policy):
    _, tokenizer = tiny_policy
    with GatewayServer(gw.backend, renderer=TemplateRenderer(_Drifting(tokenizer))) as drifting:
        r = openai.OpenAI(base_url=drifting.v1, api_key="x").chat.completions.create(
            model="tiny", messages=HI, max_tokens=2
        )
        (span,) = drifting.spans(r.id)
        assert span.attributes[semconv.PROMPT_DRIFT] is True
        assert list(span.attributes[semconv.RENDERED_PROMPT_TOKEN_IDS]) == [
            *span.attributes[semconv.PROMPT_TOKEN_IDS],
            0,
        ]
        text = httpx.get(drifting.url + "/metrics").text
    assert "agl_gateway_prompt_drift_total 1" in text and "agl_gateway_prompt_checks_total 1" in text
    assert gw.metrics.prompt_drift == 0 and gw.metrics.prompt_checks > 0


def test_trainer_lock_holds_generation_and_version_follows(gw, oa):
    backend = gw.backend
    done = threading.Event()
    result = {}

    def call():
        result["r"] = oa.chat.completions.create(model="tiny", messages=HI, max_tokens=2)
        done.set()

    with backend.lock:  # what the trainer does around an update
        thread = threading.Thread(target=call)
        thread.start()
        assert not done.wait(0.5)
        backend.policy_version += 1
    thread.join(10)
    (span,) = gw.spans(result["r"].id)
    assert span.attributes[semconv.POLICY_VERSION] == backend.policy_version
    assert httpx.get(gw.url + "/agl/v1/policy").json() == {
        "policy_version": backend.policy_version,
        "owner": None,
    }
    backend.policy_version -= 1


def test_weight_update_gets_the_lock_between_batches_under_load(gw):
    stop = threading.Event()

    def flood():
        client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
        while not stop.is_set():
            client.chat.completions.create(model="tiny", messages=HI, max_tokens=6)

    threads = [threading.Thread(target=flood) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        waits = []
        for _ in range(5):
            started = time.monotonic()
            with gw.backend.lock:
                waits.append(time.monotonic() - started)
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert max(waits) < 2.0, waits  # one batch of 6 tokens at most, not the whole flood


def test_hot_swap_full_weights_then_lora_without_restart(tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model

    from agl_trainer.generation.hf_backend import HFBackend
    from agl_trainer.model import load_policy

    model, tokenizer = load_policy("tiny", seed=0)
    backend = HFBackend(model, tokenizer, model_name="tiny")
    changed, _ = load_policy("tiny", seed=1)
    changed.save_pretrained(tmp_path / "full")
    adapted = get_peft_model(
        load_policy("tiny", seed=1)[0],
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    adapted.save_pretrained(tmp_path / "lora")

    body = {"model": "tiny", "messages": HI, "max_tokens": 4, "temperature": 0}
    with GatewayServer(backend, admin_token="s3cret") as gateway:

        def logprobs():
            r = httpx.post(gateway.v1 + "/chat/completions", json=body).json()
            (span,) = gateway.spans(r["id"])
            return span.attributes[semconv.POLICY_VERSION], span.attributes[semconv.RESPONSE_LOGPROBS]

        v0, lp0 = logprobs()
        publish = gateway.url + "/agl/v1/policy"
        assert (
            httpx.post(
                publish, json={"version": 1, "path": str(tmp_path / "full"), "kind": "full"}
            ).status_code
            == 401
        )
        auth = {"authorization": "Bearer s3cret"}
        ok = httpx.post(
            publish, json={"version": 1, "path": str(tmp_path / "full"), "kind": "full"}, headers=auth
        )
        assert ok.status_code == 200, ok.text
        v1, lp1 = logprobs()
        ok = httpx.post(
            publish, json={"version": 2, "path": str(tmp_path / "lora"), "kind": "lora"}, headers=auth
        )
        assert ok.status_code == 200, ok.text
        v2, lp2 = logprobs()
        bad = httpx.post(
            publish, json={"version": 3, "path": str(tmp_path / "full"), "kind": "lora"}, headers=auth
        )
        assert bad.status_code == 500 and "adapter_config.json" in bad.json()["error"]["message"]
    backend.close()
    assert (v0, v1, v2) == (0, 1, 2)
    assert lp0 != pytest.approx(lp1, abs=1e-3) and lp1 != pytest.approx(lp2, abs=1e-3)
    # version 1 served exactly the published weights
    with torch.no_grad():
        ids = torch.tensor([backend.renderer.render(HI)])
        first = torch.log_softmax(changed(input_ids=ids).logits[0, -1].float(), -1).max().item()
    assert lp1[0] == pytest.approx(first, abs=1e-4)


BROKEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
UNKNOWN_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_malformed_tool_calls_are_flagged_on_the_span(tiny_policy, stream):
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    rules = [("broken", BROKEN_CALL), ("unknown", UNKNOWN_CALL), ("weather", WEATHER_CALL)]
    backend = HFBackend(
        model, tokenizer, model_name="tiny", default_max_tokens=40, logits_processor=Script(tokenizer, rules)
    )

    def ask(question, tools):
        kwargs = {"tools": tools} if tools else {}
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": question}], stream=stream, **kwargs
        )
        if not stream:
            return r.id, r.choices[0].message.content, [c.id for c in r.choices[0].message.tool_calls or []]
        content, ids, response_id = "", [], None
        for chunk in r:
            response_id = chunk.id
            for c in chunk.choices:
                content += c.delta.content or ""
                ids += [d.id for d in c.delta.tool_calls or [] if d.id]
        return response_id, content or None, ids

    try:
        with GatewayServer(backend) as gw:
            client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
            spans = {}
            for question in ("weather in Paris?", "broken weather?", "unknown: what time is it?"):
                response_id, content, ids = ask(question, [WEATHER_TOOL])
                (spans[question.split()[0]],) = gw.spans(response_id)
                if question.startswith("broken"):
                    assert content == BROKEN_CALL and ids == []  # the client got the raw text
                if question.startswith("unknown"):
                    assert len(ids) == 1
                    unknown_id = ids[0]
            response_id, _, _ = ask("weather in Paris?", None)
            (no_tools,) = gw.spans(response_id)
    finally:
        backend.close()
    attrs = {name: span.attributes for name, span in spans.items()}
    assert attrs["weather"][semconv.TOOL_CALL_MALFORMED] is False
    assert semconv.TOOL_CALL_MALFORMED_REASONS not in attrs["weather"]
    assert attrs["broken"][semconv.TOOL_CALL_MALFORMED] is True
    assert list(attrs["broken"][semconv.TOOL_CALL_MALFORMED_REASONS]) == [semconv.TOOL_CALL_UNPARSEABLE]
    assert semconv.TOOL_CALL_MALFORMED_IDS not in attrs["broken"]
    assert attrs["unknown:"][semconv.TOOL_CALL_MALFORMED] is True
    assert list(attrs["unknown:"][semconv.TOOL_CALL_MALFORMED_REASONS]) == [semconv.TOOL_CALL_UNKNOWN_TOOL]
    assert list(attrs["unknown:"][semconv.TOOL_CALL_MALFORMED_IDS]) == [unknown_id]
    assert semconv.TOOL_CALL_MALFORMED not in no_tools.attributes  # no tools offered: nothing checked


def test_metrics_show_the_prefix_cache_at_work(gw, oa):
    """``GET /metrics`` carries the transformers backend's figures: the same long system prompt twice, and
    the second call's prompt comes from the prefix cache."""

    def figures() -> dict[str, float]:
        text = httpx.get(gw.url + "/metrics").text
        return {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line.startswith("agl_hf_") and not line.startswith("#")
        }

    system = {"role": "system", "content": "You answer questions about the weather, briefly. " * 8}
    before = figures()
    for question in ("And tomorrow?", "And next week?"):
        oa.chat.completions.create(
            model="tiny", messages=[system, {"role": "user", "content": question}], max_tokens=3
        )
    after = figures()
    assert after["agl_hf_prefix_reused_tokens_total"] - before["agl_hf_prefix_reused_tokens_total"] >= 64
    assert after["agl_hf_prefilled_tokens_total"] > before["agl_hf_prefilled_tokens_total"]
    assert 0 < after["agl_hf_prefix_cache_bytes"] <= after["agl_hf_prefix_cache_max_bytes"]
    assert after["agl_hf_decode_steps_total"] >= before["agl_hf_decode_steps_total"] + 2
