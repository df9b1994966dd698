"""The trainer's commands make torch's OpenMP threads sleep rather than spin when idle, unless the user
chose otherwise, and size torch's pools; checked in fresh interpreters, where torch is not loaded yet."""

from __future__ import annotations

import os
import subprocess
import sys

_PROBE = """
import json, os, sys
from agl_trainer.cpu import passive_openmp
before = 'torch' in sys.modules
{setup}
set_now = passive_openmp()
print(json.dumps([before, set_now, os.environ.get('OMP_WAIT_POLICY')]))
"""


def _probe(setup: str = "", **env: str) -> list[object]:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(setup=setup)],
        capture_output=True,
        text=True,
        env=environ,
        check=True,
        timeout=120,
    )
    import json

    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_passive_unless_the_user_chose_or_torch_is_loaded():
    assert _probe() == [False, True, "PASSIVE"]
    assert _probe(OMP_WAIT_POLICY="ACTIVE") == [False, False, "ACTIVE"]
    assert _probe(setup="import torch") == [False, False, None]  # too late to take effect: left alone


def test_the_train_and_eval_commands_set_it_before_torch_loads():
    """The commands' modules import no torch at import time, so the policy set in ``run`` takes effect."""
    code = "import sys, agl_trainer.cli, agl_trainer.evaluate; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"


def test_size_torch_threads():
    code = (
        "import torch; from agl_trainer.cpu import size_torch_threads; size_torch_threads(2); "
        "size_torch_threads(1); print(torch.get_num_threads(), torch.get_num_interop_threads())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["1", "1"]
