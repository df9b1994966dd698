"""LightningRL's update: PPO-clip loss by hand, per-rollout normalisation, and a real LoRA step."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from agl_core.records import Transition  # noqa: E402
from agl_trainer.learning.algo import Advantaged, group_advantages  # noqa: E402
from agl_trainer.learning.update import batch_loss, ppo_clip_token_loss, response_logprobs, update_step  # noqa: E402


def test_ppo_clip_loss_and_gradient_by_hand():
    new = torch.tensor([math.log(1.5), math.log(1.5), math.log(0.5)], requires_grad=True)
    old = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, 1.0])
    loss, clipped = ppo_clip_token_loss(new, old, adv, clip_eps=0.2)
    # ratio 1.5, A=+1: min(1.5, 1.2) = 1.2 (clipped); A=-1: min(-1.5, -1.2) = -1.5;
    # ratio 0.5, A=+1: min(0.5, 0.8) = 0.5
    assert loss.tolist() == pytest.approx([-1.2, 1.5, -0.5])
    assert clipped.tolist() == [True, False, False]
    loss.sum().backward()
    # d(-ratio*A)/d(logp) = -A * ratio where unclipped, 0 where the clip is active
    assert new.grad.tolist() == pytest.approx([0.0, 1.5, -0.5])


def _t(rollout, index, reward, prompt=(1, 2, 3), response=(4, 5), logprobs=None):
    return Transition(rollout, None, None, index, tuple(prompt), tuple(response), logprobs, reward)


def test_group_advantages_are_per_task_group_and_skip_ties():
    transitions = [
        _t("a1", 0, 1.0),
        _t("a1", 1, 1.0),
        _t("a2", 0, 0.0),  # group A: scores 1, 0
        _t("b1", 0, 0.5),
        _t("b2", 0, 0.5),  # group B: tie -> skipped
        _t("c1", 0, 1.0),  # group C: alone -> skipped
    ]
    groups = {"a1": "A", "a2": "A", "b1": "B", "b2": "B", "c1": "C"}
    samples, report = group_advantages(transitions, groups)
    assert [(s.transition.rollout_id, round(s.advantage, 4)) for s in samples] == [
        ("a1", 1.0),
        ("a1", 1.0),
        ("a2", -1.0),
    ]
    assert (report.groups, report.skipped_no_variance, report.skipped_singleton) == (3, 1, 1)


def test_given_rollout_scores_set_the_group_baseline():
    """Episode rewards tie (1, 1), but rollout b1's first call was penalised: with the scores credit
    assignment gives (episode reward + mean intermediate reward per call) the group carries a signal, and
    the penalised call's advantage is the lowest."""
    transitions = [_t("b1", 0, 0.0), _t("b1", 1, 1.0), _t("b2", 0, 1.0), _t("b2", 1, 1.0)]
    groups = {"b1": "B", "b2": "B"}
    assert group_advantages(transitions, groups)[1].skipped_no_variance == 1  # last calls tie: no signal
    samples, report = group_advantages(transitions, groups, scores={"b1": 0.5, "b2": 1.0})
    assert report.skipped_no_variance == 0
    # mean 0.75, std 0.25: (1 - 0.75) / 0.25 = 1, (0 - 0.75) / 0.25 = -3
    assert [round(s.advantage, 4) for s in samples] == [-3.0, 1.0, 1.0, 1.0]


class _Constant(torch.nn.Module):
    """A 'model' whose log-probabilities are given per token position, to check the loss weighting."""

    def __init__(self, vocab: int = 8) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(vocab))

    def forward(self, input_ids, attention_mask=None):
        class Out:
            pass

        out = Out()
        out.logits = self.logits.expand(input_ids.shape[0], input_ids.shape[1], -1)
        return out


def test_loss_is_normalised_per_rollout_not_per_call():
    model = _Constant()  # uniform: every token has logprob -log(8); on-policy ratio = 1
    lp = -math.log(8)
    # rollout r1 has three calls with advantage +1, rollout r2 one call with advantage -1
    samples = [Advantaged(_t("r1", i, 1.0, logprobs=(lp, lp)), 1.0) for i in range(3)]
    samples.append(Advantaged(_t("r2", 0, 0.0, logprobs=(lp, lp)), -1.0))
    loss, info = batch_loss(model, samples, clip_eps=0.2, pad_id=0)
    # per call loss = -A; r1 mean = -1, r2 mean = +1; mean over rollouts = 0 (per-call mean would be -0.5)
    assert loss == pytest.approx(0.0, abs=1e-6)
    assert info["tokens"] == 8 and info["clip_fraction"] == 0.0
    # micro-batching must not change the result
    small, _ = batch_loss(model, samples, clip_eps=0.2, pad_id=0, micro_batch_tokens=64)
    assert small == pytest.approx(loss, abs=1e-6)


