"""Benchmark: what agl's RL learns against TRL's GRPOTrainer, same model, data, budget and scorer.

The single-call task (bench/ab_arith/: reasoning-gym's basic_arithmetic problems answered directly in one
model call, no tool): SmolLM2-135M-Instruct with the same LoRA adapter (r=8, alpha=16, q/k/v/o_proj),
trained for ``--steps`` steps of ``--tasks-per-step`` problems x ``--group`` sampled completions, at the
same learning rate, sampling temperature (``task.TEMPERATURE``), completion budget (``task.MAX_TOKENS``)
and seed, with the same reward (``task.reward``: 1 right, partial credit for a near number), by

* agl: ``agl train bench/ab_arith/config.yaml`` (the agent calls the gateway with the OpenAI client;
  GRPO advantages, PPO-clip, ``algorithm.loss_norm: rollout``: each completion's mean token loss), and
* TRL: ``GRPOTrainer`` in its own environment (``.venv-trl``, ``bash bench/setup_trl_env.sh``) on the same
  chat messages, with ``loss_type="grpo"`` (each completion's mean token loss), ``scale_rewards="group"``,
  ``beta=0`` (no KL, as agl's ``kl_coef: 0``), ``epsilon=0.2``, ``num_iterations=1``, a constant learning
  rate with AdamW (weight decay 0.01, torch's default, which agl uses), max grad norm 1.0, float32, one
  optimizer step per ``tasks-per-step x group`` completions, the same number of torch threads.

Both adapters, and the base model, are then scored by the same command on the same held-out problems:
``agl eval bench/ab_arith/config.yaml --checkpoint ADAPTER --output FILE`` (greedy decoding, accuracy 1/0
per problem). The change is the paired difference over the held-out problems with its SE. Held-out problems
whose question also appears in training are left out (the script checks and says how many).

Reported per side and seed: held-out accuracy before and after, the change ± paired SE, wall time and CPU
seconds of the training command (``/usr/bin/time``), its peak RSS, and the completions it generated. Runs
one after another (never side by side), so both see the same machine.

    bash bench/setup_trl_env.sh                 # once: TRL in .venv-trl
    python bench/learning_ab.py [--seeds 0 1 2] [--steps 10] [--tasks-per-step 8] [--group 8]
                                [--learning-rate 5e-4] [--out runs/learning_ab] [--sides agl trl]
                                [--agl-set KEY=VALUE ... --agl-label NAME]   # a recipe tried on agl's side
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = ROOT / "bench" / "ab_arith"
CONFIG = TASK_DIR / "config.yaml"
TRAIN = ROOT / "examples" / "calc_autogen" / "gsm" / "arith_train.jsonl"
VAL = ROOT / "examples" / "calc_autogen" / "gsm" / "arith_val.jsonl"
LORA = {"r": 8, "alpha": 16.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
THREADS = 2


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def held_out(out: Path) -> tuple[Path, int]:
    """The held-out file both sides are scored on: VAL without the problems whose question is in TRAIN
    (written to ``out`` when any is dropped); how many were dropped."""
    seen = {t["question"].strip() for t in _read_jsonl(TRAIN)}
    val = _read_jsonl(VAL)
    kept = [t for t in val if t["question"].strip() not in seen]
    if len(kept) == len(val):
        return VAL, 0
    path = out / "val_unseen.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in kept))
    return path, len(val) - len(kept)


# -- measuring a command ---------------------------------------------------------------------------------


def timed(command: list[str], log: Path, env: dict[str, str] | None = None) -> dict[str, float]:
    """Run ``command`` under ``/usr/bin/time -v`` (output to ``log``); its wall and CPU seconds and peak
    RSS. Exits when it fails."""
    with log.open("w") as fh:
        done = subprocess.run(
            ["/usr/bin/time", "-v", *command], stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
    text = log.read_text()
    if done.returncode != 0:
        sys.exit(f"learning_ab: {' '.join(command[:3])} ... failed ({done.returncode}); see {log}")

    def field(name: str) -> str:
        found = re.search(rf"{re.escape(name)}: (.+)", text)
        if found is None:
            sys.exit(f"learning_ab: /usr/bin/time printed no {name!r} in {log}")
        return found.group(1).strip()

    clock = [float(x) for x in field("Elapsed (wall clock) time (h:mm:ss or m:ss)").split(":")]
    wall = sum(v * 60**i for i, v in enumerate(reversed(clock)))
    cpu = float(field("User time (seconds)")) + float(field("System time (seconds)"))
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_rss_gib": int(field("Maximum resident set size (kbytes)")) / 2**20,
    }


def agl(*args: str) -> list[str]:
    return [sys.executable, "-m", "agl_core.cli", *args]


def score(checkpoint: Path | None, val: Path, out: Path, name: str) -> dict[str, float]:
    """Held-out accuracy per task of ``checkpoint`` (the base model when ``None``), via ``agl eval``."""
    scores = out / f"{name}.jsonl"
    if not scores.is_file():
        command = agl("eval", str(CONFIG), "--tasks", str(val), "--output", str(scores))
        if checkpoint is not None:
            command += ["--checkpoint", str(checkpoint)]
        timed(command, out / f"{name}.eval.log")
    return {row["task_id"]: float(row["score"] or 0.0) for row in _read_jsonl(scores)}


def paired(before: dict[str, float], after: dict[str, float]) -> tuple[float, float, float, int]:
    """(after's mean, change, paired SE of the change, n) over the tasks both scored."""
    common = sorted(set(before) & set(after))
    diffs = [after[t] - before[t] for t in common]
    n = len(diffs)
    se = statistics.stdev(diffs) / math.sqrt(n) if n > 1 else float("nan")
    return statistics.fmean(after[t] for t in common), statistics.fmean(diffs), se, n


# -- the two sides -----------------------------------------------------------------------------------------


def run_agl(args: argparse.Namespace, seed: int, out: Path) -> tuple[Path, dict[str, float]]:
    run = out / f"{args.agl_label}-seed{seed}"
    sets = {
        "output_dir": run,
        "train.seed": seed,
        "train.steps": args.steps,
        "train.tasks_per_step": args.tasks_per_step,
        "train.rollouts_per_task": args.group,
        "train.threads": THREADS,
        "algorithm.learning_rate": args.learning_rate,
    }
    command = agl("train", str(CONFIG), "--overwrite")
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    for extra in args.agl_set:  # a recipe to try on agl's side (not a setting both sides share)
        command += ["--set", extra]
    figures = timed(command, out / f"{args.agl_label}-seed{seed}.train.log")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    figures["completions"] = sum(r.get("rollouts", 0) for r in rows if r.get("kind") == "train")
    return run, figures


def run_trl(
    args: argparse.Namespace, seed: int, out: Path, model_dir: str, tokenizer_dir: str
) -> tuple[Path, dict[str, float]]:
    run = out / f"trl-seed{seed}"
    spec = {
        "model_dir": model_dir,
        "tokenizer_dir": tokenizer_dir,
        "train": str(TRAIN),
        "task_dir": str(TASK_DIR),
        "output_dir": str(run),
        "seed": seed,
        "steps": args.steps,
        "tasks_per_step": args.tasks_per_step,
        "group": args.group,
        "learning_rate": args.learning_rate,
        "threads": THREADS,
        "lora": LORA,
    }
    spec_path = out / f"trl-seed{seed}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    figures = timed(
        [args.trl_python, str(Path(__file__).resolve()), "--trl-worker", str(spec_path)],
        out / f"trl-seed{seed}.train.log",
        env=env,
    )
    figures["completions"] = json.loads((run / "completions.json").read_text())["completions"]
    return run, figures


