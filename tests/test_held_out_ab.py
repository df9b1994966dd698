"""bench/held_out_ab.py's report and checks: the verdict that says whether a change lost held-out reward
(the runs themselves are full main jobs, run by hand)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "held_out_ab.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("held_out_ab", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _step(tasks: list[str], reward: float, grad: float) -> dict[str, object]:
    return {
        "tasks": tasks,
        "rollouts": 16,
        "trained_transitions": 12,
        "mean_reward": reward,
        "grad_norm": grad,
    }


def _finished(
    out: Path,
    side: str,
    seed: int,
    after: list[float],
    *,
    wall: float = 900.0,
    steps: list[dict[str, object]] | None = None,
) -> None:
    run = out / f"{side}-{seed}"
    run.mkdir(parents=True)
    scores = {f"t{i}": s for i, s in enumerate(after)}
    result = {"seed": seed, "wall_s": wall, "peak_rss_kib": 2_800_000, "before": scores, "after": scores}
    if steps is not None:
        result["steps"] = steps
    (run / "ab.json").write_text(json.dumps(result))


def test_the_same_results_seed_by_seed_are_no_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _bench()
    for seed, after in ((0, [1.0, 0.0, 1.0, 1.0]), (1, [0.0, 0.0, 1.0, 1.0])):
        _finished(tmp_path, "base", seed, after, wall=1300.0)
        _finished(tmp_path, "current", seed, after)
    assert bench.report(tmp_path) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[-2]
        == "mean over 2 seed(s): base 0.625, current 0.625; current the same for 2, higher for 0, lower for 0"
    )
    assert lines[-1].startswith(
        "held-out difference (current - base) +0.000 ± 0.000 (paired SE over 8 seed x task"
    )
    assert lines[-1].endswith("no held-out loss (target: not below -2 SE)")
    assert "21.7 | 15.0 min" in lines[2]


def test_a_loss_beyond_twice_its_paired_error_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _bench()
    base = [1.0] * 20
    lower = [1.0] * 10 + [0.0] * 10
    for seed in (0, 1):
        _finished(tmp_path, "base", seed, base)
        _finished(tmp_path, "current", seed, lower)
    assert bench.report(tmp_path) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    # 40 pairs, half of them -1: mean -0.5, SE 0.080; -2 SE is -0.160, the loss 0.340 below it
    assert "-0.500 ± 0.080" in last and last.endswith(
        "a held-out loss, 0.340 below -2 SE (target: not below -2 SE)"
    )


def test_a_small_difference_within_the_noise_is_no_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _bench()
    _finished(tmp_path, "base", 0, [1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    _finished(tmp_path, "current", 0, [1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    assert bench.report(tmp_path) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("no held-out loss (target: not below -2 SE)")


def test_a_seed_run_on_one_side_only_is_not_compared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _bench()
    _finished(tmp_path, "base", 0, [1.0])
    _finished(tmp_path, "current", 1, [1.0])
    assert bench.report(tmp_path) == 1
    assert "no seed has finished on both sides" in capsys.readouterr().err


def test_bad_arguments_are_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _bench()
    for argv, message in (
        ([], "--base is required"),
        (["--base", "HEAD", "--seeds", "0,x"], "--seeds '0,x': give integers"),
        (["--base", "HEAD", "--patch", str(tmp_path / "none.patch")], "--patch: no file"),
        (["--base", "HEAD", "--set", "train.steps"], "write KEY=VALUE"),
        (["--base", "no-such-revision-here", "--out", str(tmp_path / "ab")], "is not a commit"),
        (["--report", str(tmp_path / "missing")], "--report: no directory"),
    ):
        with pytest.raises(SystemExit) as exited:
            bench.main(argv)
        assert exited.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "ab").exists()


def test_how_many_steps_two_runs_took_alike() -> None:
    bench = _bench()
    path = [_step(["a", "b"], 0.5, 0.04), _step(["c", "d"], 0.75, 0.05), _step(["e", "f"], 0.25, 0.03)]
    assert bench.same_steps(path, path) == 3
    close = [dict(s, grad_norm=s["grad_norm"] * (1 + 1e-5)) for s in path]
    assert bench.same_steps(path, close) == 3  # the gradient norm rounds differently: still the same path
    assert bench.same_steps(path, [*path[:2], _step(["e", "g"], 0.25, 0.03)]) == 2  # another task drawn
    assert bench.same_steps(path, [path[0], _step(["c", "d"], 0.5, 0.05), path[2]]) == 1  # another sample
    assert bench.same_steps(path, [path[0], dict(path[1], grad_norm=0.06)]) == 1


def test_seeds_whose_runs_parted_are_compared_over_seeds_not_tasks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """After the runs of a seed part, the pairing by task understates the error: the verdict is over the
    seeds' differences, and a single parted seed decides nothing (exit 1, asking for more seeds)."""
    bench = _bench()
    alike = [_step(["a"], 0.5, 0.04), _step(["b"], 0.5, 0.04)]
    other = [alike[0], _step(["b"], 0.75, 0.05)]
    _finished(tmp_path, "base", 0, [1.0] * 6 + [0.0] * 4, steps=alike)
    _finished(tmp_path, "current", 0, [1.0] * 4 + [0.0] * 6, steps=other)
    assert bench.report(tmp_path) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[2].endswith("1/2 steps")
    assert out[-1].endswith(
        "over 1 seed: one run cannot tell a loss from chance; run more seeds (--seeds 0,1,2,3)"
    )
    # three more seeds, two of them alike: the seed-level differences -0.2, 0, 0, +0.1
    for seed, current in ((1, [1.0] * 6 + [0.0] * 4), (2, [1.0] * 6 + [0.0] * 4), (3, [1.0] * 7 + [0.0] * 3)):
        _finished(tmp_path, "base", seed, [1.0] * 6 + [0.0] * 4, steps=alike)
        _finished(tmp_path, "current", seed, current, steps=alike if seed < 3 else other)
    assert bench.report(tmp_path) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert "-0.025 ± 0.063 (SE over 4 seeds): no held-out loss" in last
