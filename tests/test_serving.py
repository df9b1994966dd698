"""Serving the policy during training: the vLLM path against the fake vLLM server (vLLM's documented
protocol, see ``tests/fake_vllm.py``), the transformers path in process.

End to end: train-like weight changes on the tiny LoRA policy, ``publish``, then a rollout through the
gateway; the call must be served by the new adapter and its span must carry the new policy version.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from agl_core import semconv
from agl_core.gateway import BackendError, rollout_base_url
from agl_core.server import BackgroundServer
from agl_core.testing import GatewayServer
from agl_trainer.config import TrainerConfig
from agl_trainer.run.serving import (
    HFServing,
    VLLMServing,
    start_serving,
    vllm_launch_kwargs,
    vllm_max_lora_rank,
)

from .fake_vllm import FakeVLLM

HI = [{"role": "user", "content": "hi there"}]
ROOT = Path(__file__).resolve().parent.parent


def _config(tmp_path: Path, **sections) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {"agent": "agent:run", "tasks": "tasks.jsonl", "output_dir": str(tmp_path / "run"), **sections}
    )


def _lora_policy(seed: int = 0, r: int = 4):
    from peft import LoraConfig, get_peft_model

    from agl_trainer.model import load_policy

    model, tokenizer = load_policy("tiny", seed=seed)
    return get_peft_model(
        model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    ), tokenizer


def _step(model, seed: int) -> None:
    """Move the adapter's weights, as an optimizer step would."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)


def _lora_state(model):
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def test_max_lora_rank_is_one_vllm_accepts():
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 16, 17, 300, 512)] == [1, 8, 8, 16, 16, 32, 320, 512]


def test_launch_arguments_follow_the_config(tmp_path):
    config = _config(
        tmp_path,
        model={"source": "Qwen/Qwen2.5-1.5B-Instruct", "served_name": "policy", "lora": {"r": 24}},
        serving={
            "backend": "vllm",
            "vllm": {
                "launch": {
                    "tensor_parallel_size": 2,
                    "gpu_memory_utilization": 0.45,
                    "max_model_len": 8192,
                    "extra_args": ["--dtype", "bfloat16"],
                    "env": {"CUDA_VISIBLE_DEVICES": "1,2"},
                }
            },
        },
    )
    assert vllm_launch_kwargs(config) == {
        "model": "Qwen/Qwen2.5-1.5B-Instruct",
        "model_name": "policy",
        "tool_call_parser": "hermes",
        "enable_lora": True,
        "max_lora_rank": 32,
        "extra_args": [
            "--tensor-parallel-size",
            "2",
            "--gpu-memory-utilization",
            "0.45",
            "--max-loras",
            "2",
            "--max-model-len",
            "8192",
            "--dtype",
            "bfloat16",
        ],
        "command": ("vllm", "serve"),
        "env": {"CUDA_VISIBLE_DEVICES": "1,2"},
        "startup_timeout_s": 900.0,
    }


@pytest.fixture
def fake(tiny_policy):
    server = FakeVLLM(
        tiny_policy[1], served_model_name="agl-policy", allow_runtime_lora=True, max_lora_rank=8
    )
    with BackgroundServer(server.app()) as running:
        server.url = running.url
        yield server


def test_vllm_publish_serves_each_new_adapter_and_spans_record_the_version(fake, tmp_path):
    import torch
    from safetensors.torch import load_file

    model, tokenizer = _lora_policy()
    config = _config(
        tmp_path, serving={"backend": "vllm", "vllm": {"url": fake.url + "/v1", "keep_adapters": 2}}
    )
    serving = start_serving(config, model, tokenizer)
    assert isinstance(serving, VLLMServing) and serving.renderer is not None
    try:
        with GatewayServer(serving.backend, renderer=serving.renderer) as gateway:
            client = httpx.Client(timeout=30)
            r0 = client.post(
                rollout_base_url(gateway.url, "ro-0") + "/chat/completions",
                json={"model": "agl-policy", "messages": HI},
            ).json()
            assert fake.requests[-1]["model"] == "agl-policy"  # version 0: the base model, no adapter yet
            (span0,) = gateway.spans(r0["id"])
            assert span0.attributes[semconv.POLICY_VERSION] == 0

            for version in (1, 2, 3):
                _step(model, seed=version)
                with serving.lock:
                    serving.publish(model, version)
                assert serving.policy_version == version
                saved = load_file(
                    str(tmp_path / "run" / "adapters" / f"v{version}" / "adapter_model.safetensors")
                )
                expected = _lora_state(model)
                assert saved.keys() == expected.keys()
                assert all(torch.equal(saved[k], expected[k]) for k in expected)

                rollout = f"ro-{version}"
                r = client.post(
                    rollout_base_url(gateway.url, rollout) + "/chat/completions",
                    json={"model": "agl-policy", "messages": HI},
                ).json()
                assert fake.requests[-1]["model"] == f"agl-policy-v{version}"
                assert r["choices"][0]["message"]["content"].startswith(
                    f"[agl-policy-v{version}] echo: hi there"
                )
                (span,) = gateway.spans(r["id"])
                assert span.attributes[semconv.POLICY_VERSION] == version
                assert span.attributes[semconv.GEN_AI_RESPONSE_MODEL] == f"agl-policy-v{version}"
                assert span.attributes[semconv.ROLLOUT_ID] == rollout
                assert span.attributes[semconv.PROMPT_DRIFT] is False
                assert fake.loras[f"agl-policy-v{version}"] == str(
                    tmp_path / "run" / "adapters" / f"v{version}"
                )
            client.close()
        # the backend keeps the previous adapter loaded for calls in flight; the disk keeps the newest two
        assert sorted(fake.loras) == ["agl-policy-v2", "agl-policy-v3"]
        assert sorted(p.name for p in (tmp_path / "run" / "adapters").iterdir()) == ["v2", "v3"]

        with pytest.raises(ValueError, match="not newer"):
            serving.publish(model, 3)
        from agl_trainer.model import load_policy

        plain = load_policy("tiny")[0]
        with pytest.raises(ValueError, match="LoRA adapters, and this model has none"):
            serving.publish(plain, 4)
        assert serving.policy_version == 3
    finally:
        serving.close()


