"""``model.init_adapter``: a run's LoRA adapter starts from saved weights (an SFT warm start), which must
be a single LoRA adapter of ``model.lora``'s shape; the config says what is wrong otherwise."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

from agl_trainer.config import ConfigError, TrainerConfig, load_config


def _saved_adapter(directory: Path, *, r: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny-model LoRA adapter with non-zero B weights saved in ``directory``; its weights by name."""
    from peft import LoraConfig, get_peft_model

    from agl_trainer.model import load_policy

    model, _ = load_policy("tiny", seed=0)
    lora = LoraConfig(
        r=r, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"
    )
    model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator))
    model.save_pretrained(directory)
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


def _config(tmp_path: Path, **model: Any) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {"agent": "agent:solve", "output_dir": str(tmp_path / "run"), "model": {"source": "tiny", **model}}
    )


def test_the_adapter_starts_from_the_saved_weights(tmp_path):
    from agl_trainer.learning.policy import load_trainable_policy

    saved = _saved_adapter(tmp_path / "sft" / "checkpoints" / "step-3" / "adapter")
    (tmp_path / "sft" / "checkpoints" / "step-3" / "state.json").write_text(
        '{"step": 3, "policy_version": 3}'
    )
    lines: list[str] = []
    with contextlib.ExitStack() as stack:  # a run's output_dir: its newest checkpoint
        policy = load_trainable_policy(
            _config(tmp_path, init_adapter=str(tmp_path / "sft")), stack, echo=lines.append
        )
        loaded = {name: p for name, p in policy.model.named_parameters() if "lora_" in name}
        assert loaded.keys() == saved.keys()
        assert all(torch.equal(loaded[name], saved[name]) for name in saved)
        assert all(p.requires_grad for p in loaded.values())
    assert any("starts from" in line and "step-3 (policy v3)" in line for line in lines), lines
    with contextlib.ExitStack() as stack:  # without it: a fresh adapter (B at zero)
        fresh = load_trainable_policy(_config(tmp_path), stack, echo=lambda _: None)
        assert all(not p.any() for name, p in fresh.model.named_parameters() if "lora_B" in name)


def test_an_adapter_of_another_shape_or_nothing_at_all_is_refused(tmp_path):
    from agl_trainer.learning.policy import load_trainable_policy

    _saved_adapter(tmp_path / "r4", r=4)
    (tmp_path / "empty").mkdir()
    for where, message in [("r4", "does not fit model.lora"), ("empty", "holds no checkpoint")]:
        with contextlib.ExitStack() as stack, pytest.raises(ValueError, match=message):
            load_trainable_policy(
                _config(tmp_path, init_adapter=str(tmp_path / where)), stack, echo=lambda _: None
            )


def test_the_config_resolves_init_adapter_and_says_what_is_wrong(tmp_path):
    (tmp_path / "tasks.jsonl").write_text('{"id": "t", "question": "q"}\n')
    (tmp_path / "warm").mkdir()
    base = "agent: agent:solve\ntasks: tasks.jsonl\nmodel: {source: tiny, init_adapter: warm"
    path = tmp_path / "config.yaml"
    path.write_text(base + "}\n")
    assert load_config(path).model.init_adapter == str(tmp_path / "warm")
    for text, message in [
        (base.replace("warm", "cold") + "}\n", "'model.init_adapter': .*cold is not a directory"),
        (base + ", lora: null}\n", "model.init_adapter needs model.lora"),
        (base + "}\npolicies: [{name: a, agents: [a]}]\n", "without policies"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_config(path)
