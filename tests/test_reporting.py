"""Run reporting: mean and standard error, the reward-curve PNG, TensorBoard scalars, the plain display."""

from __future__ import annotations

import math

import pytest

from agl_trainer.reporting import Display, mean_se, plot_reward_curve
from agl_trainer.trackers import Trackers, tensorboard_tracker


def test_mean_and_standard_error_by_hand():
    mean, se = mean_se([1.0, 0.0, 0.0, 1.0])
    assert mean == 0.5
    assert math.isclose(se, math.sqrt((4 * 0.25 / 3) / 4))
    assert mean_se([0.7]) == (0.7, 0.0)
    assert all(math.isnan(v) for v in mean_se([]))


def test_reward_curve_is_a_png_redrawn_in_place(tmp_path):
    path = tmp_path / "curve.png"
    assert plot_reward_curve(path, [(1, 0.2), (2, 0.4)], [(0, 0.1, 0.05)]) == path
    first = path.read_bytes()
    assert first[:8] == b"\x89PNG\r\n\x1a\n"
    plot_reward_curve(path, [(1, 0.2), (2, 0.4), (3, 0.9)], [(0, 0.1, 0.05), (3, 0.8, 0.1)])
    assert path.read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png"]  # no temporary file left


def test_tensorboard_scalars_can_be_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = Trackers([tensorboard_tracker(tmp_path / "tb", "auto")])
    assert "tensorboard" in scalars
    scalars.add(1, {"train/mean_reward": 0.25, "train/loss": None, "val/mean_reward": float("nan")})
    scalars.add(2, {"train/mean_reward": 0.5})
    scalars.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["train/mean_reward"]  # None and NaN are not written
    assert [(e.step, e.value) for e in acc.Scalars("train/mean_reward")] == [(1, 0.25), (2, 0.5)]
    assert tensorboard_tracker(tmp_path / "off", False) is None


def test_plain_display_prints_lines_only():
    lines: list[str] = []
    with Display("plain", 3, echo=lines.append) as display:
        display.start_step(1, 0)
        display.rollouts("rollouts", 2, 1, 4)
        display.line("step 1/3 ...")
        display.end_step(1, reward=0.5, loss=0.0, tokens_per_s=10.0)
    assert lines == ["step 1/3 ..."]
