"""Every config shipped in ``trainer/configs/`` and ``examples/`` validates (Hub model names are accepted
there because they serve with vLLM); with verl installed, the ``verl:`` sections also fit verl's defaults."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from agl_core.store import SqliteStore
from agl_trainer.config import load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "trainer" / "configs").glob("*.yaml")) + sorted(
    (ROOT / "examples").glob("*/config*.yaml")
)


def test_the_example_configs_are_there():
    assert {"cpu_smollm2_lora.yaml", "gpu_vllm_lora.yaml", "gpu_verl.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_validates(path, tmp_path):
    overrides = []
    if "traces" in yaml.safe_load(path.read_text()):
        # the store of traces a script writes first (examples/calc_autogen/distill.py): an empty one here
        store = tmp_path / "store.sqlite"
        SqliteStore(str(store)).close()
        overrides.append(f"traces.store={store}")
    if "init_adapter" in (yaml.safe_load(path.read_text()).get("model") or {}):
        # the warm start a run writes first (examples/spider_langgraph/config.sft.yaml): a directory here
        overrides.append(f"model.init_adapter={tmp_path}")
    config = load_config(path, overrides)
    assert config.tasks is not None and config.tasks.train.is_file()
    if config.serving.backend == "vllm":
        assert config.model.lora is not None
    if config.update.backend == "verl" and importlib.util.find_spec("verl") is not None:
        from agl_trainer.learning.verl_backend import merge_verl_config, verl_defaults, verl_overrides

        defaults, source = verl_defaults()
        merged = merge_verl_config(defaults, verl_overrides(config), source=source)
        assert merged["actor_rollout_ref"]["model"]["path"] == config.model.source
        assert merged["trainer"]["n_gpus_per_node"] == config.verl["trainer"]["n_gpus_per_node"]