def test_one_lora_update_changes_the_adapter_and_lowers_the_loss():
    from peft import LoraConfig, get_peft_model

    from agl_trainer.model import tiny_model

    torch.manual_seed(0)
    model = get_peft_model(
        tiny_model(256, seed=1),
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM"
        ),
    )
    gen = torch.Generator().manual_seed(3)
    transitions = []
    for i in range(4):
        prompt = torch.randint(1, 256, (6,), generator=gen).tolist()
        response = torch.randint(1, 256, (4,), generator=gen).tolist()
        transitions.append(_t(f"r{i}", 0, float(i % 2), prompt, response))
    # behaviour logprobs = the current policy's, as the gateway would have recorded them
    with torch.no_grad():
        current = response_logprobs(model, [Advantaged(t, 0.0) for t in transitions], pad_id=0)
    transitions = [
        Transition(t.rollout_id, None, None, 0, t.prompt_ids, t.response_ids, tuple(lp.tolist()), t.reward)
        for t, lp in zip(transitions, current, strict=True)
    ]
    samples, _ = group_advantages(transitions, {t.rollout_id: "g" for t in transitions})
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with torch.no_grad():
        loss_before, _ = batch_loss(model, samples, clip_eps=0.2, pad_id=0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    stats = update_step(model, optimizer, samples, clip_eps=0.2, pad_id=0)
    with torch.no_grad():
        loss_after, _ = batch_loss(model, samples, clip_eps=0.2, pad_id=0)

    assert stats.transitions == 4 and stats.rollouts == 4 and stats.tokens == 16
    assert stats.loss == pytest.approx(loss_before, abs=1e-6)
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed and all("lora_" in n for n in changed)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert loss_after < loss_before - 1e-4


def test_kl_k3_by_hand_and_zero_at_the_reference():
    from agl_trainer.learning.update import kl_k3

    new = torch.tensor([math.log(0.5), math.log(0.25)], requires_grad=True)
    ref = torch.tensor([math.log(0.25), math.log(0.25)])
    kl = kl_k3(new, ref)
    # delta = ref - new: [-log 2, 0] -> exp(-log2) + log2 - 1 = 0.5 + 0.6931 - 1
    assert kl.tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0])
    kl.sum().backward()
    # d/dnew [exp(ref-new) - (ref-new) - 1] = 1 - exp(ref - new)
    assert new.grad.tolist() == pytest.approx([0.5, 0.0])


def test_advantage_estimators():
    from agl_trainer.learning.algo import compute_advantages

    ts = [_t("a", 0, 1.0), _t("b", 0, 0.0), _t("c", 0, 3.0), _t("d", 0, 1.0)]
    groups = {"a": "g1", "b": "g1", "c": "g2", "d": "g2"}
    grpo, _ = compute_advantages(ts, groups, "grpo")
    ppo, _ = compute_advantages(ts, groups, "ppo")
    rpp, _ = compute_advantages(ts, groups, "reinforce_pp")
    assert [round(s.advantage, 4) for s in grpo] == [1.0, -1.0, 1.0, -1.0]
    assert [s.advantage for s in ppo] == [0.5, -0.5, 1.0, -1.0]
    # group baseline, then normalised over the batch: [.5,-.5,1,-1] has mean 0 and std sqrt(0.625)
    assert [round(s.advantage, 4) for s in rpp] == [
        round(x / math.sqrt(0.625), 4) for x in (0.5, -0.5, 1.0, -1.0)
    ]
    with pytest.raises(ValueError, match="unknown algorithm"):
        compute_advantages(ts, groups, "dpo")