def trl_worker(spec_path: str) -> int:
    """TRL's side, in .venv-trl: GRPOTrainer on the same problems, reward and LoRA; saves the adapter."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    import datasets
    import peft
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, spec["task_dir"])
    import task  # bench/ab_arith/task.py: the same messages and reward as agl's agent

    rows = _read_jsonl(Path(spec["train"]))
    dataset = datasets.Dataset.from_list(
        [{"prompt": task.messages(r["question"]), "answer": str(r["answer"])} for r in rows]
    )
    generated = [0]

    def reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        generated[0] += len(completions)
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        return [task.reward(text, a) for text, a in zip(texts, answer, strict=True)]

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    batch = spec["tasks_per_step"] * spec["group"]
    config = trl.GRPOConfig(
        output_dir=spec["output_dir"] + "-trainer",
        use_cpu=True,
        seed=spec["seed"],
        max_steps=spec["steps"],
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=spec["group"],
        max_completion_length=task.MAX_TOKENS,
        temperature=task.TEMPERATURE,
        num_iterations=1,
        beta=0.0,
        loss_type="grpo",
        epsilon=0.2,
        scale_rewards="group",
        learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=0.01,
        max_grad_norm=1.0,
        bf16=False,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
    )
    lora = peft.LoraConfig(
        r=spec["lora"]["r"],
        lora_alpha=spec["lora"]["alpha"],
        lora_dropout=0.0,
        target_modules=spec["lora"]["target_modules"],
        task_type="CAUSAL_LM",
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
    )
    trainer.train()
    out = Path(spec["output_dir"])
    trainer.model.save_pretrained(str(out))
    (out / "completions.json").write_text(json.dumps({"completions": generated[0]}))
    print(f"trl: {generated[0]} completions, adapter in {out}", flush=True)
    return 0


# -- the table ---------------------------------------------------------------------------------------------


def table(results: list[dict[str, Any]], base_mean: float, n: int) -> list[str]:
    lines = [
        f"held-out: {n} problems, base model {base_mean:.3f}",
        "| side | seed | after | change ± paired SE | wall | CPU s | peak RSS | completions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['side']} | {r['seed']} | {r['after']:.3f} | {r['change']:+.3f} ± {r['se']:.3f} |"
            f" {r['wall_s'] / 60:.1f} min | {r['cpu_s']:.0f} | {r['peak_rss_gib']:.2f} GiB |"
            f" {r['completions']} |"
        )
    for side in sorted({r["side"] for r in results}):
        mine = [r for r in results if r["side"] == side]
        if len(mine) > 1:
            changes = [r["change"] for r in mine]
            lines.append(
                f"{side}: mean change over {len(mine)} seeds {statistics.fmean(changes):+.3f}"
                f" (seed-to-seed SD {statistics.stdev(changes):.3f}); median wall"
                f" {statistics.median(r['wall_s'] for r in mine) / 60:.1f} min"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--sides", nargs="+", choices=["agl", "trl"], default=["agl", "trl"])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "learning_ab")
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    parser.add_argument(
        "--agl-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an agl setting to try (e.g. algorithm.loss_norm=token), reported under --agl-label",
    )
    parser.add_argument("--agl-label", default="agl", help="the name of agl's side in the table and files")
    parser.add_argument("--trl-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    for name in ("steps", "tasks_per_step", "group"):
        if getattr(args, name) < 1 or (name == "group" and args.group < 2):
            parser.error(f"--{name.replace('_', '-')} must be at least {2 if name == 'group' else 1}")
    if not 0 < args.learning_rate < 1:
        parser.error("--learning-rate must be in (0, 1)")
    if not re.fullmatch(r"[A-Za-z0-9_.]+", args.agl_label) or args.agl_label == "trl":
        parser.error("--agl-label: letters, digits, '_' and '.' only, and not 'trl'")
    bad = [x for x in args.agl_set if "=" not in x]
    if bad:
        parser.error(f"--agl-set {bad[0]}: give KEY=VALUE")
    if "trl" in args.sides and not Path(args.trl_python).is_file():
        parser.error(f"{args.trl_python} not found: run bash bench/setup_trl_env.sh first")
    if not Path("/usr/bin/time").is_file():
        parser.error("/usr/bin/time is needed (GNU time) to measure each side's command")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    val, dropped = held_out(out)
    print(f"held-out: {val} ({dropped} problems dropped whose question is in training)", flush=True)
    model_dir = tokenizer_dir = ""
    if "trl" in args.sides:
        from agl_trainer.model import load_policy

        model, tokenizer = load_policy("smollm2")  # converts once into agl's cache: TRL loads the same files
        model_dir, tokenizer_dir = model.name_or_path, tokenizer.name_or_path
        del model
    base = score(None, val, out, "base")
    results: list[dict[str, Any]] = []
    for seed in args.seeds:
        for side in args.sides:
            started = time.monotonic()
            if side == "agl":
                name = args.agl_label
                checkpoint, figures = run_agl(args, seed, out)
            else:
                name = side
                checkpoint, figures = run_trl(args, seed, out, model_dir, tokenizer_dir)
            after = score(checkpoint, val, out, f"{name}-seed{seed}")
            mean, change, se, n = paired(base, after)
            results.append({"side": name, "seed": seed, "after": mean, "change": change, "se": se, **figures})
            print(
                f"{name} seed {seed}: held-out {statistics.fmean(base.values()):.3f} -> {mean:.3f},"
                f" change {change:+.3f} ± {se:.3f} (paired SE, n={n}); train {figures['wall_s'] / 60:.1f} min"
                f" wall, {figures['cpu_s']:.0f} CPU s, {figures['peak_rss_gib']:.2f} GiB,"
                f" {figures['completions']} completions ({time.monotonic() - started:.0f}s with scoring)",
                flush=True,
            )
            (
                out / f"results-{'-'.join([args.agl_label if s == 'agl' else s for s in args.sides])}.json"
            ).write_text(json.dumps(results, indent=2))
    for line in table(results, statistics.fmean(base.values()), len(base)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
