"""Decoding steps through the model's modules (agl_trainer.generation.direct_decode): the same tokens and
log-probabilities as the model's forward pass, for each architecture it recognizes, with LoRA adapters
and mixed-adapter batches; checked against the forward pass after every weight change, and off when
they disagree."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch

from agl_core.gateway.backend import ChatRequest, Completion

SYSTEM = "You are a careful assistant that solves arithmetic word problems with a calculator. " * 6
QUESTIONS = [f"Question {i}: what is {i} times {i + 3}?" + " Show it." * (i % 3) for i in range(6)]


def _model(kind: str, vocab: int, eos: int | None, *, hidden: int = 64) -> Any:
    """A small random decoder of ``kind`` (llama, qwen2, mistral) with SmolLM2's vocabulary; ``hidden``
    256 makes every projection large enough for oneDNN's packed copies (fast_linear.MIN_WEIGHT)."""
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    config = config_class(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2 if hidden == 64 else 4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=eos,
    )
    if kind == "mistral":
        config.sliding_window = None
    torch.manual_seed(1)
    model = model_class(config)
    if kind == "qwen2":  # biases on q, k and v: give them values so they count
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj.bias"):
                    p.copy_(torch.randn(p.shape) * 0.5)
    return model.eval()


def _request(question: str, *, system: str = SYSTEM, agent: str | None = None, n: int = 1) -> ChatRequest:
    return ChatRequest(
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=10,
        temperature=1.0,
        n=n,
        seed=len(question),
        agent=agent,
    )


def _together(backend: Any, requests: list[ChatRequest]) -> list[list[Completion]]:
    async def one(request: ChatRequest) -> list[Completion]:
        events = [event async for event in backend.generate("agl-policy", request)]
        return sorted((e for e in events if isinstance(e, Completion)), key=lambda c: c.index)  # as they end

    async def run() -> list[list[Completion]]:
        return list(await asyncio.gather(*(one(r) for r in requests)))

    return asyncio.run(run())


def _assert_same(a: list[list[Completion]], b: list[list[Completion]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert len(x) == len(y) > 0
        for p, q in zip(x, y, strict=True):
            assert p.response_ids == q.response_ids
            assert p.response_logprobs == pytest.approx(q.response_logprobs, abs=1e-4)


@pytest.fixture
def backends(tiny_policy):
    from agl_trainer.generation.hf_backend import HFBackend

    made: list[Any] = []

    def make(model: Any, **kwargs: Any) -> Any:
        backend = HFBackend(model, tiny_policy[1], max_batch=8, **kwargs)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def _count_steps(backend: Any) -> list[int]:
    """Wraps the backend's direct steps: the list gets each step's row count."""
    calls: list[int] = []
    step = backend._direct.step

    def counting(*args: Any) -> torch.Tensor:
        calls.append(int(args[1].shape[0]))
        return step(*args)

    backend._direct.step = counting
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-prefix", "own-prompts"])
def test_direct_steps_generate_what_the_forward_pass_generates(backends, tiny_policy, kind, shared):
    """Rows decoded together (a long system prompt they share, read once; or prompts of their own) get
    the tokens and log-probabilities of the forward pass's steps, rows leaving and joining included."""
    tokenizer = tiny_policy[1]
    model = _model(kind, len(tokenizer), tokenizer.eos_token_id)
    direct, forward = backends(model), backends(model, direct_decode=False)
    assert direct._direct is not None and forward._direct is None
    steps = _count_steps(direct)
    systems = [SYSTEM if shared else f"System {i}: " + "be brief. " * i for i in range(len(QUESTIONS))]
    requests = [
        _request(q, system=s, n=1 + i % 2) for i, (q, s) in enumerate(zip(QUESTIONS, systems, strict=True))
    ]
    _assert_same(_together(direct, requests), _together(forward, requests))
    assert len(steps) >= 9 and max(steps) >= 4  # batched steps went through the modules
    assert direct._direct.enabled and not direct._direct.checking


def _lora_model(tokenizer: Any, *, hidden: int = 64) -> Any:
    """The tiny Llama with two LoRA adapters on attention and MLP projections, both with effect."""
    from peft import LoraConfig, get_peft_model

    model = _model("llama", len(tokenizer), tokenizer.eos_token_id, hidden=hidden)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])
    model = get_peft_model(model, lora, adapter_name="writer")
    model.add_adapter("rewriter", lora)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model


def test_direct_steps_serve_lora_adapters_and_mixed_adapter_batches(backends, tiny_policy):
    from agl_core.policies import PolicyRouter

    model = _lora_model(tiny_policy[1])
    router = PolicyRouter({"writer": ["writer"], "rewriter": ["rewriter"]})
    direct = backends(model, route=router.policy_for)
    forward = backends(model, route=router.policy_for, direct_decode=False)
    steps = _count_steps(direct)
    agents = ["writer", "rewriter", None, "writer", "rewriter", None]
    requests = [_request(q, agent=a) for q, a in zip(QUESTIONS, agents, strict=True)]
    mixed = _together(direct, requests)
    _assert_same(mixed, _together(forward, requests))
    assert max(steps) >= 3 and direct._direct.enabled
    # and the adapters did differ: one question under each
    one = [_request(QUESTIONS[0], agent=a) for a in ("writer", "rewriter", None)]
    answers = [c[0].response_logprobs for c in _together(direct, one)]
    assert answers[0] != pytest.approx(answers[1], abs=1e-3) and answers[0] != pytest.approx(
        answers[2], abs=1e-3
    )
    # one adapter for the whole model, as a run with a single policy serves it
    single = backends(_lora_model(tiny_policy[1]))
    reference = backends(single.model, direct_decode=False)
    _assert_same(_together(single, requests[:4]), _together(reference, requests[:4]))


