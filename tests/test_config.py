"""The trainer's YAML config: every mistake is named with its key and file before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agl_trainer.config import ConfigError, load_config

GOOD = """
agent: agent:solve
tasks: tasks.jsonl
train: {steps: 3}
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "tasks.jsonl").write_text('{"id": "t1", "question": "1+1", "answer": 2}\n')
    return tmp_path


def _write(folder: Path, text: str) -> Path:
    path = folder / "cfg.yaml"
    path.write_text(text)
    return path


def test_valid_config_resolves_paths_and_defaults(folder):
    config = load_config(_write(folder, GOOD))
    assert config.tasks.train == folder / "tasks.jsonl" and config.tasks.val is None
    assert config.base_dir == folder.resolve()
    assert config.train.steps == 3 and config.train.threads == 1 and config.algorithm.name == "grpo"


def test_runner_settings(folder):
    default = load_config(_write(folder, GOOD)).runner
    assert (default.workers, default.mode, default.rollout_timeout_s) == (2, "auto", None)
    config = load_config(
        _write(folder, GOOD + "runner: {workers: 0, mode: process, rollout_timeout_s: 90}\n")
    )
    assert (config.runner.workers, config.runner.mode, config.runner.rollout_timeout_s) == (
        0,
        "process",
        90.0,
    )


def test_overrides_are_typed_and_validated(folder):
    config = load_config(_write(folder, GOOD), ["train.steps=7", "algorithm.agents=[writer, rewriter]"])
    assert config.train.steps == 7 and config.algorithm.agents == ["writer", "rewriter"]
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(_write(folder, GOOD), ["train.steps=zero"])
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(_write(folder, GOOD), ["train.steps"])


