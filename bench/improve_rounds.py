"""Benchmark: ``agl improve``'s round bookkeeping as the store grows.

A service whose watcher already holds N rewarded gateway sessions (two spans each) and whose state lists
N rollouts trained on by earlier rounds: one look that decides a round is due, starts it and closes it
(no training, no gate: those are the round's own work). CPU seconds per look, for each N. The work must
grow linearly with N: the seconds per 10k rollouts printed beside each figure stay about flat.

    python bench/improve_rounds.py [--sizes 10000 20000 40000 100000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from agl_core import semconv
from agl_core.records import Rollout, RolloutStatus, Span
from agl_core.store import open_store
from agl_trainer.config import config_from_dict
from agl_trainer.improve.service import ImproveService


class _NoWork:
    def train(self, round_dir, selection, parent_adapter):  # never called: the look closes the round
        raise AssertionError

    def score(self, candidate, serving):
        raise AssertionError

    def base_adapter(self, path):
        raise AssertionError


def _sessions(first: int, n: int) -> tuple[list[Span], dict[str, Rollout]]:
    spans, records = [], {}
    for i in range(first, first + n):
        rid = f"imp-s-{i:07d}"
        trace = f"{i + 1:032x}"
        ids = {semconv.ROLLOUT_ID: rid}
        call = {**ids, semconv.SOURCE: semconv.SOURCE_GATEWAY, semconv.POLICY_VERSION: 0}
        reward = {**ids, semconv.REWARD_VALUE: 1.0, semconv.REWARD_NAME: "episode"}
        spans.append(Span(trace, f"{2 * i + 1:016x}", None, "chat policy", 10 * i, 10 * i + 5, call))
        spans.append(
            Span(trace, f"{2 * i + 2:016x}", None, semconv.SPAN_REWARD, 10 * i + 6, 10 * i + 6, reward)
        )
        records[rid] = Rollout(
            rollout_id=rid,
            task_id=rid,
            input=None,
            group_id=None,
            status=RolloutStatus.SUCCEEDED,
            created_at=0.0,
            reward=1.0,
            metadata={"source": "gateway"},
        )
    return spans, records


def one_look(n: int, folder: Path) -> float:
    """CPU seconds of a look that starts and closes a round over N new rollouts, N consumed before."""
    db = folder / f"store-{n}.sqlite"
    open_store(str(db)).close()
    config = config_from_dict(
        {
            "output_dir": str(folder / f"service-{n}"),
            "model": {"source": "tiny", "lora": {"r": 4, "alpha": 8}},
            "traces": {"store": str(db), "filter": {"source": "gateway"}},
            "algorithm": {"name": "sft"},
            "improve": {"name": "bench", "gate": "none", "min_new_rollouts": n},
        },
        required=(),
    )
    service = ImproveService(config, echo=lambda _: None, work=_NoWork())
    old_spans, old_records = _sessions(0, n)
    new_spans, new_records = _sessions(n, n)
    service.watcher.reader.spans = old_spans + new_spans
    service.watcher.reader.records = {**old_records, **new_records}
    service.state.consumed = list(old_records)
    started = time.process_time()
    assert service._round_due()
    pending = service._start_round()
    service._close_round(pending, None, "bench: no training")
    seconds = time.process_time() - started
    service.watcher.close()
    assert len(service.state.consumed) == 2 * n
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 20_000, 40_000, 100_000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'rollouts':>9}  {'CPU s per look':>14}  {'per 10k':>8}   (median of {args.repeats})")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            runs = [one_look(n, Path(tmp) / f"{n}-{r}") for r in range(args.repeats)]
            seconds = statistics.median(runs)
            print(f"{n:>9}  {seconds:>14.2f}  {seconds / n * 10_000:>8.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
