"""A policy per agent: the router, the config's checks, the hf backend serving several LoRA adapters of one
base model in one batch, and training through the real pipeline (store, gateway, runner, update) where each
agent's calls are served by and trained into its own adapter."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from agl_core import semconv
from agl_core.gateway.backend import ChatRequest, Completion
from agl_core.policies import AmbiguousAgentError, PolicyRouter
from agl_trainer import Trainer
from agl_trainer.config import ConfigError
from agl_trainer.run.loop import NothingTrainedError

from ._training import TINY_JOB, Turns, metrics_rows, served_by

# -- the router -------------------------------------------------------------------------------------------


def test_the_router_names_one_policy_per_agent_and_the_default_for_the_rest():
    router = PolicyRouter({"writer": ["writer"], "fixers": ["fix_*", "rewriter"]}, default=None)
    assert router.policy_for("writer") == "writer"
    assert router.policy_for("fix_sql") == "fixers" and router.policy_for("rewriter") == "fixers"
    assert router.policy_for("planner") is None and router.policy_for(None) is None
    with_default = PolicyRouter({"writer": ["writer"], "rest": ["x"]}, default="rest")
    assert with_default.policy_for("planner") == "rest" and with_default.policy_for(None) == "rest"


def test_an_agent_two_policies_match_is_an_error_naming_both():
    router = PolicyRouter({"a": ["w*"], "b": ["*er"]})
    router.check()  # two globs: no agent name is known to fall in both
    with pytest.raises(AmbiguousAgentError, match="'writer' is matched by policies 'a' and 'b'"):
        router.policy_for("writer")
    with pytest.raises(AmbiguousAgentError, match=r"agent 'writer' is matched by policy 'a' \('writer'\)"):
        PolicyRouter({"a": ["writer"], "b": ["w*"]}).check()


@pytest.mark.parametrize(
    ("policies", "default", "message"),
    [
        ({"base": ["x"]}, None, "reserved for the base model"),
        ({"bad name": ["x"]}, None, "use 1 to 64 letters"),
        ({"a": []}, None, "give the agents it serves"),
        ({"a": ["x"]}, "b", "the default policy 'b' is not one of the policies"),
    ],
)
def test_bad_policies_are_refused(policies, default, message):
    with pytest.raises(ValueError, match=message):
        PolicyRouter(policies, default)


# -- the config -------------------------------------------------------------------------------------------

BASE_CONFIG: dict[str, Any] = TINY_JOB
TWO = [{"name": "writer", "agents": ["writer"]}, {"name": "rewriter", "agents": ["rewriter"]}]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"policies": [TWO[0], TWO[0]]}, "the name 'writer' is given twice"),
        (
            {"policies": [TWO[0], {"name": "all", "agents": ["*"]}]},
            "agent 'writer' is matched by policy 'writer' ('writer') and by policy 'all' ('*')",
        ),
        ({"policies": TWO, "default_policy": "nobody"}, "default_policy 'nobody' is not one of the policies"),
        ({"default_policy": "writer"}, "default_policy applies with policies:"),
        ({"policies": TWO, "algorithm": {"agents": ["writer"]}}, "remove algorithm.agents"),
        (
            {"policies": TWO, "update": {"backend": "verl"}, "serving": {"backend": "vllm"}},
            "verl's actor trains one adapter: set update.backend: torch",
        ),
        ({"policies": TWO, "model": {"source": "tiny", "lora": None}}, "set model.lora"),
        ({"policies": [{"name": "writer", "agents": []}]}, "policies.0 ('writer').agents"),
    ],
)
def test_the_config_refuses_policies_that_cannot_work(tmp_path, extra, message):
    with pytest.raises(ConfigError) as refused:
        Trainer({**BASE_CONFIG, "output_dir": str(tmp_path), **extra})
    assert message in str(refused.value)


# -- the hf backend: several adapters, one batch ------------------------------------------------------------


def test_a_bad_policy_entry_is_named_by_its_name_not_only_its_position(tmp_path):
    with pytest.raises(ConfigError) as caught:
        Trainer(
            {
                **BASE_CONFIG,
                "output_dir": str(tmp_path),
                "policies": [TWO[0], {"name": "fixer", "agents": []}],
            }
        )
    assert "'policies.1 ('fixer').agents'" in str(caught.value)


def _two_adapter_model() -> Any:
    from peft import LoraConfig, get_peft_model

    from agl_trainer.model import load_policy

    model, tokenizer = load_policy("tiny")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(model, lora, adapter_name="writer")
    model.add_adapter("rewriter", lora)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # LoRA's B starts at zero: give both adapters (different) effects
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model, tokenizer


def _generate(backend: Any, agents: list[str | None]) -> list[Completion]:
    async def one(agent: str | None) -> Completion:
        request = ChatRequest(
            messages=[{"role": "user", "content": "hello there"}], max_tokens=6, temperature=0.0, agent=agent
        )
        async for event in backend.generate("agl-policy", request):
            if isinstance(event, Completion):
                return event
        raise AssertionError("no completion")

    async def run() -> list[Completion]:
        return list(await asyncio.gather(*(one(a) for a in agents)))

    return asyncio.run(run())


def test_the_hf_backend_serves_each_agent_its_adapter_in_one_mixed_batch():
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = _two_adapter_model()
    router = PolicyRouter({"writer": ["writer"], "rewriter": ["rewriter"]})
    backend = HFBackend(model, tokenizer, route=router.policy_for, max_batch=8)
    try:
        alone = {a: _generate(backend, [a])[0] for a in ("writer", "rewriter", None)}
        mixed = _generate(backend, ["writer", "rewriter", None, "writer", "planner"])
    finally:
        backend.close()
    assert backend.peak_batch >= 2  # the mixed requests shared batches
    assert [c.policy_name for c in mixed] == ["writer", "rewriter", "base", "writer", "base"]
    for agent, completion in zip(["writer", "rewriter", None, "writer", None], mixed, strict=True):
        assert completion.response_ids == alone[agent].response_ids  # as if served alone
        assert completion.response_logprobs == pytest.approx(alone[agent].response_logprobs, abs=1e-4)
    # the three really are different models
    logprobs = {a: alone[a].response_logprobs for a in alone}
    assert logprobs["writer"] != pytest.approx(logprobs["rewriter"], abs=1e-3)
    assert logprobs["writer"] != pytest.approx(logprobs[None], abs=1e-3)


def test_a_call_by_an_agent_two_policies_match_gets_a_400_naming_both():
    import httpx

    from agl_core.testing import GatewayServer
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = _two_adapter_model()
    router = PolicyRouter({"writer": ["w*"], "rewriter": ["*er"]})
    backend = HFBackend(model, tokenizer, route=router.policy_for)
    try:
        with GatewayServer(backend) as gateway:
            body = {"model": "agl-policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            refused = httpx.post(
                f"{gateway.v1}/chat/completions", json=body, headers={semconv.HEADER_AGENT_NAME: "writer"}
            )
            served = httpx.post(
                f"{gateway.v1}/chat/completions", json=body, headers={semconv.HEADER_AGENT_NAME: "rewrite"}
            )
    finally:
        backend.close()
    assert refused.status_code == 400
    assert "'writer' is matched by policies 'writer' and 'rewriter'" in refused.json()["error"]["message"]
    assert served.status_code == 200  # only the ambiguous agent is refused


# -- training through the real pipeline ---------------------------------------------------------------------


TASKS = [{"id": f"t{i}", "q": f"say {i}"} for i in range(4)]


def _agent(calls: tuple[str, ...]) -> Any:
    turns = Turns()

    def solve(task: dict[str, Any], llm: Any) -> float:
        for name in calls:  # each agent of the system, framework-less, names itself by its base_url
            own = llm.for_agent(name)
            client = openai.OpenAI(base_url=own.base_url, api_key=own.api_key, max_retries=0)
            client.chat.completions.create(
                model=own.model, messages=[{"role": "user", "content": f"{name}: {task['q']}"}], max_tokens=3
            )
        return turns.reward(task)

    return solve


def _adapter_b(checkpoint: Path, policy: str) -> torch.Tensor:
    from safetensors.torch import load_file

    weights = load_file(str(checkpoint / "adapter" / policy / "adapter_model.safetensors"))
    return torch.cat([w.flatten() for name, w in sorted(weights.items()) if "lora_B" in name])


def test_each_agent_trains_its_own_adapter_and_an_idle_one_does_not_move(tmp_path):
    config = {
        **BASE_CONFIG,
        "output_dir": str(tmp_path / "run"),
        "policies": TWO,
        "logging": {"plot": True, "tensorboard": False},
    }
    lines: list[str] = []
    result = Trainer(config, echo=lines.append).fit(_agent(("writer", "planner")), TASKS[:2])

    (step,) = result.history
    assert step.policies is not None
    writer, rewriter, base = step.policies["writer"], step.policies["rewriter"], step.policies["base"]
    assert (writer["agents"], writer["calls"], writer["trained"], writer["updates"]) == (["writer"], 4, 4, 1)
    assert writer["loss"] is not None
    assert (rewriter["calls"], rewriter["trained"], rewriter["loss"], rewriter["updates"]) == (0, 0, None, 0)
    assert (base["agents"], base["calls"], base["trained"]) == (["planner"], 4, 0)
    # planner's calls, served by the base model, train nothing
    assert (step.transitions, step.trained_transitions) == (8, 4)
    assert any(line.startswith("  policies: writer [writer] 4/4 calls trained") for line in lines)
    assert any("base model served planner (4 calls, reward 0.500, not trained)" in line for line in lines)
    # rewriter's pattern matched no calling agent: said at the end of the run
    assert any(line.startswith("warning: policy 'rewriter' served no call in 1 step(s)") for line in lines)
    assert not any("policy 'writer' served no call" in line for line in lines)
    assert writer["reward"] == base["reward"] == 0.5  # episode credit: each call gets its episode's reward
    assert result.checkpoint is not None
    assert _adapter_b(result.checkpoint, "writer").abs().sum() > 0  # LoRA B starts at zero: it moved
    assert _adapter_b(result.checkpoint, "rewriter").abs().sum() == 0  # no calls: untouched
    assert result.plot is not None and result.plot.stat().st_size > 0  # with writer's and base's curves
    served = served_by(tmp_path / "run" / "store.sqlite")
    assert served == {("writer", "writer"): 4, ("planner", "base"): 4}
    assert [
        r["policies"]["writer"]["trained"] for r in metrics_rows(tmp_path / "run") if r["kind"] == "train"
    ] == [4]


def _trace_named_agent() -> Any:
    """An agent that names its role with an ``invoke_agent`` span and sends its trace context, but calls
    the gateway's plain URL: the span tree names the agent, the gateway serves the base model."""
    turns = Turns()

    def solve(task: dict[str, Any], llm: Any) -> float:
        from opentelemetry import propagate

        from agl_core import agent_span

        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
        with agent_span("writer"):
            headers: dict[str, str] = {}
            propagate.inject(headers)
            client.chat.completions.create(
                model=llm.model,
                messages=[{"role": "user", "content": f"writer: {task['q']}"}],
                max_tokens=3,
                extra_headers=headers,
            )
        return turns.reward(task)

    return solve


