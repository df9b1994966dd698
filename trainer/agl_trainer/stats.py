"""The statistics agl's figures are quoted with, in one place: the mean and its standard error, the
paired change between two versions scored on the same tasks (the held-out line, ``agl eval``'s
comparison, ``agl improve``'s gate) and the change between two independent samples (live rewards)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

__all__ = ["PairedChange", "mean_se", "paired_change", "unpaired_change"]


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for fewer than two values; NaN for none)."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    # (v - mean) * (v - mean): a huge value gives inf, where ** 2 raises OverflowError
    var = sum((v - mean) * (v - mean) for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


@dataclasses.dataclass(frozen=True)
class PairedChange:
    """``after - before`` over the tasks both scored with finite scores: the mean change and its paired SE,
    each side's mean over those tasks, how many tasks, and how many were left out for a NaN or infinite
    score on either side."""

    change: float
    se: float
    n: int
    before_mean: float
    after_mean: float
    left_out: int = 0


def paired_change(before: Mapping[str, float], after: Mapping[str, float]) -> PairedChange:
    """The paired change from ``before`` to ``after`` (task id -> score). A score that is not a finite
    number (a scorer's NaN) says nothing about its task: the task is left out and counted."""
    both = sorted(set(before) & set(after))
    common = [t for t in both if math.isfinite(before[t]) and math.isfinite(after[t])]
    change, se = mean_se([after[t] - before[t] for t in common])
    before_mean = mean_se([before[t] for t in common])[0]
    after_mean = mean_se([after[t] for t in common])[0]
    return PairedChange(change, se, len(common), before_mean, after_mean, len(both) - len(common))


def unpaired_change(current: Sequence[float], previous: Sequence[float]) -> tuple[float, float]:
    """``mean(current) - mean(previous)`` for two independent samples, and its SE
    (``sqrt(se_current² + se_previous²)``); NaN for both when either sample is empty."""
    if not current or not previous:
        return math.nan, math.nan
    (m_cur, se_cur), (m_prev, se_prev) = mean_se(current), mean_se(previous)
    return m_cur - m_prev, math.sqrt(se_cur**2 + se_prev**2)
