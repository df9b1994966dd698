"""The verl backend on CPU: the batch conversion (exact tensors), config merging, the missing-verl error.

With verl installed (``pip install 'agl[verl]'``; verl 0.9 imports and runs its data and loss code on a CPU),
the conversion is also fed to verl's own ``DataProto``, padding conversion and PPO loss, which must give
agl's loss. The Ray worker group itself (``VerlUpdater``) needs GPUs and is not run here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agl_core.records import Transition
from agl_trainer.config import ConfigError, TrainerConfig, load_config
from agl_trainer.learning.algo import Advantaged, compute_advantages
from agl_trainer.learning.verl_backend import merge_verl_config, pad_batch, to_verl_batch, verl_overrides
from agl_trainer.requirements import check_requirements

torch = pytest.importorskip("torch")
HAS_VERL = importlib.util.find_spec("verl") is not None
needs_verl = pytest.mark.skipif(not HAS_VERL, reason="verl is not installed (pip install 'agl[verl]')")


def _t(rollout: str, call: int, prompt, response, logprobs, reward: float) -> Transition:
    return Transition(
        rollout_id=rollout,
        attempt_id=f"{rollout}-a",
        task_id="task",
        call_index=call,
        agent_name="agent",
        prompt_ids=tuple(prompt),
        response_ids=tuple(response),
        response_logprobs=None if logprobs is None else tuple(logprobs),
        reward=reward,
    )


def _toy() -> list[Advantaged]:
    """Rollout r1 makes two calls (the second's prompt holds the first exchange), r2 one."""
    return [
        Advantaged(_t("r1", 0, [11, 12, 13], [21, 22], [-0.1, -0.2], 1.0), 0.5),
        Advantaged(_t("r1", 1, [11, 12, 13, 21, 22, 14], [23], [-0.3], 1.0), 0.5),
        Advantaged(_t("r2", 0, [15], [24, 25, 26], [-0.4, -0.5, -0.6], 0.0), -0.5),
    ]


def _config(**extra) -> TrainerConfig:
    base = {
        "agent": "a:run",
        "tasks": "tasks.jsonl",
        "model": {"source": "Qwen/Qwen2.5-1.5B-Instruct", "lora": {"r": 16, "alpha": 32}},
        "serving": {"backend": "vllm"},
        "update": {"backend": "verl"},
    }
    return TrainerConfig.model_validate({**base, **extra})


def test_conversion_gives_verls_layout_exactly():
    batch = to_verl_batch(_toy(), pad_id=0, group_of={"r1": "task-7", "r2": "task-7"})
    t = batch.tensors
    assert t["prompts"].tolist() == [[0, 0, 0, 11, 12, 13], [11, 12, 13, 21, 22, 14], [0, 0, 0, 0, 0, 15]]
    assert t["responses"].tolist() == [[21, 22, 0], [23, 0, 0], [24, 25, 26]]
    assert t["input_ids"].tolist() == [
        [0, 0, 0, 11, 12, 13, 21, 22, 0],
        [11, 12, 13, 21, 22, 14, 23, 0, 0],
        [0, 0, 0, 0, 0, 15, 24, 25, 26],
    ]
    assert t["attention_mask"].tolist() == [
        [0, 0, 0, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 1, 1, 1],
    ]
    assert t["position_ids"].tolist() == [
        [0, 0, 0, 0, 1, 2, 3, 4, 4],
        [0, 1, 2, 3, 4, 5, 6, 6, 6],
        [0, 0, 0, 0, 0, 0, 1, 2, 3],
    ]
    assert t["response_mask"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    # per-rollout weights N / (rollouts * calls): r1's calls 3 / (2 * 2), r2's call 3 / (2 * 1)
    assert t["advantages"].tolist() == [[0.375, 0.375, 0.0], [0.375, 0.0, 0.0], [-0.75, -0.75, -0.75]]
    assert t["token_level_rewards"].tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert torch.equal(
        t["old_log_probs"], torch.tensor([[-0.1, -0.2, 0.0], [-0.3, 0.0, 0.0], [-0.4, -0.5, -0.6]])
    )
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert t[key].dtype == torch.long, key
    for key in ("advantages", "token_level_rewards", "old_log_probs"):
        assert t[key].dtype == torch.float32, key
    assert batch.non_tensors["uid"].tolist() == ["task-7"] * 3
    assert batch.non_tensors["rollout_id"].tolist() == ["r1", "r1", "r2"]
    assert batch.meta_info == {"temperature": 1.0} and len(batch) == 3


def test_conversion_options_and_refusals():
    plain = to_verl_batch(_toy(), pad_id=0, rollout_weights=False)
    assert plain.tensors["advantages"].tolist() == [[0.5, 0.5, 0.0], [0.5, 0.0, 0.0], [-0.5, -0.5, -0.5]]
    assert plain.non_tensors["uid"].tolist() == ["r1", "r1", "r2"]  # no groups given: each rollout its own
    fixed = to_verl_batch(_toy(), pad_id=7, prompt_length=8, response_length=4)
    assert fixed.tensors["input_ids"].shape == (3, 12) and fixed.tensors["responses"][1].tolist() == [
        23,
        7,
        7,
        7,
    ]
    assert fixed.tensors["prompts"][2].tolist() == [7] * 7 + [15]
    no_logprobs = _toy()[:2] + [Advantaged(_t("r2", 0, [15], [24], None, 0.0), -0.5)]
    assert "old_log_probs" not in to_verl_batch(no_logprobs, pad_id=0).tensors
    with pytest.raises(ValueError, match="more than prompt_length=5"):
        to_verl_batch(_toy(), pad_id=0, prompt_length=5)
    with pytest.raises(ValueError, match="no prompt or no response"):
        to_verl_batch([Advantaged(_t("r", 0, [1], [], [], 0.0), 1.0)], pad_id=0)
    with pytest.raises(ValueError, match="at least one sample"):
        to_verl_batch([], pad_id=0)


def test_padding_rows_are_silent_copies():
    batch = to_verl_batch(_toy(), pad_id=0)
    assert pad_batch(batch, 3) is batch
    padded = pad_batch(batch, 4)
    assert len(padded) == 4
    assert padded.tensors["input_ids"][3].tolist() == batch.tensors["input_ids"][0].tolist()
    assert padded.tensors["attention_mask"][3].tolist() == batch.tensors["attention_mask"][0].tolist()
    for key in ("response_mask", "advantages", "token_level_rewards"):
        assert padded.tensors[key][3].abs().sum() == 0, key
        assert torch.equal(padded.tensors[key][:3], batch.tensors[key])
    assert padded.non_tensors["rollout_id"].tolist() == ["r1", "r1", "r2", "r1"]
    assert len(pad_batch(batch, 8)) == 8


def test_layout_gives_the_same_logprobs_as_agls_own_forward_pass(tiny_policy):
    """Left-padded prompts with verl's position ids: the logits at ``[-R-1:-1]`` must score the responses
    exactly as agl's right-padded forward pass does."""
    from agl_trainer.learning.update import response_logprobs

    model = tiny_policy[0]
    samples = _toy()
    batch = to_verl_batch(samples, pad_id=0)
    t = batch.tensors
    width_r = t["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"]
        ).logits
        logp = (
            torch.log_softmax(logits[:, -width_r - 1 : -1].float(), dim=-1)
            .gather(-1, t["responses"][..., None])
            .squeeze(-1)
        )
        agl = response_logprobs(model, samples, pad_id=0)
    for i, expected in enumerate(agl):
        n = len(expected)
        assert torch.allclose(logp[i, :n], expected, atol=1e-5), i


def test_verl_overrides_layer_agls_choices_the_section_and_agls_settings():
    config = _config(
        algorithm={"clip_eps": 0.3, "learning_rate": 5e-6, "kl_coef": 0.01, "micro_batch_tokens": 8192},
        verl={
            "trainer": {"n_gpus_per_node": 4},
            "actor_rollout_ref": {
                "actor": {
                    "loss_agg_mode": "token-mean",
                    "ppo_micro_batch_size_per_gpu": 2,
                    "checkpoint": {"+save_lora_only": False},
                }
            },
        },
    )
    o = verl_overrides(config)
    actor = o["actor_rollout_ref"]["actor"]
    assert o["actor_rollout_ref"]["model"] == {
        "path": "Qwen/Qwen2.5-1.5B-Instruct",
        "lora_rank": 16,
        "lora_alpha": 32,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    }
    assert actor["loss_agg_mode"] == "token-mean"  # the user's choice wins over agl's default
    assert actor["ppo_micro_batch_size_per_gpu"] == 2 and actor["checkpoint"] == {
        "save_contents": ["model"],
        "+save_lora_only": False,
    }
    assert (actor["clip_ratio"], actor["clip_ratio_low"], actor["clip_ratio_high"]) == (0.3, 0.3, 0.3)
    assert actor["optim"] == {"lr": 5e-6, "clip_grad": 1.0} and actor["grad_clip"] == 1.0
    assert (actor["use_kl_loss"], actor["kl_loss_coef"], actor["ppo_max_token_len_per_gpu"]) == (
        True,
        0.01,
        8192,
    )
    assert o["trainer"] == {"nnodes": 1, "n_gpus_per_node": 4, "device": "cuda"}
    with pytest.raises(ValueError, match="integer LoRA alpha"):
        verl_overrides(_config(model={"source": "org/m", "lora": {"alpha": 12.5}}))


def test_merge_onto_defaults_names_unknown_keys():
    defaults = {
        "actor_rollout_ref": {
            "actor": {"ppo_mini_batch_size": 256, "checkpoint": {"save_contents": ["model", "optimizer"]}},
            "model": {"override_config": {}, "target_modules": "all-linear"},
        },
        "ray_kwargs": {"ray_init": {"num_cpus": None}},
    }
    merged = merge_verl_config(
        defaults,
        {
            "actor_rollout_ref": {
                "actor": {
                    "ppo_mini_batch_size": 8,
                    "checkpoint": {"save_contents": ["model"], "+save_lora_only": True},
                },
                "model": {"override_config": {"attn_implementation": "sdpa"}, "target_modules": ["q_proj"]},
            },
        },
        source="verl 9.9",
    )
    assert merged == {
        "actor_rollout_ref": {
            "actor": {
                "ppo_mini_batch_size": 8,
                "checkpoint": {"save_contents": ["model"], "save_lora_only": True},
            },
            "model": {"override_config": {"attn_implementation": "sdpa"}, "target_modules": ["q_proj"]},
        },
        "ray_kwargs": {"ray_init": {"num_cpus": None}},
    }
    assert defaults["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] == 256  # not changed in place
    with pytest.raises(
        ValueError,
        match=r"verl.actor_rollout_ref.actor.ppo_mini_bath_size is not a key of verl 9.9's config "
        r"\(did you mean 'ppo_mini_batch_size'\? .*'\+ppo_mini_bath_size'",
    ):
        merge_verl_config(
            defaults, {"actor_rollout_ref": {"actor": {"ppo_mini_bath_size": 8}}}, source="verl 9.9"
        )


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "tasks.jsonl").write_text('{"id": "t1"}\n')
    return tmp_path


VERL_YAML = """
agent: agent:run
tasks: tasks.jsonl
model: {source: Qwen/Qwen2.5-1.5B-Instruct}
serving: {backend: vllm}
update: {backend: verl}
"""


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            "verl: {actor_rollout_ref: {model: {path: /other}}}",
            "verl.actor_rollout_ref.model.path is set by agl from 'model.source'; set that instead",
        ),
        (
            "verl: {actor_rollout_ref: {actor: {optim: {lr: 0.1}}}}",
            "verl.actor_rollout_ref.actor.optim.lr is set by agl from 'algorithm.learning_rate'",
        ),
        (
            "verl: {data: {train_batch_size: 8}}",
            "verl.data is not used by agl (tasks come from 'tasks' and 'train')",
        ),
        ("verl: {trainr: {}}", "verl.trainr: agl passes on only these sections"),
        ("verl: [1, 2]", "'verl': Input should be a valid dictionary"),
        ("update: {backend: verl, bf16: true}", "update.bf16 applies only to update.backend torch"),
    ],
)
def test_bad_verl_sections_are_named(folder, extra, message):
    path = folder / "cfg.yaml"
    path.write_text(
        VERL_YAML.replace("update: {backend: verl}\n", "")
        + extra
        + ("\n" if "update:" in extra else "\nupdate: {backend: verl}\n")
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_missing_verl_fails_with_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "verl" else real(name, *a)
    )
    with pytest.raises(
        ValueError, match=r"update.backend verl needs verl, which is not installed: pip install 'agl\[verl\]'"
    ):
        check_requirements(_config())


