"""The README's main command (``bash scripts/demo.sh``) trains the calculator example; its reduced run end to
end is ``test_example_calc_autogen.py::test_train_calc_example_end_to_end_on_cpu``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_main_command_trains_the_calculator_example():
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    (config,) = re.findall(r"agl train (\S+\.yaml)", demo)
    assert config == "examples/calc_autogen/config.yaml"
    from agl_trainer.config import load_config

    loaded = load_config(ROOT / config)
    # what the main command must print at the end: the held-out score before and after, and the plot
    assert loaded.tasks.val is not None and loaded.validation.before and loaded.validation.after
    assert loaded.logging.plot
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/demo.sh" in readme and "examples/calc_autogen" in readme
