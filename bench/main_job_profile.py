"""Benchmark: where the main job's time and memory go, step by step.

Runs a short main job (``agl train examples/calc_autogen/config.yaml``, the README's command, with fewer
steps and held-out tasks unless told otherwise) into a temporary directory, then prints each step's
phases from its ``metrics.jsonl`` line: the rollouts (and, inside them, the transformers backend
generating), fetching spans and building transitions, the update, publishing the new weights, and a
held-out evaluation run after the step; generation and update tokens per second; the process's peak
resident memory. The last lines are the medians over the steps, the whole run's wall time, and the CPU
time it took (user and kernel, how many cores it kept busy) with the process's peak resident memory.

    python bench/main_job_profile.py [--steps 2] [--val-tasks 10] [--set KEY=VALUE ...]
    python bench/main_job_profile.py --from runs/calc_autogen/metrics.jsonl   # the table of a finished run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "calc_autogen" / "config.yaml"
PHASES = ("rollouts", "generation", "prefill", "decode", "transitions", "update", "publish", "validation")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG), help="the job's YAML (default: the main job's)")
    parser.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    parser.add_argument("--val-tasks", type=int, default=10, help="held-out tasks before and after (10)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides")
    parser.add_argument(
        "--from",
        dest="metrics",
        metavar="METRICS_JSONL",
        help="print the table of a run that already finished (its metrics.jsonl) instead of running one",
    )
    args = parser.parse_args(argv)
    if args.metrics:
        path = Path(args.metrics)
        if not path.is_file():
            parser.error(f"--from: no file {path} (give a run's output_dir/metrics.jsonl)")
        rows = read_metrics(path)
        if not any(r.get("kind") == "train" for r in rows):
            parser.error(f"--from: {path} has no training step's line (kind: train)")
        print_steps(rows)
        return 0
    if args.steps < 1 or args.val_tasks < 0:
        parser.error("--steps must be at least 1 and --val-tasks at least 0")
    with tempfile.TemporaryDirectory(prefix="agl-profile-") as tmp:
        out = Path(tmp) / "run"
        overrides = [
            f"output_dir={out}",
            f"train.steps={args.steps}",
            f"validation.max_tasks={args.val_tasks}",
        ]
        command = [sys.executable, "-m", "agl_core.cli", "train", args.config]
        for item in overrides + args.set:
            command += ["--set", item]
        started = time.monotonic()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            print(f"the job failed (exit {done.returncode}):\n{done.stderr[-3000:]}", file=sys.stderr)
            return 1
        rows = read_metrics(out / "metrics.jsonl")
    print_steps(rows)
    print(f"the whole job {wall:.0f} s (model load and held-out runs included)")
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    busy = (user + system) / wall
    print(
        f"CPU: {user:.0f} s user + {system:.0f} s system over {wall:.0f} s ({busy:.2f} cores"
        f" busy of {len(os.sched_getaffinity(0))}, {system / max(user + system, 1e-9):.0%} in the kernel);"
        f" process peak RSS {after.ru_maxrss / 2**20:.2f} GiB"
    )
    return 0


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The lines of a run's ``metrics.jsonl``."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def print_steps(rows: list[dict[str, Any]]) -> None:
    """The per-step table of a run's ``metrics.jsonl`` lines, their medians and the median step time."""
    steps = [r for r in rows if r.get("kind") == "train"]
    header = (
        f"{'step':>4} "
        + " ".join(f"{p:>11}" for p in PHASES)
        + f" {'gen tok/s':>9} {'upd tok/s':>9} {'peak RSS':>9}"
    )
    print("seconds per phase (generation is inside rollouts, prefill and decode inside generation)")
    print(header)
    for r in steps:
        cells = " ".join(f"{r['phases'][p]:>11.1f}" if p in r["phases"] else f"{'-':>11}" for p in PHASES)
        gen = r.get("generation_tokens_per_s")
        print(
            f"{r['step']:>4} {cells} {gen if gen is not None else 0:>9.1f} {r['tokens_per_s']:>9.1f}"
            f" {r['peak_rss_mb'] / 1024:>7.2f}GB"
        )

    def median(key: str) -> str:
        values = [r["phases"][key] for r in steps if key in r["phases"]]
        return f"{statistics.median(values):>11.1f}" if values else f"{'-':>11}"

    gens = [r["generation_tokens_per_s"] for r in steps if r.get("generation_tokens_per_s")]
    gen = statistics.median(gens) if gens else 0.0
    update = statistics.median(r["tokens_per_s"] for r in steps)
    peak = max(r["peak_rss_mb"] for r in steps) / 1024
    print(
        f"{'med':>4} " + " ".join(median(p) for p in PHASES) + f" {gen:>9.1f} {update:>9.1f} {peak:>7.2f}GB"
    )
    step_s = statistics.median(r["seconds"] for r in steps)
    print(f"median step {step_s:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