@pytest.mark.parametrize(
    "text, message",
    [
        (GOOD + "trian: {steps: 1}\n", "unknown key 'trian' (did you mean 'train'?)"),
        (GOOD.replace("steps: 3", "stpes: 3"), "unknown key 'train.stpes' (did you mean 'train.steps'?)"),
        (GOOD + "model: {lora: {rank: 4}}\n", "unknown key 'model.lora.rank'"),
        (GOOD.replace("steps: 3", "steps: -1"), "'train.steps': Input should be greater than or equal to 1"),
        (GOOD.replace("agent: agent:solve", "agent: just_a_module"), "'agent'"),
        ("tasks: tasks.jsonl\n", "missing required key 'agent'"),
        (GOOD.replace("tasks.jsonl", "missing.jsonl"), "'tasks': file"),
        (GOOD + "model: {source: ./no-model-here}\n", "'model.source'"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("agent: [unclosed\n", "not valid YAML"),
        (
            GOOD + "algorithm: {rewards: {tool_errors: -1}}\n",
            "unknown key 'algorithm.rewards.tool_errors' (did you mean 'algorithm.rewards.tool_error'?)",
        ),
        (
            GOOD + "algorithm: {rewards: {timeout: .nan}}\n",
            "'algorithm.rewards.timeout': Input should be a finite number",
        ),
        (GOOD + "algorithm: {credit: rewards}\n", "'algorithm.credit'"),
        (
            GOOD + "algorithm: {credit: per_call, rewards: {explicit: false}}\n",
            "credit 'per_call' trains on intermediate rewards only",
        ),
        (
            GOOD + "runner: {mode: fork}\n",
            "'runner.mode': Input should be 'auto', 'thread', 'process' or 'async'",
        ),
        (
            GOOD + "runner: {rollout_timeout_s: 0}\n",
            "'runner.rollout_timeout_s': Input should be greater than 0",
        ),
        (GOOD + "runner: {workers: -1}\n", "'runner.workers': Input should be greater than or equal to 0"),
        (GOOD + "runner: {timeout: 5}\n", "unknown key 'runner.timeout'"),
    ],
)
def test_bad_configs_name_the_key_and_the_file(folder, text, message):
    path = _write(folder, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_cli_refuses_a_bad_config_before_starting_anything(folder):
    path = _write(folder, GOOD.replace("steps: 3", "stpes: 3") + "output_dir: " + str(folder / "out") + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "agl_core.cli", "train", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "unknown key 'train.stpes'" in done.stderr and str(path) in done.stderr
    assert not (folder / "out").exists()


def test_cli_rejects_bad_flags():
    done = subprocess.run(
        [sys.executable, "-m", "agl_core.cli", "store", "serve", "--http-port", "99999"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "outside 0-65535" in done.stderr


def test_print_config_shows_defaults(folder):
    done = subprocess.run(
        [sys.executable, "-m", "agl_core.cli", "train", str(_write(folder, GOOD)), "--print-config"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    printed = yaml.safe_load(done.stdout)  # YAML, as configs are written
    assert printed["algorithm"]["clip_eps"] == 0.2 and printed["train"]["steps"] == 3
    as_json = subprocess.run(
        [
            sys.executable,
            "-m",
            "agl_core.cli",
            "train",
            str(_write(folder, GOOD)),
            "--print-config",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert as_json.returncode == 0 and json.loads(as_json.stdout) == printed


def test_a_bad_set_override_is_blamed_on_set_not_on_the_file(folder):
    path = _write(folder, GOOD)
    with pytest.raises(ConfigError) as typo:
        load_config(path, ["train.stpes=2"])
    assert "--set train.stpes=2: unknown key 'train.stpes' (did you mean 'train.steps'?)" in str(typo.value)
    with pytest.raises(ConfigError) as bad:
        load_config(path, ["train.steps=many"])
    assert "--set train.steps=many: 'train.steps'" in str(bad.value)
    assert str(path) not in str(bad.value)


def test_agl_version_and_a_mistyped_command_get_an_answer():
    version = subprocess.run(
        [sys.executable, "-m", "agl_core.cli", "--version"], capture_output=True, text=True
    )
    assert version.returncode == 0 and version.stdout.startswith("agl ")
    typo = subprocess.run([sys.executable, "-m", "agl_core.cli", "trian"], capture_output=True, text=True)
    assert typo.returncode == 2 and "did you mean 'train'?" in typo.stderr


def test_tasks_with_a_validation_split(folder):
    (folder / "val.jsonl").write_text('{"id": "v1"}\n')
    config = load_config(
        _write(folder, GOOD.replace("tasks: tasks.jsonl", "tasks: {train: tasks.jsonl, val: val.jsonl}"))
    )
    assert config.tasks.train == folder / "tasks.jsonl" and config.tasks.val == folder / "val.jsonl"
    config = load_config(
        _write(folder, GOOD.replace("tasks: tasks.jsonl", "tasks: {train: tasks.jsonl, val_fraction: 0.25}"))
    )
    assert config.tasks.val_fraction == 0.25


@pytest.mark.parametrize(
    "tasks, message",
    [
        ("{train: tasks.jsonl, val: nope.jsonl}", "'tasks.val': file"),
        (
            "{train: tasks.jsonl, val: val.jsonl, val_fraction: 0.1}",
            "either 'val' (a file) or 'val_fraction'",
        ),
        ("{train: tasks.jsonl, val_fraction: 1.5}", "'tasks.val_fraction'"),
        ("{val: val.jsonl}", "missing required key 'tasks.train'"),
        ("tasks.csv", "must be a .jsonl or .parquet file"),
    ],
)
def test_bad_task_settings_are_named(folder, tasks, message):
    (folder / "val.jsonl").write_text('{"id": "v1"}\n')
    (folder / "tasks.csv").write_text("id\n1\n")
    with pytest.raises(ConfigError) as info:
        load_config(_write(folder, GOOD.replace("tasks: tasks.jsonl", f"tasks: {tasks}")))
    assert message in str(info.value)


@pytest.mark.parametrize(
    "extra, message",
    [
        ("validation: {every_steps: -1}\n", "'validation.every_steps'"),
        ("checkpoint: {keep: 0}\n", "'checkpoint.keep'"),
        ("logging: {progress: fancy}\n", "'logging.progress'"),
        ("logging: {tensorboard: maybe}\n", "'logging.tensorboard'"),
        ("train: {resample_rounds: -1}\n", "'train.resample_rounds'"),
        ("train: {resample_rounds: 2, rollouts_per_task: 1}\n", "set train.rollouts_per_task to 2 or more"),
    ],
)
def test_bad_run_settings_are_named(folder, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_write(folder, GOOD + extra))


def test_rewards_section_becomes_reward_weights(folder):
    from agl_core.pipeline.credit import RewardWeights

    assert load_config(_write(folder, GOOD)).algorithm.reward_weights() == RewardWeights()
    config = load_config(
        _write(folder, GOOD),
        [
            "algorithm.credit=per_call",
            "algorithm.rewards.tool_error=-0.5",
            "algorithm.rewards.malformed_tool_call=-1",
            "algorithm.rewards.timeout=-2",
            "algorithm.rewards.timeout_episode_reward=0",
            "algorithm.rewards.explicit=false",
            "algorithm.rewards.tool_success=0.1",
        ],
    )
    assert config.algorithm.credit == "per_call" and config.algorithm.rewards.timeout_episode_reward == 0.0
    assert config.algorithm.reward_weights() == RewardWeights(False, -0.5, -1.0, -2.0, 0.1)
    with pytest.raises(ConfigError, match="tool_success"):
        load_config(_write(folder, GOOD), ["algorithm.rewards.tool_success=nan"])


VLLM = GOOD + "model: {source: Org/Model-1.5B}\nserving: {backend: vllm}\n"


def test_gpu_backends_accept_hub_names_and_keep_them(folder):
    config = load_config(_write(folder, VLLM))
    assert (
        config.model.source == "Org/Model-1.5B" and config.serving.vllm.launch.gpu_memory_utilization == 0.9
    )
    verl = load_config(
        _write(folder, VLLM + "update: {backend: verl}\nverl: {trainer: {n_gpus_per_node: 2}}\n")
    )
    assert verl.update.backend == "verl" and verl.verl == {"trainer": {"n_gpus_per_node": 2}}
    (folder / "models" / "m").mkdir(parents=True)
    (folder / "models" / "m" / "config.json").write_text("{}")
    local = load_config(_write(folder, VLLM.replace("Org/Model-1.5B", "models/m")))
    assert local.model.source == str(
        folder.resolve() / "models" / "m"
    )  # a local directory wins over a Hub name


@pytest.mark.parametrize(
    "text, message",
    [
        (
            GOOD + "model: {source: Org/Model}\n",
            "a Hub name (org/model) is accepted with serving.backend vllm or update.backend verl",
        ),
        (
            VLLM.replace(
                "serving: {backend: vllm}", "serving: {backend: vllm}\nmodel: {source: Org/M, lora: null}"
            ).replace("model: {source: Org/Model-1.5B}\n", ""),
            "serving.backend vllm needs model.lora",
        ),
        (
            GOOD + "serving: {vllm: {url: 'http://gpu:8000/v1'}}\n",
            "serving.vllm applies only with serving.backend: vllm",
        ),
        (
            VLLM.replace(
                "{backend: vllm}",
                "{backend: vllm, vllm: {url: 'http://gpu:8000/v1', launch: {tensor_parallel_size: 2}}}",
            ),
            "set either 'url' (a running server) or 'launch' (start one), not both",
        ),
        (
            VLLM.replace("{backend: vllm}", "{backend: vllm, vllm: {upstream_model: x}}"),
            "serving.vllm.upstream_model names the model of a running server",
        ),
        (
            VLLM.replace("{backend: vllm}", "{backend: vllm, vllm: {url: 'gpu:8000'}}"),
            "'serving.vllm.url': String should match pattern",
        ),
        (
            VLLM.replace("{backend: vllm}", "{backend: vllm, vllm: {launch: {gpu_memory_utilization: 1.5}}}"),
            "'serving.vllm.launch.gpu_memory_utilization'",
        ),
        (
            VLLM.replace("{backend: vllm}", "{backend: vllm, vllm: {launch: {tensor_paralel_size: 2}}}"),
            "unknown key 'serving.vllm.launch.tensor_paralel_size'"
            " (did you mean 'serving.vllm.launch.tensor_parallel_size'?)",
        ),
        (
            GOOD + "serving: {backend: vllm}\n",
            "serving.vllm.launch.model: 'vllm serve' needs a model directory or a Hub name",
        ),
        (GOOD + "update: {backend: verl}\n", "update.backend verl needs serving.backend vllm"),
        (
            GOOD + "serving: {backend: vllm, vllm: {url: 'http://gpu:8000/v1'}}\nupdate: {backend: verl}\n",
            "update.backend verl needs a Hugging Face model",
        ),
        (GOOD + "verl: {trainer: {nnodes: 2}}\n", "the verl: section applies only with update.backend: verl"),
        (
            GOOD + "serving: {hf: {kv_cache: paged}}\n",
            "'serving.hf.kv_cache': Input should be 'slots' or 'dynamic'",
        ),
        (GOOD + "serving: {hf: {prefix_cache_mb: -1}}\n", "'serving.hf.prefix_cache_mb'"),
        (GOOD + "serving: {hf: {prefix_block_tokens: 0}}\n", "'serving.hf.prefix_block_tokens'"),
        (GOOD + "serving: {hf: {packed_weights_mb: lots}}\n", "'serving.hf.packed_weights_mb'"),
        (
            GOOD + "serving: {hf: {matmul_dtype: float16}}\n",
            "'serving.hf.matmul_dtype': Input should be 'float32' or 'bfloat16'",
        ),
        (GOOD + "serving: {hf: {max_batch: 0}}\n", "'serving.hf.max_batch'"),
        (GOOD + "serving: {hf: {direct_decode: sometimes}}\n", "'serving.hf.direct_decode'"),
        (
            GOOD + "serving: {hf: {prefix_cache: 64}}\n",
            "unknown key 'serving.hf.prefix_cache' (did you mean 'serving.hf.prefix_cache_mb'?)",
        ),
        (
            VLLM.replace("{backend: vllm}", "{backend: vllm, hf: {prefix_cache_mb: 64}}"),
            "serving.hf applies only with serving.backend: hf",
        ),
        (GOOD + "update: {device: gpu}\n", "'update.device': String should match pattern"),
        (GOOD + "update: {recompute: maybe}\n", "'update.recompute': Input should be a valid boolean"),
    ],
)
def test_bad_serving_and_update_settings_are_named(folder, text, message):
    path = _write(folder, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_device_defaults_follow_the_device_unless_set():
    """``algorithm.micro_batch_tokens`` and ``update.recompute`` default by device: small passes and
    recompute on CPU, large passes and no recompute on a GPU; a value set in the config wins."""
    import torch

    from agl_trainer.config import (
        CPU_MICRO_BATCH_TOKENS,
        GPU_MICRO_BATCH_TOKENS,
        AlgorithmConfig,
        UpdateConfig,
    )

    for device in ("cpu", torch.device("cpu")):
        assert AlgorithmConfig().micro_batch_tokens_on(device) == CPU_MICRO_BATCH_TOKENS
        assert UpdateConfig().recompute_on(device) is True
    for device in ("cuda", torch.device("cuda", 0)):
        assert AlgorithmConfig().micro_batch_tokens_on(device) == GPU_MICRO_BATCH_TOKENS
        assert UpdateConfig().recompute_on(device) is False
    assert AlgorithmConfig(micro_batch_tokens=1024).micro_batch_tokens_on("cuda") == 1024
    assert UpdateConfig(recompute=False).recompute_on("cpu") is False
    assert UpdateConfig(recompute=True).recompute_on("cuda") is True


def test_one_mapping_from_the_config_to_the_update_steps_arguments(folder):
    """``UpdateSettings`` is the one place the algorithm and update sections become an update step's
    arguments: every value arrives, and each key is an argument the step takes."""
    import inspect

    import torch

    from agl_trainer.learning.finetune import sft_update_step
    from agl_trainer.learning.update import UpdateSettings, update_step

    config = load_config(
        _write(
            folder,
            GOOD
            + "algorithm: {clip_eps: 0.15, max_grad_norm: 0.7, kl_coef: 0.02, micro_batch_tokens: 1234}\n"
            + "update: {bf16: true}\n",
        )
    )
    settings = UpdateSettings.of(config.algorithm, config.update, torch.device("cpu"))
    assert settings.clip_eps == 0.15 and settings.max_grad_norm == 0.7 and settings.kl_coef == 0.02
    assert settings.micro_batch_tokens == 1234 and settings.bf16 is True
    assert settings.recompute == config.update.recompute_on(torch.device("cpu"))
    for step, arguments in ((update_step, settings.ppo()), (sft_update_step, settings.sft())):
        assert set(arguments) <= set(inspect.signature(step).parameters), step.__name__
    assert set(settings.sft()) == {"max_grad_norm", "micro_batch_tokens", "bf16"}
