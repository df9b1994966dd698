"""Benchmark: asynchronous against synchronous training, the same agent, data and seed, in one run.

The agent makes one LLM call, then waits on a "tool" whose latency has a long tail (log-normal: median
``--tool-median`` seconds, sigma ``--tool-sigma``; with the defaults the slowest of 16 calls takes about 7x
the median, as web search or SQL do). Each rollout's latency is drawn from a generator seeded by its task
and its place in the task's group, so both modes wait on the same tools. The reward is learnable by the
policy: the share of the reply's characters that are lower-case ASCII letters.

Both runs use the trainer's whole path (embedded store, gateway, runner, update) with the tiny random
model and a LoRA adapter, ``--steps`` steps of ``--tasks`` tasks x ``--rollouts`` rollouts, the same
runner workers; sync is ``train.mode: sync``, async is ``train.mode: async`` with
``train.max_staleness: --staleness``. Figures per mode:

* rollouts/s: rollouts trained on (succeeded, in the steps' batches) per second of the training steps;
* wall time to N updates: from the first step's start to the last step's end;
* held-out reward: the validation score after training (mean ± SE over the held-out tasks, greedy).

Target (the issue): async at least 1.5x the rollouts/s of sync, at a held-out reward within noise of
sync's (the paired difference within 2 SE).

    python bench/async_vs_sync.py [--steps 12] [--tasks 4] [--rollouts 4] [--workers 32] [--staleness 1]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TARGET_SPEEDUP = 1.5


class LongTailAgent:
    """One LLM call, then a tool with log-normal latency; rewarded by the reply's text."""

    def __init__(self, median_s: float, sigma: float) -> None:
        self.median_s = median_s
        self.sigma = sigma
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, task: dict[str, Any], llm: Any) -> float:
        import openai

        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
        reply = client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=8
        )
        # the same task's k-th rollout waits as long in both modes
        with self._lock:
            k = self._seen.get(task["id"], 0)
            self._seen[task["id"]] = k + 1
        latency = self.median_s * math.exp(self.sigma * random.Random(f"{task['id']}:{k}").gauss(0.0, 1.0))
        time.sleep(min(latency, 30.0))
        return reward(reply.choices[0].message.content or "")


def reward(text: str) -> float:
    """The share of the reply's characters that are lower-case ASCII letters (the random policy scores
    about a third; a policy can learn to score more)."""
    return sum(1 for c in text if "a" <= c <= "z") / len(text) if text else 0.0


def run_mode(
    mode: str, args: argparse.Namespace, tasks: list[dict[str, Any]], val: list[dict[str, Any]]
) -> dict[str, Any]:
    from agl_trainer import Trainer

    train: dict[str, Any] = {
        "steps": args.steps,
        "tasks_per_step": args.tasks,
        "rollouts_per_task": args.rollouts,
        "seed": args.seed,
        "mode": mode,
    }
    if mode == "async":
        train["max_staleness"] = args.staleness
    out = Path(tempfile.mkdtemp(prefix=f"agl-bench-{mode}-"))
    config = {
        "model": {"source": "tiny", "lora": {"r": 8, "alpha": 16}},
        "gateway": {"default_max_tokens": 8},
        "algorithm": {"name": "grpo", "learning_rate": args.lr},
        "train": train,
        "runner": {"workers": args.workers, "mode": "thread", "step_timeout_s": 120},
        "validation": {"before": False, "after": True, "rollouts_per_task": 1},
        "logging": {"plot": False, "tensorboard": False, "progress": "plain"},
        "output_dir": str(out),
    }
    agent = LongTailAgent(args.tool_median, args.tool_sigma)
    started = time.monotonic()
    result = Trainer(config, echo=lambda line: None).fit(agent, tasks, val)
    total = time.monotonic() - started
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    step_s = sum(r["seconds"] for r in train_rows)
    rollouts = sum(r["rollouts"] for r in train_rows)
    after = result.after
    return {
        "mode": mode,
        "rollouts": rollouts,
        "step_s": step_s,
        "rollouts_per_s": rollouts / step_s if step_s else 0.0,
        "total_s": total,
        "held_out": after.mean if after else float("nan"),
        "held_out_se": after.se if after else float("nan"),
        "task_scores": after.task_scores if after else {},
        "dropped": sum((r.get("pipeline") or {}).get("dropped_groups", 0) for r in train_rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--tasks", type=int, default=4, help="tasks per step")
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts per task")
    parser.add_argument("--workers", type=int, default=32, help="runner workers (both modes)")
    parser.add_argument("--staleness", type=int, default=1, help="train.max_staleness of the async run")
    parser.add_argument("--tool-median", type=float, default=0.3, help="median tool latency, seconds")
    parser.add_argument("--tool-sigma", type=float, default=1.0, help="log-normal sigma of the latency")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--val", type=int, default=40, help="held-out tasks")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("steps", "tasks", "rollouts", "workers", "val"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.tool_median <= 0 or args.tool_sigma < 0:
        parser.error("--tool-median must be above 0 and --tool-sigma at least 0")

    tasks = [{"id": f"t{i}", "q": f"Write item {i} of the list."} for i in range(200)]
    val = [{"id": f"v{i}", "q": f"Write entry {i} of the table."} for i in range(args.val)]
    results = [run_mode(mode, args, tasks, val) for mode in ("sync", "async")]
    print(
        f"{'mode':<6} {'rollouts':>8} {'step time s':>11} {'rollouts/s':>10} {'held-out':>16} {'dropped':>7}"
    )
    for r in results:
        print(
            f"{r['mode']:<6} {r['rollouts']:>8} {r['step_s']:>11.1f} {r['rollouts_per_s']:>10.2f}"
            f" {r['held_out']:>8.3f} ± {r['held_out_se']:.3f} {r['dropped']:>7}"
        )
    sync, async_ = results
    speedup = async_["rollouts_per_s"] / sync["rollouts_per_s"] if sync["rollouts_per_s"] else float("nan")
    common = sorted(set(sync["task_scores"]) & set(async_["task_scores"]))
    diffs = [async_["task_scores"][t] - sync["task_scores"][t] for t in common]
    mean = sum(diffs) / len(diffs) if diffs else float("nan")
    se = (
        math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
        if len(diffs) > 1
        else float("nan")
    )
    within = abs(mean) <= 2 * se if se == se and se > 0 else mean == 0
    print(f"wall time to {args.steps} updates: sync {sync['step_s']:.1f}s, async {async_['step_s']:.1f}s")
    print(f"held-out change async - sync: {mean:+.3f} ± {se:.3f} (paired SE, n={len(diffs)})")
    verdict = "met" if speedup >= TARGET_SPEEDUP and within else "MISSED"
    print(
        f"async/sync rollouts per second: {speedup:.2f}x (target {TARGET_SPEEDUP}x,"
        f" held-out within noise: {'yes' if within else 'no'}): {verdict}"
        + ("" if speedup >= TARGET_SPEEDUP else f" by {TARGET_SPEEDUP - speedup:.2f}x")
    )
    return 0 if verdict == "met" else 1


if __name__ == "__main__":
    sys.exit(main())