def test_calls_served_by_the_base_model_never_train_a_policy_and_the_run_says_why(tmp_path, caplog):
    """The trainer once picked the policy from the agent name in the span tree: calls the gateway served
    with the base model trained the writer's adapter, silently. Now the recorded serving policy decides."""
    import logging

    from agl_core.policies import policy_mismatch, trained_policy

    router = PolicyRouter({"writer": ["writer"]}, default=None)
    assert trained_policy(router, "writer", "base") is None
    assert trained_policy(router, "writer", "writer") == "writer"
    assert trained_policy(router, "writer", None) == "writer"  # nothing recorded: by the agent's name
    assert trained_policy(router, "writer", "gone") is None  # a policy this run does not have
    assert policy_mismatch(router, "writer", "writer") is None
    config = {**BASE_CONFIG, "output_dir": str(tmp_path / "run"), "policies": TWO}
    with caplog.at_level(logging.WARNING, logger="agl_trainer.run.step"), pytest.raises(NothingTrainedError):
        Trainer(config, echo=lambda _: None).fit(_trace_named_agent(), TASKS[:2])
    # the gateway saw no agent name (none in the URL or headers): it served the base model
    assert served_by(tmp_path / "run" / "store.sqlite") == {(None, "base"): 4}
    warnings = [r.getMessage() for r in caplog.records if "were served by 'base'" in r.getMessage()]
    assert len(warnings) == 1, caplog.text  # once per agent, not per call
    assert "policy 'writer'" in warnings[0] and "llm.for_agent" in warnings[0]
    rows = [r for r in metrics_rows(tmp_path / "run") if r["kind"] == "train"]
    assert [r["trained_transitions"] for r in rows] == [0]  # before: 4, into writer's adapter