def test_a_direct_step_that_disagrees_with_the_forward_pass_is_turned_off(backends, tiny_policy, caplog):
    """The first step is checked against the forward pass; a disagreement is logged, the forward pass's
    logits are used, and every later step goes through the forward pass."""
    tokenizer = tiny_policy[1]
    model = _model("llama", len(tokenizer), tokenizer.eos_token_id)
    faulty, forward = backends(model), backends(model, direct_decode=False)
    step = faulty._direct.step
    calls: list[int] = []

    def wrong(*args: Any) -> torch.Tensor:
        calls.append(1)
        return step(*args) + torch.linspace(0, 1, len(tokenizer))  # not a constant: changes the softmax

    faulty._direct.step = wrong
    requests = [_request(q) for q in QUESTIONS[:3]]
    with caplog.at_level(logging.WARNING, logger="agl_trainer.generation.direct_decode"):
        _assert_same(_together(faulty, requests), _together(forward, requests))
    assert calls == [1] and not faulty._direct.enabled
    assert "other logits than the model's forward pass" in caplog.text


def test_each_weight_change_has_the_next_step_checked_again(backends, tiny_policy):
    tokenizer = tiny_policy[1]
    model = _model("llama", len(tokenizer), tokenizer.eos_token_id)
    backend = backends(model)
    checks: list[int] = []
    forward = backend.forward

    def recording(**kwargs: Any) -> Any:
        if kwargs["input_ids"].shape[1] == 1:  # a decoding step through the forward pass: the check
            checks.append(1)
        return forward(**kwargs)

    backend.forward = recording
    _together(backend, [_request(q) for q in QUESTIONS[:2]])
    _together(backend, [_request(q) for q in QUESTIONS[2:4]])
    assert len(checks) == 1 and not backend._direct.checking
    with backend.lock, torch.no_grad():  # a weight update
        model.lm_head.weight.mul_(1.01)
    assert backend._direct.checking
    _together(backend, [_request(q) for q in QUESTIONS[:2]])
    assert len(checks) == 2 and backend._direct.enabled


def test_architectures_the_direct_step_does_not_know_go_through_the_forward_pass(backends, tiny_policy):
    import transformers

    from agl_trainer.generation.direct_decode import recognize

    tokenizer = tiny_policy[1]
    assert recognize(_model("llama", len(tokenizer), None)) is None
    assert recognize(_lora_model(tokenizer)) is None  # under PEFT: the model it wraps
    windowed = _model("mistral", len(tokenizer), None)
    windowed.config.sliding_window = 16
    assert "sliding window" in (recognize(windowed) or "")
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)
    )
    assert "model type 'gpt2'" in (recognize(gpt2) or "")
    backend = backends(gpt2)
    assert backend._direct is None


@pytest.mark.parametrize("kind", ["llama", "qwen2", "lora"])
def test_grouped_products_generate_what_the_forward_pass_generates(backends, tiny_policy, kind):
    """With room for every weight (``packed_weights_mb``), a direct step multiplies query, key and value
    in one product and gate and up in another (fast_linear.PackedLinears.multiply_group), and the tokens
    and log-probabilities stay the forward pass's: plain, with biases (Qwen2), and under LoRA adapters in
    mixed-adapter batches (each LoRA layer adds its term to its slice)."""
    from agl_core.policies import PolicyRouter
    from agl_trainer.generation import fast_linear

    if not fast_linear.available():
        pytest.skip("this PyTorch has no oneDNN linear")  # the grouped products are oneDNN's
    tokenizer = tiny_policy[1]
    if kind == "lora":
        model = _lora_model(tokenizer, hidden=256)
        router = PolicyRouter({"writer": ["writer"], "rewriter": ["rewriter"]})
        options: dict[str, Any] = {"route": router.policy_for}
        agents = ["writer", "rewriter", None, "writer", "rewriter", None]
    else:
        model, options, agents = (
            _model(kind, len(tokenizer), tokenizer.eos_token_id, hidden=256),
            {},
            [None] * 6,
        )
    grouped = backends(model, packed_weights_mb=1024, **options)
    forward = backends(model, direct_decode=False, packed_weights_mb=1024, **options)
    small = backends(model, packed_weights_mb=1, **options)  # no room for every weight: no groups
    done: list[bool] = []
    for backend in (grouped, small):
        multiply = backend._linears.multiply_group

        def counting(layers: Any, x: torch.Tensor, multiply: Any = multiply) -> bool:
            done.append(multiply(layers, x))
            return done[-1]

        backend._linears.multiply_group = counting
    requests = [_request(q, agent=a) for q, a in zip(QUESTIONS, agents, strict=True)]
    expected = _together(forward, requests)
    _assert_same(_together(grouped, requests), expected)
    assert done and all(done)  # every layer's two groups, every step
    stacked = [layers for layers, *_ in grouped._linears._packed.values() if len(layers) > 1]
    assert grouped._direct.enabled and stacked  # the stacked copies, kept between batches
    with grouped.lock:  # until someone may change the weights
        assert grouped._linears.nbytes == 0
    calls = len(done)
    _assert_same(_together(small, requests), expected)
    assert not any(done[calls:])
