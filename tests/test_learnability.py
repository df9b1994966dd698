"""The whole update machinery learns: a tiny random model, sampled through the real HF backend (exact
tokens, behaviour logprobs), rewarded for a trivial behaviour, raises its mean reward within seconds."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")


def _word_tokenizer(size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, size)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", pad_token="<eos>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tok


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "reinforce_pp"])
def test_tiny_model_learns_to_say_even_words(algorithm):
    from agl_core.gateway import ChatRequest, Completion
    from agl_core.records import Transition
    from agl_trainer.generation.hf_backend import HFBackend
    from agl_trainer.learning.algo import compute_advantages
    from agl_trainer.learning.update import update_step
    from agl_trainer.model import tiny_model

    torch.manual_seed(0)
    tok = _word_tokenizer(32)
    model = tiny_model(32, seed=0, eos_token_id=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    backend = HFBackend(model, tok, model_name="tiny")
    request = ChatRequest(messages=[{"role": "user", "content": "w3 w5"}], max_tokens=8)

    def reward(ids):
        return sum(1 for t in ids if t and t % 2 == 0) / 8

    async def sample():
        (completion,) = [e async for e in backend.generate("tiny", request) if isinstance(e, Completion)]
        return completion

    def rollouts(step):
        out = []
        for g in range(8):
            c = asyncio.run(sample())
            out.append(
                Transition(
                    f"s{step}-{g}",
                    None,
                    "t",
                    0,
                    c.prompt_ids,
                    c.response_ids,
                    c.response_logprobs,
                    reward(c.response_ids),
                )
            )
        return out

    means = []
    for step in range(25):
        batch = rollouts(step)
        means.append(sum(t.reward for t in batch) / len(batch))
        samples, _ = compute_advantages(batch, {t.rollout_id: "g" for t in batch}, algorithm)
        if samples:
            update_step(model, optimizer, samples, clip_eps=0.2, pad_id=0)
    before = sum(means[:3]) / 3
    after = sum(means[-3:]) / 3
    assert before < 0.7 and after > 0.85 and after > before + 0.25, means
