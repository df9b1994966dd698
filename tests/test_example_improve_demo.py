"""examples/calc_autogen/improve_demo.py: its refusals and its plot (the scene itself runs for 20 minutes
and is measured in examples/calc_autogen/IMPROVE.md; the service it drives is tested in test_improve.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _demo():
    """The demo's module, loaded without leaving its folder on ``sys.path`` (its ``agent`` module would
    shadow other examples' in later tests)."""
    spec = importlib.util.spec_from_file_location(
        "improve_demo", ROOT / "examples/calc_autogen/improve_demo.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


@pytest.mark.parametrize("bad", [["--rounds", "0"], ["--interval", "0"], ["--concurrency", "0"]])
def test_bad_settings_are_refused_before_anything_starts(bad: list[str], tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        _demo().main(["--out", str(tmp_path / "out"), *bad])
    assert stopped.value.code == 2 and "must be" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_used_output_folder_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "used.txt").write_text("x")
    with pytest.raises(SystemExit):
        _demo().main(["--out", str(tmp_path)])
    assert "is not empty" in capsys.readouterr().err


def test_the_share_of_calls_plot_has_a_band_per_version(tmp_path: Path) -> None:
    second = 10**9
    calls = [(i * second, 0) for i in range(40)] + [(40 * second + i * second, 1) for i in range(40)]
    path = tmp_path / "calls.png"
    _demo().plot_calls(calls, path, bin_s=10.0)
    assert path.stat().st_size > 5_000 and path.read_bytes()[:4] == b"\x89PNG"