def test_two_agents_train_two_adapters_and_resume_restores_both(tmp_path):
    config = {**BASE_CONFIG, "output_dir": str(tmp_path / "run"), "policies": TWO, "default_policy": "writer"}
    first = Trainer(config).fit(_agent(("writer", "rewriter", "planner")), TASKS[:2])
    (step,) = first.history
    assert step.policies is not None
    assert step.policies["writer"]["agents"] == ["writer", "planner"]  # the default serves planner
    assert step.policies["rewriter"]["trained"] == 4 and step.policies["writer"]["trained"] == 8
    assert first.checkpoint is not None
    writer_1, rewriter_1 = _adapter_b(first.checkpoint, "writer"), _adapter_b(first.checkpoint, "rewriter")
    assert writer_1.abs().sum() > 0 and rewriter_1.abs().sum() > 0
    assert not torch.equal(writer_1, rewriter_1)

    again = Trainer(config, overrides=["train.steps=2"]).fit(
        _agent(("writer", "rewriter", "planner")), TASKS[:2], resume=True
    )
    assert [s.step for s in again.history] == [2]
    (step_2,) = again.history
    assert step_2.policies is not None  # each policy's update count went on from the checkpoint's
    assert (step_2.policies["writer"]["updates"], step_2.policies["rewriter"]["updates"]) == (2, 2)
    assert again.checkpoint is not None
    writer_2, rewriter_2 = _adapter_b(again.checkpoint, "writer"), _adapter_b(again.checkpoint, "rewriter")
    assert not torch.equal(writer_2, writer_1) and not torch.equal(rewriter_2, rewriter_1)
    # step 2 went on from step 1's optimizer states: each policy's Adam has taken two steps
    saved = torch.load(again.checkpoint / "optimizer.pt", weights_only=True)
    assert sorted(saved) == ["rewriter", "writer"]
    for name in ("writer", "rewriter"):
        assert {float(s["step"]) for s in saved[name]["state"].values()} == {2.0}


