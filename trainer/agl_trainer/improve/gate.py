"""The two statistical decisions of ``agl improve`` (pure): whether a candidate may replace the serving
version (a paired comparison on the same held-out tasks), and whether a live version has fallen below its
predecessor (two independent means of late session rewards)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..config import GateConfig
from ..stats import PairedChange, mean_se, paired_change, unpaired_change
from .state import GateRecord

__all__ = ["LiveComparison", "compare_live", "gate_decision"]

_ROUNDING = 1e-9
#: One-sided 95% (the lower bound of ``max_loss``), and 80% power: a change of (Z_95 + Z_80) SE is seen
#: four times in five.
Z_95 = 1.6449
Z_80 = 0.8416


def gate_decision(
    gate: GateConfig, serving: Mapping[str, float], candidate: Mapping[str, float], seconds: float = 0.0
) -> GateRecord:
    """Promote or refuse a candidate from each version's per-task held-out scores.

    The change is the mean over the tasks both scored of (candidate - serving), ``se`` its standard error.
    Refused when ``change < -max_drop_se * se`` (worse beyond the margin; a change exactly at it passes),
    or, with ``min_gain_se``, when ``change < min_gain_se * se`` (not better enough). With a standard error
    of 0 (every task changed by the same amount) a negative change is refused and, with ``min_gain_se``, so
    is no change.
    """
    paired = paired_change(serving, candidate)
    if not paired.n:
        return GateRecord(
            "refused",
            "no held-out task was scored for both versions"
            + (f" with finite scores ({paired.left_out} scored NaN or infinite)" if paired.left_out else ""),
            seconds=seconds,
        )
    record = _decide(gate, paired, seconds)
    if paired.left_out:
        record.reason += f"; {paired.left_out} tasks left out (a score was NaN or infinite)"
    return record


def _decide(gate: GateConfig, paired: PairedChange, seconds: float) -> GateRecord:
    change, se, n = paired.change, paired.se, paired.n
    record = GateRecord("promoted", "", paired.after_mean, paired.before_mean, change, se, n, seconds)
    record.detectable = (Z_95 + Z_80) * se
    sees = f"; {n} tasks tell a change of {record.detectable:.3f} from none (80% power)"
    floor = -gate.max_drop_se * se
    # a change exactly at the margin is not beyond it (one task of n lost, and no other change, is exactly
    # -1 SE: rounding must not decide it)
    if change < floor - _ROUNDING or (se == 0 and change < 0):
        record.decision = "refused"
        record.reason = (
            f"worse than the serving version: change {change:+.3f} ± {se:.3f} over {n} tasks,"
            f" below the margin of -{gate.max_drop_se:g} SE ({floor:+.3f})" + sees
        )
        return record
    if gate.max_loss is not None:
        lower = change - Z_95 * se
        if lower <= -gate.max_loss + _ROUNDING and not (se == 0 and change >= 0):
            record.decision = "refused"
            record.reason = (
                f"no evidence it is not worse: change {change:+.3f} ± {se:.3f} over {n} tasks, its 95% lower"
                f" bound {lower:+.3f} is not above -{gate.max_loss:g} (gate.max_loss)"
                + sees
                + ": score more held-out tasks (validation.max_tasks), or allow a larger max_loss"
            )
            return record
    if gate.min_gain_se is not None:
        needed = gate.min_gain_se * se
        if change < needed - _ROUNDING or (se == 0 and change <= 0):
            record.decision = "refused"
            record.reason = (
                f"not better enough: change {change:+.3f} ± {se:.3f} over {n} tasks, below the"
                f" required +{gate.min_gain_se:g} SE ({needed:+.3f})" + sees
            )
            return record
    record.reason = (
        f"change {change:+.3f} ± {se:.3f} over {n} tasks is within the gate"
        f" (at least -{gate.max_drop_se:g} SE"
        + (f", 95% lower bound above -{gate.max_loss:g}" if gate.max_loss is not None else "")
        + (f", at least +{gate.min_gain_se:g} SE" if gate.min_gain_se is not None else "")
        + ")"
        + sees
    )
    return record


class LiveComparison:
    """A version's live reward against its predecessor's: means, counts and the SE of the difference."""

    def __init__(self, current: Sequence[float], previous: Sequence[float]) -> None:
        self.n, self.n_previous = len(current), len(previous)
        self.mean = mean_se(list(current))[0]
        self.previous_mean = mean_se(list(previous))[0]
        self.change = self.mean - self.previous_mean
        self.se = unpaired_change(list(current), list(previous))[1]

    def describe(self) -> str:
        return (
            f"live reward {self.mean:.3f} over {self.n} sessions against {self.previous_mean:.3f} over"
            f" {self.n_previous} (change {self.change:+.3f} ± {self.se:.3f})"
        )


def compare_live(
    current: Sequence[float], previous: Sequence[float], *, min_sessions: int, k_se: float
) -> tuple[bool, LiveComparison]:
    """Whether the live version should be rolled back: at least ``min_sessions`` rewarded sessions of
    each, and its mean below the predecessor's by more than ``k_se`` standard errors of the difference."""
    live = LiveComparison(current, previous)
    if live.n < min_sessions or live.n_previous < min_sessions:
        return False, live
    se = live.se if live.se > 0 else 1e-12
    return live.change < -k_se * se, live