def test_vllm_refuses_an_adapter_above_its_max_rank(fake, tmp_path):
    model, tokenizer = _lora_policy(r=16)  # the fake was started with --max-lora-rank 8
    serving = start_serving(
        _config(tmp_path, serving={"backend": "vllm", "vllm": {"url": fake.url + "/v1"}}), model, tokenizer
    )
    try:
        with pytest.raises(BackendError, match="LoRA rank 16 is greater than max_lora_rank 8"):
            serving.publish(model, 1)
        assert serving.policy_version == 0 and fake.loras == {}
    finally:
        serving.close()


def test_launched_vllm_gets_lora_sized_for_the_adapter(tmp_path):
    """``vllm serve`` started from the config (the fake stands in for the command): runtime LoRA loading
    works only if the launch passed ``--enable-lora``, the environment variable and a large enough rank."""
    model, tokenizer = _lora_policy(r=12)
    env = {
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(ROOT / "src"), str(ROOT / "trainer"), os.environ.get("PYTHONPATH", "")]
        )
    }
    config = _config(
        tmp_path,
        model={"source": "tiny", "lora": {"r": 12}},
        serving={
            "backend": "vllm",
            "vllm": {
                "launch": {
                    "model": str(tmp_path / "base"),
                    "command": [sys.executable, "-m", "tests.fake_vllm", "serve"],
                    "env": env,
                    "startup_timeout_s": 120,
                }
            },
        },
    )
    serving = start_serving(config, model, tokenizer)
    base_url = serving.backend.base_url
    try:
        models = httpx.get(base_url + "/models").json()["data"]
        assert [m["id"] for m in models] == ["agl-policy"] and models[0]["root"] == str(tmp_path / "base")
        _step(model, seed=1)
        serving.publish(model, 1)
        names = [m["id"] for m in httpx.get(base_url + "/models").json()["data"]]
        assert names == ["agl-policy", "agl-policy-v1"]
    finally:
        serving.close()
    with pytest.raises(httpx.HTTPError):
        httpx.get(base_url + "/models", timeout=2)


def test_hf_serving_swaps_in_place_and_loads_adapters(tmp_path):
    model, tokenizer = _lora_policy(seed=3)
    serving = start_serving(_config(tmp_path), model, tokenizer)
    assert (
        isinstance(serving, HFServing) and serving.lock is serving.backend.lock and serving.renderer is None
    )
    try:
        with GatewayServer(serving.backend) as gateway:
            ask = {"model": "agl-policy", "messages": HI, "max_tokens": 3, "temperature": 0}
            with serving.lock:
                _step(model, seed=1)
                serving.publish(model, 1)
            r1 = httpx.post(gateway.v1 + "/chat/completions", json=ask, timeout=60).json()
            (span,) = gateway.spans(r1["id"])
            assert span.attributes[semconv.POLICY_VERSION] == 1 and serving.backend.model is model

            saved = tmp_path / "adapter"
            other, _ = _lora_policy(seed=4)
            _step(other, seed=9)
            other.save_pretrained(str(saved))
            serving.publish_adapter(saved, 2)
            r2 = httpx.post(gateway.v1 + "/chat/completions", json=ask, timeout=60).json()
            (span2,) = gateway.spans(r2["id"])
            assert span2.attributes[semconv.POLICY_VERSION] == 2
            with pytest.raises(ValueError, match="not newer"):
                serving.publish(model, 2)
    finally:
        serving.close()


# -- a policy per agent: vLLM's multi-LoRA ---------------------------------------------------------------

TWO_POLICIES = [{"name": "writer", "agents": ["writer"]}, {"name": "rewriter", "agents": ["re*"]}]