def test_a_checkpoint_holds_every_adapter_and_loads_them_into_a_fresh_model(tmp_path):
    from agl_trainer.learning.checkpoint import load_checkpoint, save_checkpoint

    model, _ = _two_adapter_model()
    optimizers = {
        name: torch.optim.AdamW([p for n, p in model.named_parameters() if f".{name}." in n], lr=0.1)
        for name in ("writer", "rewriter")
    }
    path = save_checkpoint(tmp_path, 3, model=model, optimizer=optimizers, state={"policy_version": 3})
    assert (path / "adapter" / "writer" / "adapter_model.safetensors").is_file()
    assert (path / "adapter" / "rewriter" / "adapter_model.safetensors").is_file()
    fresh, _ = _two_adapter_model()
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            if "lora_" in name:
                p.zero_()
    fresh_optimizers = {
        name: torch.optim.AdamW([p for n, p in fresh.named_parameters() if f".{name}." in n], lr=0.1)
        for name in ("writer", "rewriter")
    }
    assert load_checkpoint(path, model=fresh, optimizer=fresh_optimizers)["step"] == 3
    before = dict(model.named_parameters())
    for name, p in fresh.named_parameters():
        if "lora_" in name:
            assert torch.equal(p, before[name]), name


def test_a_checkpoint_of_a_shared_policy_does_not_resume_a_run_with_policies(tmp_path):
    shared = {**BASE_CONFIG, "output_dir": str(tmp_path / "run")}
    Trainer(shared).fit(_agent(("writer",)), TASKS[:2])
    with pytest.raises(Exception, match="one shared policy; resume it without policies"):
        Trainer({**shared, "policies": TWO}, overrides=["train.steps=2"]).fit(
            _agent(("writer",)), TASKS[:2], resume=True
        )