@pytest.mark.skipif(HAS_VERL, reason="verl is installed here: the CLI would go on to train")
def test_cli_refuses_verl_without_verl_before_starting_anything(folder):
    path = folder / "cfg.yaml"
    path.write_text(VERL_YAML + f"output_dir: {folder / 'out'}\n")
    done = subprocess.run(
        [sys.executable, "-m", "agl_core.cli", "train", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "needs verl, which is not installed: pip install 'agl[verl]'" in done.stderr
    assert not (folder / "out").exists()


@pytest.mark.skipif(shutil.which("vllm") is not None, reason="vllm is installed here")
def test_launching_vllm_without_vllm_fails_with_the_install_command():
    config = _config(update={"backend": "torch"})
    with pytest.raises(ValueError, match=r"no 'vllm' command on PATH: pip install 'agl\[gpu\]'"):
        check_requirements(config)
    check_requirements(
        _config(
            update={"backend": "torch"}, serving={"backend": "vllm", "vllm": {"url": "http://gpu:8000/v1"}}
        )
    )


# -- against verl itself ---------------------------------------------------------------------------------


def _lora_samples(model, *, seed: int) -> list[Advantaged]:
    """Samples from two groups of rollouts, some with two calls, behaviour logprobs off the current policy
    (so ratios differ from 1 and some clip)."""
    from agl_trainer.learning.update import response_logprobs

    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(5, 120, (n,), generator=g).tolist()

    transitions = []
    for _task, rollouts in (("t1", ("a", "b", "c")), ("t2", ("d", "e"))):
        for k, rollout in enumerate(rollouts):
            for call in range(1 + (k % 2)):
                prompt, response = ids(3 + 2 * call + k), ids(2 + (k + call) % 3)
                transitions.append(
                    _t(rollout, call, prompt, response, [0.0] * len(response), float(k == 1) + 0.25 * call)
                )
    group_of = {t.rollout_id: ("t1" if t.rollout_id in "abc" else "t2") for t in transitions}
    with torch.no_grad():
        current = response_logprobs(model, [Advantaged(t, 0.0) for t in transitions], pad_id=0)
    noisy = []
    for t, lp in zip(transitions, current, strict=True):
        behaviour = lp + 0.3 * torch.randn(lp.shape, generator=g)
        noisy.append(dataclasses.replace(t, response_logprobs=tuple(float(x) for x in behaviour)))
    samples, _ = compute_advantages(noisy, group_of, "grpo")
    return samples, group_of


@needs_verl
def test_verl_dataproto_and_padding_conversion_take_the_batch():
    from verl import DataProto
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    batch = to_verl_batch(_toy(), pad_id=0)
    proto = batch.to_dataproto()
    assert isinstance(proto, DataProto) and len(proto) == 3
    assert torch.equal(proto.batch["input_ids"], batch.tensors["input_ids"])
    assert proto.non_tensor_batch["rollout_id"].tolist() == ["r1", "r1", "r2"]
    td = left_right_2_no_padding(proto.to_tensordict())
    # verl's unpadded sequences are prompt + response, without padding, in order
    assert [row.tolist() for row in td["input_ids"].unbind()] == [
        [11, 12, 13, 21, 22],
        [11, 12, 13, 21, 22, 14, 23],
        [15, 24, 25, 26],
    ]
    assert [row.tolist() for row in td["position_ids"].unbind()] == [
        [0, 1, 2, 3, 4],
        [0, 1, 2, 3, 4, 5, 6],
        [0, 1, 2, 3],
    ]
    # a per-token value stored where verl's model output puts the logprob of the next token comes back as
    # (B, R)
    values = torch.cat(
        [
            torch.arange(len(row), dtype=torch.float32) * 10 + i
            for i, row in enumerate(td["input_ids"].unbind())
        ]
    )
    back = no_padding_2_padding(values, td)
    assert back.tolist() == [[20.0, 30.0, 0.0], [51.0, 0.0, 0.0], [2.0, 12.0, 22.0]]


@needs_verl
def test_verls_ppo_loss_on_the_batch_equals_agls_loss(tiny_policy):
    from peft import LoraConfig, get_peft_model
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    from agl_trainer.learning.update import batch_loss, response_logprobs
    from agl_trainer.learning.verl_backend import verl_config
    from agl_trainer.model import tiny_model

    model = get_peft_model(
        tiny_model(128, seed=5),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    samples, group_of = _lora_samples(model, seed=1)
    agl_loss, info = batch_loss(model, samples, clip_eps=0.2, pad_id=0)
    assert info["clip_fraction"] > 0  # the check covers clipped tokens too

    actor = omega_conf_to_dataclass(verl_config(_config()).actor_rollout_ref.actor)
    assert (
        actor.loss_agg_mode == "seq-mean-token-mean" and actor.clip_ratio_low == actor.clip_ratio_high == 0.2
    )
    batch = pad_batch(to_verl_batch(samples, pad_id=0, group_of=group_of), 4)
    td = left_right_2_no_padding(batch.to_dataproto().to_tensordict())
    tu.assign_non_tensor(
        td,
        dp_size=1,
        batch_num_tokens=int(batch.tensors["response_mask"].sum()),
        global_batch_size=len(samples),
    )
    # verl's model output: for every real token, the logprob of the token after it
    with torch.no_grad():
        current = response_logprobs(model, samples, pad_id=0)
    per_token = []
    for i, row in enumerate(td["input_ids"].unbind()):
        values = torch.zeros(len(row))
        if i < len(samples):
            n_p = len(samples[i].transition.prompt_ids)
            values[n_p - 1 : n_p - 1 + len(current[i])] = current[i]
        per_token.append(values)
    nested = torch.nested.as_nested_tensor(per_token, layout=torch.jagged)
    verl_loss, _ = ppo_loss(actor, {"log_probs": nested}, td)
    assert float(verl_loss) == pytest.approx(agl_loss, rel=1e-5, abs=1e-7)


@needs_verl
def test_verls_group_baseline_matches_agls_on_the_batch():
    """verl's GRPO estimator without std scaling, on the batch's rewards and uids, gives agl's ``ppo``
    advantages (one call per rollout, so per-rollout and per-sequence grouping agree)."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    transitions = [
        _t(r, 0, [1, 2], [3, 4, 5][: 1 + i % 3], None, reward)
        for i, (r, reward) in enumerate([("a", 1.0), ("b", 0.0), ("c", 0.5), ("d", 2.0), ("e", 1.0)])
    ]
    group_of = {"a": "g1", "b": "g1", "c": "g1", "d": "g2", "e": "g2"}
    samples, _ = compute_advantages(transitions, group_of, "ppo")
    batch = to_verl_batch(samples, pad_id=0, group_of=group_of, rollout_weights=False)
    verl_adv, _ = compute_grpo_outcome_advantage(
        batch.tensors["token_level_rewards"],
        batch.tensors["response_mask"],
        batch.non_tensors["uid"],
        norm_adv_by_std_in_grpo=False,
    )
    assert torch.allclose(verl_adv, batch.tensors["advantages"], atol=1e-6)


@needs_verl
def test_verl_config_builds_verls_own_config_objects(tmp_path):
    from verl.utils.config import omega_conf_to_dataclass

    from agl_trainer.learning.verl_backend import verl_config

    config = _config(
        verl={
            "actor_rollout_ref": {"actor": {"ppo_micro_batch_size_per_gpu": 2}},
            "trainer": {"n_gpus_per_node": 8},
        }
    )
    merged = verl_config(config)
    actor = omega_conf_to_dataclass(merged.actor_rollout_ref.actor)
    assert (actor.ppo_epochs, actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu) == (1, True, 4096)
    assert actor.optim.lr == 1e-4 and actor.checkpoint.save_contents == ["model"]
    assert (
        merged.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz is True
    )  # follows the actor's, as verl asserts
    assert (
        merged.actor_rollout_ref.rollout.n_gpus_per_node == 8
        and merged.actor_rollout_ref.model.lora_rank == 16
    )
    with pytest.raises(ValueError, match="did you mean 'ppo_micro_batch_size_per_gpu'"):
        check_requirements(
            _config(verl={"actor_rollout_ref": {"actor": {"ppo_micro_batch_size_per_gpus": 2}}})
        )


class FakeActorGroup:
    """Stands in for verl's actor worker group (``RayWorkerGroup`` over ``ActorRolloutRefWorker``), which
    needs GPUs: the same calls and the same TensorDicts in and out. ``compute_log_prob`` scores each
    unpadded sequence with a real model (the logprob of the next token at every position, as verl's
    engine returns it), without the LoRA adapter when ``no_lora_adapter`` is set."""

    world_size = 4

    def __init__(self, model):
        self.model = model
        self.calls = []

    def compute_log_prob(self, td):
        import contextlib

        from verl.utils import tensordict_utils as tu

        reference = bool(tu.get(td, "no_lora_adapter", default=False))
        self.calls.append(("compute_log_prob", reference))
        rows = []
        with torch.no_grad(), self.model.disable_adapter() if reference else contextlib.nullcontext():
            for ids in td["input_ids"].unbind():
                logits = self.model(input_ids=ids[None]).logits[0].float()
                lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None]).squeeze(-1)
                rows.append(torch.cat([lp, torch.zeros(1)]))
        return tu.get_tensordict(
            {"log_probs": torch.nested.as_nested_tensor(rows, layout=torch.jagged)}, {"metrics": {}}
        )

    def update_actor(self, td):
        from verl.utils import tensordict_utils as tu

        self.calls.append(("update_actor", td))
        metrics = {
            "actor/pg_loss": [0.25, 0.35],
            "grad_norm": [1.5],
            "actor/pg_clipfrac": [0.1],
            "actor/ppo_kl": [0.01],
            "kl_loss": [0.02],
        }
        return tu.get_tensordict({}, {"metrics": metrics})


@needs_verl
def test_updater_sends_verl_the_padded_batch_with_recomputed_and_reference_logprobs(tmp_path):
    from peft import LoraConfig, get_peft_model
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from agl_trainer.learning.update import response_logprobs
    from agl_trainer.learning.verl_backend import VerlUpdater
    from agl_trainer.model import tiny_model

    model = get_peft_model(
        tiny_model(128, seed=5),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    samples = [
        Advantaged(dataclasses.replace(s.transition, response_logprobs=None), s.advantage) for s in _toy()
    ]
    group = FakeActorGroup(model)
    updater = VerlUpdater(
        _config(algorithm={"kl_coef": 0.05}, output_dir=str(tmp_path)), pad_id=0, workers=group
    )
    stats = updater.update(samples, group_of={"r1": "g", "r2": "g"})

    assert [c[1] if c[0] == "compute_log_prob" else c[0] for c in group.calls] == [
        False,
        True,
        "update_actor",
    ]
    td = group.calls[-1][1]
    assert td.batch_size[0] == 4  # 3 sequences padded to the 4 data-parallel ranks
    meta = {
        k: tu.get(td, k)
        for k in (
            "global_batch_size",
            "mini_batch_size",
            "epochs",
            "compute_loss",
            "temperature",
            "calculate_entropy",
        )
    }
    assert meta == {
        "global_batch_size": 3,
        "mini_batch_size": 4,
        "epochs": 1,
        "compute_loss": True,
        "temperature": 1.0,
        "calculate_entropy": False,
    }
    assert td["response_mask"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]
    with torch.no_grad():
        current = response_logprobs(model, samples, pad_id=0)
        with model.disable_adapter():
            base = response_logprobs(model, samples, pad_id=0)
    for i in range(3):
        n = len(current[i])
        assert torch.allclose(td["old_log_probs"][i, :n], current[i], atol=1e-5)
        assert torch.allclose(td["ref_log_prob"][i, :n], base[i], atol=1e-5)
    assert not torch.allclose(td["old_log_probs"][2], td["ref_log_prob"][2])
    assert no_padding_2_padding(td["input_ids"].values().float(), td).shape == (4, 3)
    assert (
        stats.loss,
        stats.grad_norm,
        stats.clip_fraction,
        stats.approx_kl,
        stats.kl_to_reference,
    ) == pytest.approx((0.3, 1.5, 0.1, 0.01, 0.02))
    assert (stats.transitions, stats.rollouts, stats.tokens) == (3, 2, 6)


@needs_verl
def test_export_explains_a_failed_merge(tmp_path):
    from agl_trainer.learning.verl_backend import VerlUpdater

    class Group:
        def save_checkpoint(self, local_path, global_step, max_ckpt_to_keep):
            Path(local_path).mkdir(parents=True)  # an empty checkpoint: the merger has nothing to merge

    updater = VerlUpdater(_config(output_dir=str(tmp_path)), pad_id=0, workers=Group())
    with pytest.raises(RuntimeError, match="verl's model merger made no LoRA adapter from .*checkpoint"):
        updater.export_adapter(1)
