"""Benchmark: the main job's held-out result, seed by seed, for an earlier commit and the code as it stands.

A change meant to make training faster or leaner must not make it learn less. One run says little: the
main job ends anywhere from 0.64 to 0.97 held-out depending on its sampling. With ``train.seed`` seeding
every sampled call (the transformers backend's seeds per prompt), a seed fixes a run's rollouts, so two
versions of the trainer given the same seed sample the same responses for as long as their numbers agree,
and any difference in what they learn shows up seed by seed instead of drowning in the spread between
seeds.

For each seed, this runs the main job (``agl train examples/calc_autogen/config.yaml``) twice: once in a
git worktree of ``--base`` (with ``--patch`` applied: a commit from before seeded sampling needs it, see
``bench/patches/``), imported ahead of the installed package, and once on this checkout, both in this
interpreter's environment. It prints, per seed, each side's held-out reward after training, wall time and
peak resident memory, then the mean over seeds, the difference paired by seed and by held-out task, and
last the verdict: a held-out loss is a mean difference below zero by more than twice its paired standard
error (over every seed's held-out tasks). The runs of a seed are paired only while they take the same
path: two versions whose numbers round differently (another kernel, another batch shape) sample the same
tokens until one draw lands on a neighbouring token, after which they are independent runs of the job.
The table says for how many steps each seed's runs went alike; when any parted, the verdict uses the
spread of the seed-level differences instead (and one such seed decides nothing).

    python bench/held_out_ab.py --base 3fcd040 --patch bench/patches/seeded_sampling_3fcd040.patch \\
        --seeds 0,1,2,3 [--out runs/held_out_ab] [--set KEY=VALUE ...]
    python bench/held_out_ab.py --report runs/held_out_ab      # the table of runs already finished

Runs left in ``--out`` (``base-SEED``, ``current-SEED``) are reported, not run again, so an interrupted
comparison resumes. A full main job takes 9-25 minutes on 2 cores; the sides run one after the other.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from main_job_profile import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = Path("examples") / "calc_autogen" / "config.yaml"
SIDES = ("base", "current")
RESULT = "ab.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the earlier commit (any git revision)")
    parser.add_argument("--patch", help="a patch applied to the base worktree (git apply)")
    parser.add_argument("--seeds", default="0,1,2,3", help="comma-separated train.seed values (0,1,2,3)")
    parser.add_argument("--out", default="runs/held_out_ab", help="where the runs go (runs/held_out_ab)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides")
    parser.add_argument("--report", metavar="OUT", help="only report the finished runs in OUT")
    args = parser.parse_args(argv)
    if args.report:
        out = Path(args.report)
        if not out.is_dir():
            parser.error(f"--report: no directory {out} (give the --out of an earlier comparison)")
        return report(out)
    if not args.base:
        parser.error("--base is required (the commit to compare against), or --report OUT")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: give integers separated by commas, e.g. 0,1,2,3")
    if not seeds:
        parser.error("--seeds: give at least one seed")
    patch = Path(args.patch).resolve() if args.patch else None
    if patch is not None and not patch.is_file():
        parser.error(f"--patch: no file {patch}")
    for item in args.set:
        if "=" not in item:
            parser.error(f"--set {item!r}: write KEY=VALUE")
    try:
        base_commit = _git("rev-parse", "--verify", f"{args.base}^{{commit}}")
    except subprocess.CalledProcessError:
        parser.error(f"--base {args.base!r} is not a commit of this repository")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tree = out / "base-tree"
    pending = []
    for seed in seeds:
        for side in SIDES:
            if (out / f"{side}-{seed}" / RESULT).is_file():
                print(f"{side} seed {seed}: finished earlier, reported as it is", flush=True)
            else:
                pending.append((seed, side))
    if any(side == "base" for _, side in pending):
        _base_tree(tree, base_commit, patch)
    try:
        for seed, side in pending:
            run_dir = out / f"{side}-{seed}"
            source = tree if side == "base" else ROOT
            print(f"{side} seed {seed}: running in {source} ...", flush=True)
            if not _run(source, run_dir, seed, args.set):
                return 1
    finally:
        if tree.exists():
            _git("worktree", "remove", "--force", str(tree), check=False)
    return report(out)


def _git(*args: str, check: bool = True) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=check)
    return done.stdout.strip()


def _base_tree(tree: Path, commit: str, patch: Path | None) -> None:
    """A worktree of ``commit`` at ``tree`` with ``patch`` applied (a fresh one each time)."""
    if tree.exists():
        _git("worktree", "remove", "--force", str(tree), check=False)
    _git("worktree", "prune")
    _git("worktree", "add", "--detach", str(tree), commit)
    if patch is not None:
        subprocess.run(["git", "apply", str(patch)], cwd=tree, check=True)


def _run(source: Path, run_dir: Path, seed: int, overrides: list[str]) -> bool:
    """One main job from ``source``'s code into ``run_dir``; its figures in ``run_dir/ab.json``."""
    env = dict(os.environ)
    # the packages of ``source`` ahead of whatever this environment installed (an editable checkout)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(source / "src"), str(source / "trainer")] + [p for p in [env.get("PYTHONPATH")] if p]
    )
    command = [sys.executable, "-m", "agl_core.cli", "train", str(CONFIG), "--overwrite"]
    for item in [f"output_dir={run_dir}", f"train.seed={seed}", "logging.progress=plain", *overrides]:
        command += ["--set", item]
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with (run_dir / "agl.log").open("w") as log:
        process = subprocess.Popen(command, cwd=source, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    wall = time.monotonic() - started
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        print(f"  failed (exit {code}); its output: {run_dir / 'agl.log'}", file=sys.stderr)
        return False
    metrics = run_dir / "metrics.jsonl"
    held_out = [r for r in read_metrics(metrics) if r.get("kind") == "val"] if metrics.is_file() else []
    if len(held_out) < 2:
        print(f"  no held-out result before and after training in {run_dir}/metrics.jsonl", file=sys.stderr)
        return False
    result = {
        "seed": seed,
        "wall_s": round(wall, 1),
        # ru_maxrss is in KiB on Linux: the job's process (its own children, if any, are waited by it)
        "peak_rss_kib": usage.ru_maxrss,
        "before": held_out[0]["task_scores"],
        "after": held_out[-1]["task_scores"],
        "steps": [_path(row) for row in read_metrics(metrics) if row.get("kind") == "train"],
    }
    (run_dir / RESULT).write_text(json.dumps(result))
    print(f"  held-out {_mean(result['after']):.3f} after, {wall / 60:.1f} min", flush=True)
    return True


def _path(row: dict[str, Any]) -> dict[str, Any]:
    """What a training step did, to tell whether two runs took the same path (the tasks it drew, the
    rollouts and transitions it trained on, their mean reward and the update's gradient norm)."""
    return {
        key: row.get(key) for key in ("tasks", "rollouts", "trained_transitions", "mean_reward", "grad_norm")
    }


def same_steps(base: list[dict[str, Any]], current: list[dict[str, Any]]) -> int:
    """How many first steps the two runs took alike: the same tasks, rollouts, trained transitions and
    mean reward, and gradient norms within 1e-3 of each other (relative). Runs of two versions of the
    trainer sample alike only for as long as their numbers round alike: once one draw lands on another
    token, the runs go on as independent samples of the job."""
    same = 0
    for b, c in zip(base, current, strict=False):
        exact = all(b[k] == c[k] for k in ("tasks", "rollouts", "trained_transitions"))
        reward = b["mean_reward"] == c["mean_reward"] or (
            b["mean_reward"] is not None
            and c["mean_reward"] is not None
            and abs(b["mean_reward"] - c["mean_reward"]) < 1e-9
        )
        gb, gc = b["grad_norm"], c["grad_norm"]
        grad = gb == gc or (
            gb is not None and gc is not None and abs(gb - gc) <= 1e-3 * max(abs(gb), abs(gc))
        )
        if not (exact and reward and grad):
            break
        same += 1
    return same


def _mean(scores: dict[str, float]) -> float:
    return statistics.fmean(scores.values())


def report(out: Path) -> int:
    """The table of the finished runs in ``out`` and the verdict; 1 when a held-out loss shows."""
    results: dict[tuple[str, int], dict[str, Any]] = {}
    for path in sorted(out.glob(f"*-*/{RESULT}")):
        side, _, number = path.parent.name.rpartition("-")
        if side in SIDES and number.lstrip("-").isdigit():
            results[(side, int(number))] = json.loads(path.read_text())
    seeds = sorted(
        {seed for side, seed in results if (("base", seed) in results and ("current", seed) in results)}
    )
    if not seeds:
        print(f"no seed has finished on both sides in {out}", file=sys.stderr)
        return 1
    print("held-out reward after training, wall time and peak resident memory by seed (base | current)")
    print(f"{'seed':>4} {'base':>7} {'current':>7} {'diff':>7}   {'wall':>17}   {'peak RSS':>17}   same path")
    means: list[tuple[float, float]] = []
    task_diffs: list[float] = []
    parted: list[int] = []
    for seed in seeds:
        base, current = results[("base", seed)], results[("current", seed)]
        b, c = _mean(base["after"]), _mean(current["after"])
        means.append((b, c))
        shared = sorted(set(base["after"]) & set(current["after"]))
        task_diffs += [current["after"][t] - base["after"][t] for t in shared]
        path = "-"
        if "steps" in base and "steps" in current:
            steps = max(len(base["steps"]), len(current["steps"]))
            alike = same_steps(base["steps"], current["steps"])
            path = f"{alike}/{steps} steps"
            if alike < steps:
                parted.append(seed)
        print(
            f"{seed:>4} {b:>7.3f} {c:>7.3f} {c - b:>+7.3f}"
            f"   {base['wall_s'] / 60:>6.1f} | {current['wall_s'] / 60:>4.1f} min"
            f"   {base['peak_rss_kib'] / 2**20:>6.2f} | {current['peak_rss_kib'] / 2**20:>4.2f} GiB   {path}"
        )
    base_mean = statistics.fmean(b for b, _ in means)
    current_mean = statistics.fmean(c for _, c in means)
    difference = statistics.fmean(task_diffs)
    se = statistics.stdev(task_diffs) / math.sqrt(len(task_diffs)) if len(task_diffs) > 1 else 0.0
    higher = sum(1 for b, c in means if c - b >= 1e-9)
    lower = sum(1 for b, c in means if c - b <= -1e-9)
    same = len(means) - higher - lower
    print(
        f"mean over {len(seeds)} seed(s): base {base_mean:.3f}, current {current_mean:.3f}; current the"
        f" same for {same}, higher for {higher}, lower for {lower}"
    )
    if parted:
        return _seed_verdict(means, parted)
    return _verdict(difference, se, f"paired SE over {len(task_diffs)} seed x task pairs")


def _seed_verdict(means: list[tuple[float, float]], parted: list[int]) -> int:
    """The verdict when some seeds' runs took different paths: those pairs are independent runs, whose
    difference varies as much as the job's result between seeds, so the error is that of the seed-level
    differences (the task-level pairing would understate it). One seed cannot tell a loss from chance."""
    seeds = ", ".join(map(str, parted))
    print(
        f"the runs of seed(s) {seeds} took different paths (a sampled token rounded differently), so they"
        " compare independent runs: the error below is over seeds, not tasks"
    )
    diffs = [c - b for b, c in means]
    difference = statistics.fmean(diffs)
    if len(diffs) < 2:
        print(
            f"held-out difference (current - base) {difference:+.3f} over 1 seed: one run cannot tell a loss"
            " from chance; run more seeds (--seeds 0,1,2,3)"
        )
        return 1
    return _verdict(
        difference, statistics.stdev(diffs) / math.sqrt(len(diffs)), f"SE over {len(diffs)} seeds"
    )


def _verdict(difference: float, se: float, error: str) -> int:
    """Print the verdict line; 1 when ``difference`` lies more than two ``se`` below zero."""
    loss = difference < -2 * se
    verdict = f"a held-out loss, {-2 * se - difference:.3f} below -2 SE" if loss else "no held-out loss"
    print(
        f"held-out difference (current - base) {difference:+.3f} ± {se:.3f} ({error}): {verdict}"
        " (target: not below -2 SE)"
    )
    return 1 if loss else 0


if __name__ == "__main__":
    sys.exit(main())