def _two_adapter_policy():
    from peft import LoraConfig, get_peft_model

    from agl_trainer.model import load_policy

    model, tokenizer = load_policy("tiny", seed=0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(model, lora, adapter_name="writer")
    model.add_adapter("rewriter", lora)
    return model, tokenizer


def _move(model, adapter: str, seed: int) -> None:
    """An optimizer step on one adapter's weights only."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if f".{adapter}." in name and "lora_" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)


def test_vllm_serves_each_agent_its_policys_adapter_and_replaces_only_the_one_updated(fake, tmp_path):
    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    model, tokenizer = _two_adapter_policy()
    config = _config(
        tmp_path,
        model={"source": "tiny", "lora": {"r": 4, "alpha": 8}},
        policies=TWO_POLICIES,
        serving={"backend": "vllm", "vllm": {"url": fake.url + "/v1", "keep_adapters": 2}},
    )
    assert vllm_launch_kwargs(config)["extra_args"][4:6] == ["--max-loras", "4"]  # 2 per policy
    serving = start_serving(config, model, tokenizer)
    adapters = tmp_path / "run" / "adapters"
    try:
        with GatewayServer(serving.backend, renderer=serving.renderer) as gateway:
            client = httpx.Client(timeout=30)

            def ask(agent: str) -> tuple[str, str, int]:
                """(the model vLLM was asked for, the span's policy, the span's version) of a call."""
                r = client.post(
                    gateway.v1 + "/chat/completions",
                    json={"model": "agl-policy", "messages": HI},
                    headers={semconv.HEADER_AGENT_NAME: agent},
                )
                assert r.status_code == 200, r.text
                (span,) = gateway.spans(r.json()["id"])
                attrs = span.attributes
                return fake.requests[-1]["model"], attrs[semconv.POLICY_NAME], attrs[semconv.POLICY_VERSION]

            # before any update each policy is its fresh adapter, the base model's weights
            assert ask("writer") == ("agl-policy", "writer", 0)
            assert ask("planner") == ("agl-policy", "base", 0)

            _move(model, "writer", seed=1)
            serving.publish(model, 1, policies=["writer"])
            assert ask("writer") == ("agl-policy-writer-v1", "writer", 1)
            assert ask("rewriter") == ("agl-policy", "rewriter", 1)  # not published yet: still the base
            saved = load_file(str(adapters / "v1" / "writer" / "adapter_model.safetensors"))
            expected = get_peft_model_state_dict(model, adapter_name="writer")
            assert saved.keys() == expected.keys()
            assert all(torch.equal(saved[k], expected[k]) for k in expected)
            assert not (adapters / "v1" / "rewriter").exists()  # only the updated adapter is written

            _move(model, "rewriter", seed=2)
            serving.publish(model, 2, policies=["rewriter"])
            assert ask("rewriter") == ("agl-policy-rewriter-v2", "rewriter", 2)
            assert ask("writer") == ("agl-policy-writer-v1", "writer", 2)  # writer's adapter unchanged

            for version in (3, 4):
                _move(model, "writer", seed=version)
                serving.publish(model, version, policies=["writer"])
            assert ask("writer") == ("agl-policy-writer-v4", "writer", 4)
            assert ask("rewriter") == ("agl-policy-rewriter-v2", "rewriter", 4)
            serving.publish(model, 5, policies=[])  # a step that trained no policy: a new version only
            assert ask("writer") == ("agl-policy-writer-v4", "writer", 5)
            client.close()
        # each policy keeps its serving adapter and the one before; writer's v1 is gone, rewriter's v2
        # stays loaded and on disk (vLLM may read it again) though it is older than the newest two
        assert sorted(fake.loras) == [f"agl-policy-{n}" for n in ("rewriter-v2", "writer-v3", "writer-v4")]
        assert sorted(p.name for p in adapters.iterdir()) == ["v2", "v3", "v4"]
    finally:
        serving.close()


def test_vllm_refuses_a_call_by_an_agent_two_policies_match(fake, tmp_path):
    from agl_core.gateway.vllm_backend import VLLMBackend
    from agl_core.policies import PolicyRouter

    backend = VLLMBackend(fake.url + "/v1", model_name="agl-policy")
    backend.route = PolicyRouter({"writer": ["w*"], "rewriter": ["*er"]}).policy_for
    try:
        with GatewayServer(backend) as gateway:
            body = {"model": "agl-policy", "messages": HI}
            refused = httpx.post(
                gateway.v1 + "/chat/completions", json=body, headers={semconv.HEADER_AGENT_NAME: "writer"}
            )
            served = httpx.post(
                gateway.v1 + "/chat/completions", json=body, headers={semconv.HEADER_AGENT_NAME: "rewrite"}
            )
    finally:
        backend.close()
    assert refused.status_code == 400
    assert "'writer' is matched by policies 'writer' and 'rewriter'" in refused.json()["error"]["message"]
    assert served.status_code == 200
