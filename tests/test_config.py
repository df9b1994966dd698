"""The trainer's YAML config: every mistake is named with its key and file before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
    assert config.tasks == folder / "tasks.jsonl"
    assert config.base_dir == folder.resolve()
    assert config.train.steps == 3 and config.train.threads == 1 and config.algorithm.name == "grpo"


def test_runner_settings(folder):
    default = load_config(_write(folder, GOOD)).runner
    assert (default.workers, default.mode, default.rollout_timeout_s) == (2, "auto", None)
    config = load_config(_write(folder, GOOD + "runner: {workers: 0, mode: process, rollout_timeout_s: 90}\n"))
    assert (config.runner.workers, config.runner.mode, config.runner.rollout_timeout_s) == (0, "process", 90.0)


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
        (GOOD.replace("steps: 3", "stpes: 3"), "unknown key 'train.stpes' (did you mean 'steps'?)"),
        (GOOD + "model: {lora: {rank: 4}}\n", "unknown key 'model.lora.rank'"),
        (GOOD.replace("steps: 3", "steps: -1"), "'train.steps': Input should be greater than or equal to 1"),
        (GOOD.replace("agent: agent:solve", "agent: just_a_module"), "'agent'"),
        ("tasks: tasks.jsonl\n", "missing required key 'agent'"),
        (GOOD.replace("tasks.jsonl", "missing.jsonl"), "'tasks': file"),
        (GOOD + "model: {source: ./no-model-here}\n", "'model.source'"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("agent: [unclosed\n", "not valid YAML"),
        (GOOD + "runner: {mode: fork}\n", "'runner.mode': Input should be 'auto', 'thread', 'process' or 'async'"),
        (GOOD + "runner: {rollout_timeout_s: 0}\n", "'runner.rollout_timeout_s': Input should be greater than 0"),
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
    done = subprocess.run([sys.executable, "-m", "agl_core.cli", "train", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "unknown key 'train.stpes'" in done.stderr and str(path) in done.stderr
    assert not (folder / "out").exists()


def test_cli_rejects_bad_flags():
    done = subprocess.run([sys.executable, "-m", "agl_core.cli", "store", "serve", "--http-port", "99999"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "outside 0-65535" in done.stderr


def test_print_config_shows_defaults(folder):
    done = subprocess.run([sys.executable, "-m", "agl_core.cli", "train", str(_write(folder, GOOD)), "--print-config"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert '"clip_eps": 0.2' in done.stdout and '"steps": 3' in done.stdout
