"""The loss options of ``algorithm`` (``clip_eps_high``, ``loss_norm``, ``kl_reference``) and the task
filter of ``tasks.filter``: each checked against a loss computed by hand on a tiny batch, and each bad
setting refused with a message before any model loads."""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from agl_core.records import Transition
from agl_trainer.config import ConfigError, TrainerConfig, load_config
from agl_trainer.learning.algo import Advantaged
from agl_trainer.learning.update import batch_loss, loss_weights, reference_logprobs_fn, response_logprobs
from agl_trainer.run.data import DatasetError, load_splits

from .test_init_adapter import _saved_adapter

# -- the loss, by hand -------------------------------------------------------------------------------------

#: (rollout, call, prompt, response, advantage, per-token log-ratio new - behaviour): two rollouts, the
#: first with two calls, responses of 2, 3 and 4 tokens, ratios inside and outside the clip range.
BATCH = [
    ("r1", 0, [5, 6, 7], [8, 9], 1.0, [math.log(1.25), 0.0]),
    ("r1", 1, [5, 6, 7, 8, 9], [10, 11, 12], 1.0, [math.log(0.7), math.log(1.1), math.log(1.5)]),
    ("r2", 0, [5, 6, 7], [13, 14, 15, 16], -1.0, [math.log(0.7), math.log(1.25), 0.0, math.log(0.9)]),
]


def _transition(
    rollout: str, call: int, prompt: Any, response: Any, behaviour: list[float] | None = None
) -> Transition:
    return Transition(
        rollout,
        None,
        "task",
        call,
        tuple(prompt),
        tuple(response),
        None if behaviour is None else tuple(behaviour),
        0.0,
    )


