"""``agl train``, ``agl eval`` and ``--backend hf`` reach agl_core through entry points; a plugin whose
requirements are missing is still listed and says what to install, and breaks no other command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agl_core import plugins

HINT = "pip install 'agl[trainer]'"
CONFIG = "agent: agent:solve\ntasks: tasks.jsonl\ntrain: {steps: 3}\n"


def test_the_trainer_registers_train_eval_dev_and_the_hf_backend():
    from agl_trainer.cli import TRAIN_COMMAND
    from agl_trainer.dev import DEV_COMMAND

    commands = {c.name: c for c in plugins.command_plugins()}
    assert {"train", "eval", "dev"} <= set(commands)
    assert commands["train"] is TRAIN_COMMAND and commands["train"].extra == "trainer"
    assert commands["dev"] is DEV_COMMAND and commands["dev"].extra == "trainer"
    assert "hf" in plugins.gateway_backend_names()
    assert callable(plugins.load_gateway_backend("hf"))


def test_built_in_names_are_not_taken_by_plugins():
    assert plugins.command_plugins(reserved=frozenset({"train"})) == [
        c for c in plugins.command_plugins() if c.name != "train"
    ]


def _agl(tmp_path: Path, blocked: tuple[str, ...], *argv: str) -> subprocess.CompletedProcess[str]:
    """``agl ARGV`` in a fresh interpreter where importing any of ``blocked`` (and their submodules) fails,
    as it does when the trainer extra is not installed."""
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        f"BLOCKED = {blocked!r}\n"
        "class _Blocked(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, _Blocked())\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-m", "agl_core.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )


def _config(tmp_path: Path) -> str:
    (tmp_path / "tasks.jsonl").write_text('{"id": "t1", "question": "1+1", "answer": 2}\n')
    (tmp_path / "x.yaml").write_text(CONFIG)
    return str(tmp_path / "x.yaml")


def _says_install_the_extra(done: subprocess.CompletedProcess[str], what: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert what in done.stderr and HINT in done.stderr, done.stderr
    assert "--index-url https://download.pytorch.org/whl/cpu" in done.stderr  # never the CUDA build unasked


def test_without_torch_train_is_listed_and_says_what_to_install(tmp_path):
    config = _config(tmp_path)
    listed = _agl(tmp_path, ("torch",), "--help")
    assert listed.returncode == 0 and "train" in listed.stdout and "eval" in listed.stdout, listed.stderr
    _says_install_the_extra(_agl(tmp_path, ("torch",), "train", config), "agl train needs the trainer extra")
    printed = _agl(tmp_path, ("torch",), "train", config, "--print-config")
    assert printed.returncode == 0 and "  steps: 3" in printed.stdout, printed.stderr
    _says_install_the_extra(
        _agl(tmp_path, ("torch",), "gateway", "serve", "--backend", "hf"),
        "--backend hf needs the trainer extra",
    )
    assert _agl(tmp_path, ("torch",), "store", "--help").returncode == 0


def test_a_plugin_module_that_cannot_be_imported_breaks_no_other_command(tmp_path):
    config = _config(tmp_path)
    listed = _agl(tmp_path, ("agl_trainer",), "--help")
    assert listed.returncode == 0, listed.stderr
    assert "train" in listed.stdout and "unavailable" in listed.stdout
    _says_install_the_extra(
        _agl(tmp_path, ("agl_trainer",), "train", config, "--set", "train.steps=1"), "agl train needs"
    )
    _says_install_the_extra(_agl(tmp_path, ("agl_trainer",), "eval", config), "agl eval needs")
    assert (
        "--backend {hf,vllm,openai}" in _agl(tmp_path, ("agl_trainer",), "gateway", "serve", "--help").stdout
    )
    store = _agl(tmp_path, ("agl_trainer",), "store", "--help")
    assert store.returncode == 0 and "serve" in store.stdout, store.stderr
    unknown = _agl(tmp_path, ("agl_trainer",), "store", "stats", "--nope")
    assert unknown.returncode == 2 and "unrecognized arguments: --nope" in unknown.stderr


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--help"]])
def test_a_plugin_whose_arguments_fail_is_listed_as_unavailable(monkeypatch, capsys, argv):
    from agl_core import cli

    class Broken:
        name, help, extra = "broken", "a broken command", "trainer"

        def add_arguments(self, parser):
            raise RuntimeError("boom")

        def run(self, args):
            return 0

    monkeypatch.setattr(plugins, "command_plugins", lambda reserved=frozenset(): [Broken()])
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 0
    assert cli.main(["broken", "whatever"]) == 2
    assert "agl broken is unavailable: its arguments cannot be defined (RuntimeError: boom)" in (
        capsys.readouterr().err
    )