# -- agl eval on a checkpoint of a run with policies ------------------------------------------------------

EVAL_AGENT = """
import openai

SEEN = {}


def solve(task, llm):
    for name in ("writer", "planner"):
        own = llm.for_agent(name)
        client = openai.OpenAI(base_url=own.base_url, api_key=own.api_key, max_retries=0)
        client.chat.completions.create(
            model=own.model, messages=[{"role": "user", "content": name + ": " + task["q"]}], max_tokens=3
        )
    SEEN[task["id"]] = SEEN.get(task["id"], 0) + 1
    return float(SEEN[task["id"]] % 2)
"""


SERVED_BY = (semconv.GEN_AI_AGENT_NAME, semconv.POLICY_NAME, semconv.POLICY_VERSION)


def test_eval_serves_each_policys_adapter_from_a_checkpoint_and_refuses_a_config_without_them(tmp_path):
    import yaml

    from agl_trainer.config import load_config
    from agl_trainer.evaluate import EvalError, evaluate

    (tmp_path / "policy_agent.py").write_text(EVAL_AGENT)
    for name, ids in (("train", "t"), ("val", "v")):
        rows = [f'{{"id": "{ids}{i}", "q": "say {i}"}}\n' for i in range(2)]
        (tmp_path / f"{name}.jsonl").write_text("".join(rows))
    config_file = tmp_path / "config.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                **BASE_CONFIG,
                "agent": "policy_agent:solve",
                "tasks": {"train": "train.jsonl", "val": "val.jsonl"},
                "output_dir": str(tmp_path / "run"),
                "validation": {"before": False, "after": False},
                "policies": TWO,
            }
        )
    )
    config = load_config(config_file)
    trained = Trainer(config).fit()
    assert trained.checkpoint is not None

    found = evaluate(config, checkpoint=trained.checkpoint, baseline=True, keep_spans=True, limit=2)
    for score, version in ((found.baseline, 0), (found.score, 1)):
        assert score is not None
        served = Counter(
            tuple(s.attributes[k] for k in SERVED_BY)
            for spans in score.spans.values()
            for s in spans
            if semconv.POLICY_NAME in s.attributes
        )
        assert served == {("writer", "writer", version): 2, ("planner", "base", version): 2}

    shared = load_config(config_file, ["policies=[]"])
    with pytest.raises(EvalError, match=r"one adapter per policy \(rewriter, writer\); evaluate it with"):
        evaluate(shared, checkpoint=trained.checkpoint, limit=1)
    renamed = load_config(config_file, ['policies=[{"name": "editor", "agents": ["writer"]}]'])
    with pytest.raises(EvalError, match="holds no adapter of policy 'editor'"):
        evaluate(renamed, checkpoint=trained.checkpoint, limit=1)


def test_a_step_that_trains_nothing_still_reports_each_policys_update_count(tmp_path):
    turns = Turns()

    def solve(task: dict[str, Any], llm: Any) -> float:
        own = llm.for_agent("writer")
        client = openai.OpenAI(base_url=own.base_url, api_key=own.api_key, max_retries=0)
        client.chat.completions.create(
            model=own.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=3
        )
        return turns.reward(task) if llm.policy_version == 0 else 1.0  # step 2: every group ties

    config = {**BASE_CONFIG, "output_dir": str(tmp_path / "run"), "policies": TWO, "train": {"steps": 2}}
    lines: list[str] = []
    result = Trainer(config, echo=lines.append).fit(solve, TASKS[:2])
    first, second = (m.policies for m in result.history)
    assert first is not None and second is not None
    assert (first["writer"]["updates"], second["writer"]["updates"]) == (1, 1)
    assert second["writer"]["loss"] is None and second["rewriter"]["updates"] == 0