def _tiny_lora(seed: int = 0) -> Any:
    from peft import LoraConfig, get_peft_model

    from agl_trainer.model import tiny_model

    model = get_peft_model(
        tiny_model(64, seed=seed),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    return model


def _samples(model: Any) -> list[Advantaged]:
    """BATCH's samples, with behaviour logprobs set so that each token's ratio under ``model`` is the
    given one."""
    bare = [Advantaged(_transition(r, c, prompt, response), adv) for r, c, prompt, response, adv, _ in BATCH]
    with torch.no_grad():
        current = response_logprobs(model, bare, pad_id=0)
    out = []
    for s, lp, (*_, log_ratios) in zip(bare, current, BATCH, strict=True):
        behaviour = [float(x) - d for x, d in zip(lp, log_ratios, strict=True)]
        t = s.transition
        out.append(
            Advantaged(
                _transition(t.rollout_id, t.call_index, t.prompt_ids, t.response_ids, behaviour), s.advantage
            )
        )
    return out


def _token_losses(low: float, high: float) -> list[list[float]]:
    """Each call's per-token PPO-clip losses, from BATCH's ratios and advantages, in plain floats."""
    out = []
    for *_, adv, log_ratios in BATCH:
        losses = []
        for d in log_ratios:
            ratio = math.exp(d)
            losses.append(-min(ratio * adv, min(max(ratio, 1 - low), 1 + high) * adv))
        out.append(losses)
    return out


def _by_hand(loss_norm: str, low: float = 0.2, high: float = 0.2, norm_tokens: int = 10) -> float:
    losses = _token_losses(low, high)
    if loss_norm == "rollout":  # r1: mean of its two calls' means; r2: its one call's mean; then the mean
        r1 = (sum(losses[0]) / 2 + sum(losses[1]) / 3) / 2
        r2 = sum(losses[2]) / 4
        return (r1 + r2) / 2
    if loss_norm == "token":  # 9 tokens alike
        return sum(sum(x) for x in losses) / 9
    return sum(sum(x) for x in losses) / (norm_tokens * 2)  # constant: summed per rollout, over 2 rollouts


@pytest.mark.parametrize("loss_norm", ["rollout", "token", "constant"])
@pytest.mark.parametrize(("low", "high"), [(0.2, None), (0.2, 0.28)])
def test_the_loss_is_the_hand_computed_one(loss_norm, low, high):
    model = _tiny_lora()
    samples = _samples(model)
    loss, info = batch_loss(
        model,
        samples,
        clip_eps=low,
        clip_eps_high=high,
        pad_id=0,
        loss_norm=loss_norm,
        norm_tokens=10 if loss_norm == "constant" else None,
    )
    expected = _by_hand(loss_norm, low, high if high is not None else low)
    assert loss == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # with A=+1, 1.25 clips at 1.2 but not at 1.28, 1.5 at both; with A=-1, 0.7 clips at 0.8
    clipped = 3 if high is None else 2
    assert info["clip_fraction"] == pytest.approx(clipped / 9)


def test_the_clip_higher_bound_changes_the_loss_where_it_should():
    model = _tiny_lora()
    samples = _samples(model)
    symmetric, _ = batch_loss(model, samples, clip_eps=0.2, pad_id=0, loss_norm="token")
    higher, _ = batch_loss(model, samples, clip_eps=0.2, clip_eps_high=0.28, pad_id=0, loss_norm="token")
    # only the ratios above 1.2 with A=+1 move: 1.25 (-1.2 -> -1.25) and 1.5 (-1.2 -> -1.28), over 9 tokens
    assert higher - symmetric == pytest.approx(-(0.05 + 0.08) / 9, rel=1e-4)


def test_loss_weights_per_norm():
    model = _tiny_lora()
    samples = _samples(model)
    assert loss_weights(samples, "rollout") == pytest.approx([0.25, 0.25, 0.5])
    assert loss_weights(samples, "token") == pytest.approx([2 / 9, 3 / 9, 4 / 9])
    assert loss_weights(samples, "constant", 10) == pytest.approx([2 / 20, 3 / 20, 4 / 20])
    with pytest.raises(ValueError, match="choose one of rollout, token, constant"):
        loss_weights(samples, "sequence")


def test_gradients_follow_the_normalisation():
    """The token-level loss weighs r2's longer response more than the rollout mean does: the gradients
    differ, and each equals the gradient of the hand-weighted sum of token losses."""
    grads = {}
    for norm in ("rollout", "token"):
        model = _tiny_lora()
        samples = _samples(model)
        batch_loss(model, samples, clip_eps=0.2, pad_id=0, loss_norm=norm, backward=True)
        grads[norm] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert not torch.allclose(grads["rollout"], grads["token"])


# -- the KL reference adapter ------------------------------------------------------------------------------


def _tiny_peft(r: int = 8) -> Any:
    from peft import LoraConfig, get_peft_model

    from agl_trainer.model import load_policy

    model, _ = load_policy("tiny", seed=0)
    lora = LoraConfig(
        r=r, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"
    )
    return get_peft_model(model, lora)


def _sample(prompt: list[int], response: list[int]) -> Advantaged:
    return Advantaged(_transition("r", 0, prompt, response), 1.0)


def test_the_reference_adapter_gives_its_own_logprobs_and_leaves_the_trained_weights(tmp_path):
    saved = _saved_adapter(tmp_path / "warm", seed=3)
    model = _tiny_peft()
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for p in params.values():
            p.add_(0.01)
    before = {name: p.detach().clone() for name, p in params.items()}
    samples = [_sample([100, 200, 300], [400, 500, 600]), _sample([100, 200], [700, 800])]
    compute = reference_logprobs_fn(model, 0, adapter=tmp_path / "warm" / "adapter_model.safetensors")
    reference = compute(samples)

    warm = _tiny_peft()
    with torch.no_grad():
        for name, p in warm.named_parameters():
            if name in saved:
                p.copy_(saved[name])
        expected = response_logprobs(warm, samples, pad_id=0)
    for got, want in zip(reference, expected, strict=True):
        assert torch.allclose(got, want, atol=1e-6)
    # the trained adapter is back, the same tensors (the optimizer's) with the same values
    after = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert all(after[name] is params[name] and torch.equal(after[name], before[name]) for name in params)
    with torch.no_grad():
        own = response_logprobs(model, samples, pad_id=0)
    assert not torch.allclose(own[0], reference[0])


def test_the_kl_to_a_reference_equal_to_the_policy_is_zero(tmp_path):
    _saved_adapter(tmp_path / "warm", seed=3)
    model = _tiny_peft()
    weights = tmp_path / "warm" / "adapter_model.safetensors"
    from agl_trainer.model import load_adapter_weights

    load_adapter_weights(model, weights)
    sample = _sample([100, 200, 300], [400, 500, 600])
    reference = reference_logprobs_fn(model, 0, adapter=weights)
    _, info = batch_loss(model, [sample], clip_eps=0.2, pad_id=0, kl_coef=0.1, reference=reference)
    assert info["kl_to_reference"] == pytest.approx(0.0, abs=1e-6)
    base = reference_logprobs_fn(model, 0)  # toward the base model: the adapter moved it away
    _, info = batch_loss(model, [sample], clip_eps=0.2, pad_id=0, kl_coef=0.1, reference=base)
    assert info["kl_to_reference"] > 1e-4


def test_a_reference_adapter_of_another_shape_is_refused_at_load(tmp_path):
    _saved_adapter(tmp_path / "r4", r=4)
    with pytest.raises(ValueError, match="does not fit model.lora"):
        reference_logprobs_fn(_tiny_peft(r=8), 0, adapter=tmp_path / "r4" / "adapter_model.safetensors")


def test_a_run_loads_the_reference_it_is_given(tmp_path):
    from agl_trainer.learning.policy import load_trainable_policy

    _saved_adapter(tmp_path / "warm", seed=3)
    config = TrainerConfig.model_validate(
        {
            "agent": "agent:solve",
            "output_dir": str(tmp_path / "run"),
            "model": {"source": "tiny", "init_adapter": str(tmp_path / "warm")},
            "algorithm": {"kl_coef": 0.05, "kl_reference": "init_adapter"},
        }
    )
    lines: list[str] = []
    with contextlib.ExitStack() as stack:
        policy = load_trainable_policy(config, stack, echo=lines.append)
        assert policy.reference is not None
        sample = _sample([100, 200, 300], [400, 500, 600])
        _, info = batch_loss(
            policy.model, [sample], clip_eps=0.2, pad_id=0, kl_coef=0.05, reference=policy.reference
        )
        assert info["kl_to_reference"] == pytest.approx(0.0, abs=1e-6)  # it starts at the warm start
    assert any(line.startswith("KL reference: the adapter in") for line in lines), lines


# -- bad settings: each refused with what to do, before any model loads -------------------------------------

GOOD = """
agent: agent:solve
tasks: tasks.jsonl
model: {source: tiny}
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "tasks.jsonl").write_text(
        "".join(json.dumps({"id": f"t{i}", "question": f"{i}+1", "answer": i + 1}) + "\n" for i in range(6))
    )
    return tmp_path


def _load(folder: Path, text: str) -> TrainerConfig:
    path = folder / "cfg.yaml"
    path.write_text(GOOD + text)
    return load_config(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("algorithm: {clip_eps: 0.2, clip_eps_high: 0.1}\n", "clip bounds out of order: clip_eps_high (0.1)"),
        ("algorithm: {loss_norm: constant}\n", "set algorithm.norm_tokens"),
        ("algorithm: {norm_tokens: 256}\n", "norm_tokens applies only to loss_norm: constant"),
        ("algorithm: {loss_norm: sequence}\n", "'rollout', 'token' or 'constant'"),
        ("algorithm: {kl_reference: init_adapter}\n", "kl_coef is 0, so there is no KL penalty"),
        ("algorithm: {kl_coef: 0.1, kl_reference: init_adapter}\n", "model.init_adapter, which is not set"),
        ("algorithm: {kl_coef: 0.1, kl_reference: nowhere}\n", "nowhere is not a directory"),
        ("tasks: {train: tasks.jsonl, filter: {scores: s.jsonl, above: 0.5, below: 0.5}}\n", "out of order"),
        ("tasks: {train: tasks.jsonl, filter: {scores: missing.jsonl}}\n", "missing.jsonl does not exist"),
    ],
)
def test_bad_settings_are_named(folder, text, message):
    with pytest.raises(ConfigError) as info:
        _load(folder, text)
    assert message in str(info.value)


def test_a_reference_adapter_that_does_not_fit_is_named(folder):
    _saved_adapter(folder / "r16", r=16)
    with pytest.raises(ConfigError, match="rank 16 where model.lora.r is 8"):
        _load(folder, "algorithm: {kl_coef: 0.1, kl_reference: r16}\n")
    (folder / "notlora").mkdir()
    (folder / "notlora" / "adapter_config.json").write_text('{"peft_type": "PREFIX_TUNING"}')
    (folder / "notlora" / "adapter_model.safetensors").write_bytes(b"\x00" * 8)
    with pytest.raises(ConfigError, match="'PREFIX_TUNING', not a LoRA adapter"):
        _load(folder, "algorithm: {kl_coef: 0.1, kl_reference: notlora}\n")
    # same rank and modules, but trained on another model (other widths) than the warm start
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    get_peft_model(other, lora).save_pretrained(folder / "other")
    _saved_adapter(folder / "warm")
    with pytest.raises(ConfigError, match="does not fit the model .* was trained on"):
        _load(
            folder,
            "model: {source: tiny, init_adapter: warm}\nalgorithm: {kl_coef: 0.1, kl_reference: other}\n",
        )
    config = _load(
        folder, "model: {source: tiny, init_adapter: warm}\nalgorithm: {kl_coef: 0.1, kl_reference: warm}\n"
    )
    assert config.algorithm.kl_reference == str(folder / "warm")


def test_verl_takes_the_clip_bounds_and_keeps_its_own_loss_settings():
    verl = {
        "agent": "agent:solve",
        "model": {"source": "Qwen/Qwen2.5-1.5B-Instruct"},
        "update": {"backend": "verl"},
        "serving": {"backend": "vllm"},
    }
    from agl_trainer.learning.verl_backend import verl_overrides

    config = TrainerConfig.model_validate({**verl, "algorithm": {"clip_eps": 0.2, "clip_eps_high": 0.28}})
    actor = verl_overrides(config)["actor_rollout_ref"]["actor"]
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"]) == (0.2, 0.28)
    with pytest.raises(ValueError, match="algorithm.loss_norm applies only to update.backend torch"):
        TrainerConfig.model_validate({**verl, "algorithm": {"loss_norm": "token"}})
    with pytest.raises(ValueError, match="algorithm.kl_reference applies only to update.backend torch"):
        TrainerConfig.model_validate({**verl, "algorithm": {"kl_coef": 0.1, "kl_reference": "elsewhere"}})


def _scores(folder: Path, rows: list[dict[str, Any]]) -> None:
    (folder / "scores.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_filter_keeps_the_tasks_solved_sometimes(folder):
    _scores(
        folder,
        [
            {"task_id": "t0", "score": 0.0},
            {"task_id": "t1", "score": 0.25},
            {"task_id": "t2", "score": 1.0},
            {"task_id": "t3", "score": 0.75},
            {"task_id": "t4", "score": None},
        ],
    )
    config = _load(folder, "tasks: {train: tasks.jsonl, filter: {scores: scores.jsonl}}\n")
    train, _ = load_splits(config.tasks)
    assert [t.task_id for t in train] == ["t1", "t3"]
    config = _load(folder, "tasks: {train: tasks.jsonl, filter: {scores: scores.jsonl, unscored: keep}}\n")
    assert [t.task_id for t in load_splits(config.tasks)[0]] == ["t1", "t3", "t4", "t5"]
    config = _load(
        folder, "tasks: {train: tasks.jsonl, filter: {scores: scores.jsonl, above: -1, below: 0.5}}\n"
    )
    assert [t.task_id for t in load_splits(config.tasks)[0]] == ["t0", "t1"]


def test_a_filter_that_leaves_no_task_is_refused_with_the_counts(folder):
    _scores(folder, [{"task_id": "t0", "score": 0.0}, {"task_id": "t1", "score": 1.0}])
    config = _load(folder, "tasks: {train: tasks.jsonl, filter: {scores: scores.jsonl}}\n")
    with pytest.raises(DatasetError) as info:
        load_splits(config.tasks)
    assert "leaves no training task: of 6, 1 scored <= 0.0, 1 scored >= 1.0 and 4 have no score" in str(
        info.value
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ('{"score": 0.5}', "needs a task_id"),
        ('{"task_id": "t1", "score": "high"}', "is not a finite number"),
        ('{"task_id": "t1", "score": NaN}', "is not a finite number"),
        ('{"task_id": "t1", "score": 1e999}', "is not a finite number"),
        ('{"task_id": "t1", "score": 0.5}\n{"task_id": "t1", "score": 0.5}', "scored twice"),
    ],
)
def test_a_bad_scores_file_is_named_with_its_line(folder, line, message):
    (folder / "scores.jsonl").write_text(line + "\n")
    config = _load(folder, "tasks: {train: tasks.jsonl, filter: {scores: scores.jsonl}}\n")
    with pytest.raises(DatasetError, match=message) as info:
        load_splits(config.tasks)
    assert "scores.jsonl:" in str(info.value)


def test_the_cli_refuses_an_empty_filter_before_any_model_loads(folder):
    _scores(folder, [{"task_id": f"t{i}", "score": 0.0} for i in range(6)])
    (folder / "agent.py").write_text("def solve(task, llm):\n    return 0.0\n")
    path = folder / "cfg.yaml"
    path.write_text(
        GOOD.replace("tasks: tasks.jsonl", "tasks: {train: tasks.jsonl, filter: {scores: scores.jsonl}}")
        + f"output_dir: {folder / 'out'}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "agl_core.cli", "train", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "tasks.filter leaves no training task: of 6, 6 scored <= 0.0" in done.stderr
    assert "model:" not in done.stdout + done.stderr and not (folder / "out").exists()
