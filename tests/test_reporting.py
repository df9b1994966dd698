"""Run reporting: mean and standard error, the paired and unpaired changes, the reward-curve PNG,
TensorBoard scalars, the plain display."""

from __future__ import annotations

import math

import pytest

from agl_trainer.reporting.display import Display, held_out_line, plot_reward_curve
from agl_trainer.reporting.results import EvalResult
from agl_trainer.reporting.trackers import Trackers, tensorboard_tracker
from agl_trainer.stats import mean_se, paired_change, unpaired_change


def test_mean_and_standard_error_by_hand():
    mean, se = mean_se([1.0, 0.0, 0.0, 1.0])
    assert mean == 0.5
    assert math.isclose(se, math.sqrt((4 * 0.25 / 3) / 4))
    assert mean_se([0.7]) == (0.7, 0.0)
    assert all(math.isnan(v) for v in mean_se([]))


def test_paired_change_by_hand_leaves_out_unshared_and_non_finite_tasks():
    before = {"a": 0.0, "b": 1.0, "c": 0.0, "d": math.nan, "only_before": 1.0}
    after = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0, "only_after": 0.0}
    paired = paired_change(before, after)
    # diffs over a, b, c: 1, 0, 1 -> mean 2/3, SE sqrt(var / 3) with var = (1/9 + 4/9 + 1/9) / 2
    assert (paired.n, paired.left_out) == (3, 1)
    assert math.isclose(paired.change, 2 / 3)
    assert math.isclose(paired.se, math.sqrt((6 / 9 / 2) / 3))
    assert (paired.before_mean, paired.after_mean) == (1 / 3, 1.0)
    assert paired_change({}, {"a": 1.0}).n == 0


def test_held_out_line_says_what_it_left_out():
    before = EvalResult(step=0, mean=0.5, se=0.5, n=2, rollouts_failed=0, task_scores={"a": 0.0, "b": 1.0})
    after = EvalResult(
        step=1, mean=1.0, se=0.0, n=2, rollouts_failed=0, task_scores={"a": 1.0, "b": math.nan}
    )
    line = held_out_line(before, after)
    assert (
        "change +1.000 ± 0.000 (paired SE over 1 tasks); 1 tasks left out (a NaN or infinite score)" in line
    )


def test_unpaired_change_adds_the_two_standard_errors_in_quadrature():
    change, se = unpaired_change([1.0, 0.0, 1.0, 0.0], [0.0, 0.0])
    assert change == 0.5
    assert math.isclose(se, math.sqrt(mean_se([1.0, 0.0, 1.0, 0.0])[1] ** 2 + 0.0))
    assert all(math.isnan(v) for v in unpaired_change([], [1.0]))


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


def test_the_step_time_line_splits_generation_into_prefill_and_decode():
    import dataclasses

    from agl_trainer.reporting.display import _phases_text
    from agl_trainer.reporting.results import StepMetrics

    required = [
        f for f in dataclasses.fields(StepMetrics) if f.default is f.default_factory is dataclasses.MISSING
    ]
    fields = {f.name: None for f in required}
    metrics = StepMetrics(
        **fields,
        phases={"rollouts": 25.4, "generation": 24.7, "prefill": 3.14, "decode": 21.5, "update": 14.2},
        generation_tokens_per_s=28.4,
        prefix_reuse=0.9312,
        peak_rss_mb=2458.0,
    )
    assert _phases_text(metrics) == (
        "time: rollouts 25.4s (generating 24.7s: prefill 3.1s, decode 21.5s, 28 tok/s, 93% of prompt tokens"
        " cached), update 14.2s; peak RSS 2.4 GB"
    )
    # a backend that counts no parts (vLLM): the rollouts alone
    bare = dataclasses.replace(metrics, phases={"rollouts": 25.4, "update": 14.2}, prefix_reuse=None)
    assert _phases_text(bare) == "time: rollouts 25.4s, update 14.2s; peak RSS 2.4 GB"