def test_kl_penalty_uses_the_adapter_free_model_as_reference():
    from peft import LoraConfig, get_peft_model

    from agl_trainer.learning.update import reference_logprobs_fn
    from agl_trainer.model import tiny_model

    model = get_peft_model(
        tiny_model(128, seed=2),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    samples = [
        Advantaged(_t(f"r{i}", 0, float(i), (1, 2, 3), (4 + i, 5, 6 + i)), 1.0 if i else -1.0)
        for i in range(2)
    ]
    reference = reference_logprobs_fn(model, pad_id=0)
    _, info = batch_loss(model, samples, clip_eps=0.2, pad_id=0, kl_coef=0.1, reference=reference)
    assert info["kl_to_reference"] == pytest.approx(0.0, abs=1e-7)  # LoRA B starts at 0: policy == reference
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    update_step(model, optimizer, samples, clip_eps=0.2, pad_id=0)
    _, info = batch_loss(model, samples, clip_eps=0.2, pad_id=0, kl_coef=0.1, reference=reference)
    assert info["kl_to_reference"] > 1e-6
    with pytest.raises(ValueError, match="needs a reference"):
        batch_loss(model, samples, clip_eps=0.2, pad_id=0, kl_coef=0.1)


def test_a_prompt_shared_by_a_group_runs_once_with_the_same_loss_and_gradients(monkeypatch):
    """A task group's rollouts share their prompt: the update runs it once and the responses on its keys
    and values. Loss and gradients must equal running every sequence whole."""
    from peft import LoraConfig, get_peft_model

    from agl_trainer.learning import update
    from agl_trainer.model import tiny_model

    torch.manual_seed(0)
    model = get_peft_model(
        tiny_model(256, seed=2),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    for name, p in model.named_parameters():  # LoRA B starts at zero: give the adapter a gradient path
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    gen = torch.Generator().manual_seed(5)
    samples = []
    for g in range(2):  # two groups, each one prompt and responses of different lengths
        prompt = torch.randint(1, 256, (9 + g,), generator=gen).tolist()
        for k in range(3):
            response = torch.randint(1, 256, (2 + k,), generator=gen).tolist()
            logprobs = tuple(-1.0 - 0.1 * j for j in range(len(response)))
            samples.append(Advantaged(_t(f"r{g}{k}", 0, 0.0, prompt, response, logprobs), 1.0 - k))
    samples.append(Advantaged(_t("alone", 0, 0.0, (7, 8, 9), (10, 11), (-2.0, -2.0)), 0.5))

    def loss_and_grads() -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss, _ = batch_loss(model, samples, clip_eps=0.2, pad_id=0, backward=True)
        return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    runs = []
    real = update._shared_prompt_logprobs
    monkeypatch.setattr(
        update, "_shared_prompt_logprobs", lambda *a, **k: runs.append(len(a[1])) or real(*a, **k)
    )
    shared_loss, shared_grads = loss_and_grads()
    assert sorted(runs) == [3, 3]  # each group's prompt ran once, for its three responses
    monkeypatch.setattr(update, "_shared_prompt_logprobs", lambda *a, **k: None)  # every sequence whole
    whole_loss, whole_grads = loss_and_grads()

    assert shared_loss == pytest.approx(whole_loss, abs=1e-5)
    assert shared_grads.keys() == whole_grads.keys() and shared_grads
    for name, grad in whole_grads.items():
        assert torch.allclose(shared_grads[name], grad, atol=1e-5, rtol=1e-4), name


def test_a_recomputed_shared_prompt_keeps_less_for_backward_with_the_same_loss_and_gradients():
    """``recompute``: the shared prompt's layers keep only their inputs and run again in the backward pass.
    Loss and gradients equal those without it; far fewer bytes are saved for the backward pass; the layers
    are themselves again afterwards."""
    from peft import LoraConfig, get_peft_model

    from agl_trainer.learning import update
    from agl_trainer.model import tiny_model

    torch.manual_seed(0)
    model = get_peft_model(
        tiny_model(256, seed=3),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(1, 256, (96,), generator=gen).tolist()  # long prompt, short responses
    samples = [
        Advantaged(
            _t(f"r{k}", 0, 0.0, prompt, torch.randint(1, 256, (2 + k,), generator=gen).tolist()), 1.0 - k
        )
        for k in range(3)
    ]

    def loss_and_grads(recompute: bool) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss, _ = batch_loss(model, samples, clip_eps=0.2, pad_id=0, backward=True, recompute=recompute)
        return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain_loss, plain_grads = loss_and_grads(False)
    loss, grads = loss_and_grads(True)
    assert loss == pytest.approx(plain_loss, abs=1e-6)
    assert grads.keys() == plain_grads.keys() and grads
    for name, grad in plain_grads.items():
        assert torch.allclose(grads[name], grad, atol=1e-6, rtol=1e-5), name

    def saved_bytes(recompute: bool) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logprobs = update._shared_prompt_logprobs(model, samples, 0, recompute=recompute)
        assert logprobs is not None and [len(lp) for lp in logprobs] == [2, 3, 4]
        return total

    assert saved_bytes(True) < 0.5 * saved_bytes(False)
    layers = update._decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    assert all("forward" not in vars(layer) for layer in layers)  # the checkpointing wrapper is gone
