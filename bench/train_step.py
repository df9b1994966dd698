"""Benchmark: training tokens per second of one policy-update step, agl against TRL's GRPOTrainer.

Both sides train SmolLM2-135M-Instruct (the float32 safetensors that ``load_policy("smollm2")`` converts once
into agl's model cache) with the same LoRA adapter (agl's default: r=8, alpha=16, no dropout, on
q/k/v/o_proj), on the same batch: ``--sequences`` sequences in groups of ``--group-size`` completions of one
prompt, every prompt ``--prompt-tokens`` and every completion ``--completion-tokens`` fixed token ids (so no
padding on either side), the same rewards, the same number of sequences per forward pass (``--micro-batch``),
on CPU with the same number of torch threads. One step is what an optimizer update costs once the
completions exist: forward and backward of the clipped policy-gradient loss over every micro-batch, gradient
clipping, one AdamW step, zeroing the gradients (clip epsilon, max grad norm and learning rate: agl's config
defaults, 0.2, 1.0 and 1e-4, on both sides).

* agl: ``update_step`` (trainer/agl_trainer/learning/update.py) on ``Advantaged`` samples from
  ``compute_advantages`` (GRPO advantages), each wrapping a ``Transition`` with the behaviour logprobs the
  gateway would have recorded (those of the initial policy), in this process.
* TRL: ``GRPOTrainer.train()`` in its own environment (``.venv-trl``, a subprocess), with
  ``rollout_func`` (TRL's hook for a custom generation backend) returning the same fixed token ids instead
  of sampling, ``beta=0`` (no reference model; agl's ``kl_coef`` is 0 too), ``num_iterations=1`` (one update
  per generation batch, so no extra forward for old logprobs), ``loss_type="grpo"`` (mean over each
  sequence's tokens, then over sequences, as agl normalises), ``bf16=False`` and
  ``gradient_checkpointing=False`` (TRL's defaults turn both on; agl trains float32 without checkpointing on
  CPU), a constant learning rate, plain ``adamw_torch``. A callback times each optimizer step from
  ``on_step_begin`` to ``on_step_end`` (the trainer's own forward/backward, clipping, optimizer and scheduler
  step), and the time TRL spends in ``_generate_and_score_completions`` inside it (the fixed rollout, reward,
  advantages: work agl does before ``update_step``) is subtracted, in TRL's favour.

The two sides alternate step by step (one waits while the other runs), so a change of load on a shared
machine touches both alike. Tokens counted: prompt + completion tokens of the batch per step (every one goes
through forward and backward on both sides); the completion-token rate is shown too. Times are medians over
``--repeats`` steps after ``--warmup`` steps, wall-clock and, as a check less sensitive to other load on a
shared machine, the CPU time of the side's process. Both sides must change their LoRA weights (checked).

agl runs the prompt a group's completions share once, its keys and values (with gradients) under every
completion (the same loss and gradients; tests/test_update.py checks it), where TRL runs each sequence
whole: part of the difference is that.

Headline: agl's tokens/s over TRL's, wall-clock and per CPU second; target >= 1.5x on both. Exits non-zero
when missed. Measured 2026-11-25 on 2 cores: 247 against 141 tokens/s, 1.74x (1.75x per CPU second); again
later that day at the code of the runner's idle-polling fix, the machine slower for both: 186 against 104
tokens/s, 1.79x (1.79x per CPU second).

    bash bench/setup_trl_env.sh [AGL_PYTHON]      # once: TRL in .venv-trl, beside agl's environment
    python bench/train_step.py [--sequences 8] [--group-size 4] [--prompt-tokens 64] [--completion-tokens 64]
                               [--micro-batch 8] [--threads 1] [--repeats 5] [--warmup 1] [--trl-python PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET_RATIO = 1.5
ROOT = Path(__file__).resolve().parent.parent
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
#: Lines of the TRL worker meant for this script (the libraries may print on stdout too).
TAG = "@@train-step "


# -- the shared batch ------------------------------------------------------------------------------------


def make_batch(args: argparse.Namespace) -> dict[str, Any]:
    """Fixed token ids and rewards: ``groups`` prompts, ``group_size`` completions each, distinct rewards."""
    rng = random.Random(args.seed)
    groups = args.sequences // args.group_size
    # ids well inside the vocabulary, away from the special tokens at its start
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)] for _ in range(groups)]
    completions = [
        [[rng.randrange(1000, 40000) for _ in range(args.completion_tokens)] for _ in range(args.group_size)]
        for _ in range(groups)
    ]
    rewards = [[float(k % 3) + 0.25 * g for k in range(args.group_size)] for g in range(groups)]
    return {"prompts": prompts, "completions": completions, "rewards": rewards}


# -- TRL's side (runs in .venv-trl; imports nothing from agl) ---------------------------------------------


def _emit(payload: dict[str, Any]) -> None:
    sys.stdout.write(TAG + json.dumps(payload) + "\n")
    sys.stdout.flush()


def trl_worker(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func is marked experimental
    import torch

    torch.set_num_threads(spec["threads"])
    import datasets
    import peft
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    batch = spec["batch"]
    groups = len(batch["prompts"])
    group_size = len(batch["completions"][0])
    reward_of = {
        tuple(c): batch["rewards"][g][k] for g in range(groups) for k, c in enumerate(batch["completions"][g])
    }

    def rollout(prompts: list[str], trainer: Any) -> dict[str, Any]:
        """The fixed completions instead of sampling: the k-th occurrence of prompt g gets
        completion k of g."""
        seen: dict[str, int] = {}
        prompt_ids, completion_ids = [], []
        for prompt in prompts:
            g = int(prompt.removeprefix("group-"))
            k = seen.get(prompt, 0)
            seen[prompt] = k + 1
            prompt_ids.append(list(batch["prompts"][g]))
            completion_ids.append(list(batch["completions"][g][k % group_size]))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    def reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
        return [reward_of[tuple(ids)] for ids in completion_ids]

    class TimedGRPOTrainer(trl.GRPOTrainer):
        generate_s = generate_cpu_s = 0.0

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            start, start_cpu = time.perf_counter(), time.process_time()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self.generate_s += time.perf_counter() - start
                self.generate_cpu_s += time.process_time() - start_cpu

    class Pace(TrainerCallback):
        """Waits for the parent's go before each optimizer step, then reports how long the step took."""

        started = started_cpu = 0.0
        tokens_before = threads = 0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            command = sys.stdin.readline().strip()
            if command != "go":
                raise SystemExit(f"train_step worker: expected 'go', got {command!r}")
            trainer.generate_s = trainer.generate_cpu_s = 0.0
            self.tokens_before = state.num_input_tokens_seen
            self.threads = torch.get_num_threads()
            self.started, self.started_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seconds, cpu_seconds = time.perf_counter() - self.started, time.process_time() - self.started_cpu
            _emit(
                {
                    "seconds": seconds - trainer.generate_s,
                    "cpu_seconds": cpu_seconds - trainer.generate_cpu_s,
                    "generate_seconds": trainer.generate_s,
                    "threads": self.threads,
                    "tokens": state.num_input_tokens_seen - self.tokens_before,
                }
            )

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    sequences = groups * group_size
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="agl-bench-trl-"),
        use_cpu=True,
        seed=spec["seed"],
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=sequences // spec["micro_batch"],
        num_generations=group_size,
        max_completion_length=len(batch["completions"][0][0]),
        num_iterations=1,
        beta=0.0,
        loss_type="grpo",
        epsilon=spec["clip_eps"],
        scale_rewards="group",
        learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=0.01,  # torch.optim.AdamW's default, which agl uses
        max_grad_norm=spec["max_grad_norm"],
        bf16=False,
        gradient_checkpointing=False,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
    )
    lora = peft.LoraConfig(
        r=spec["lora_r"],
        lora_alpha=spec["lora_alpha"],
        lora_dropout=0.0,
        target_modules=LORA_TARGETS,
        task_type="CAUSAL_LM",
    )
    dataset = datasets.Dataset.from_dict({"prompt": [f"group-{g}" for g in range(groups)]})
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        rollout_func=rollout,
        callbacks=[Pace()],
    )
    lora_params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in lora_params.items()}
    _emit(
        {
            "ready": True,
            "trainable": sum(p.numel() for p in lora_params.values()),
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "peft": peft.__version__,
                "trl": trl.__version__,
            },
        }
    )
    trainer.train()
    changed = max(float((p.detach() - before[n]).abs().max()) for n, p in lora_params.items())
    _emit({"done": True, "lora_max_change": changed})
    return 0


# -- agl's side ------------------------------------------------------------------------------------------


class AglSide:
    def __init__(self, args: argparse.Namespace, batch: dict[str, Any]) -> None:
        import torch
        from peft import LoraConfig, get_peft_model

        from agl_core.records import Transition
        from agl_trainer.config import AlgorithmConfig
        from agl_trainer.config import LoraConfig as AglLora
        from agl_trainer.learning.algo import compute_advantages
        from agl_trainer.learning.update import response_logprobs
        from agl_trainer.model import load_policy

        torch.manual_seed(args.seed)
        lora = AglLora()
        if lora.target_modules != LORA_TARGETS:
            raise SystemExit(
                f"agl's default LoRA targets changed to {lora.target_modules}; update LORA_TARGETS"
            )
        self.lora_r, self.lora_alpha = lora.r, lora.alpha
        model, tokenizer = load_policy("smollm2")
        # where load_policy read them from: TRL's side loads the same files
        self.model_dir, self.tokenizer_dir = model.name_or_path, tokenizer.name_or_path
        self.model = get_peft_model(
            model,
            LoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=list(lora.target_modules),
                task_type="CAUSAL_LM",
            ),
        )
        self.trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        algorithm = AlgorithmConfig()
        self.learning_rate, self.clip_eps, self.max_grad_norm = (
            algorithm.learning_rate,
            algorithm.clip_eps,
            algorithm.max_grad_norm,
        )
        self.optimizer = torch.optim.AdamW(list(self.trainable.values()), lr=self.learning_rate)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        transitions, group_of = [], {}
        for g, prompt in enumerate(batch["prompts"]):
            for k, completion in enumerate(batch["completions"][g]):
                rollout_id = f"ro-{g}-{k}"
                group_of[rollout_id] = f"group-{g}"
                transitions.append(
                    Transition(
                        rollout_id,
                        None,
                        f"task-{g}",
                        0,
                        tuple(prompt),
                        tuple(completion),
                        None,
                        batch["rewards"][g][k],
                    )
                )
        samples, _ = compute_advantages(transitions, group_of, "grpo")
        if len(samples) != args.sequences:
            raise SystemExit(f"expected {args.sequences} samples with advantages, got {len(samples)}")
        # the gateway records the behaviour policy's logprobs: here, the initial policy's
        with torch.no_grad():
            behaviour = response_logprobs(self.model, samples, self.pad_id)
        self.samples = [
            dataclasses.replace(
                s, transition=dataclasses.replace(s.transition, response_logprobs=tuple(lp.tolist()))
            )
            for s, lp in zip(samples, behaviour, strict=True)
        ]
        self.micro_batch_tokens = args.micro_batch * (args.prompt_tokens + args.completion_tokens)
        self.before = {n: p.detach().clone() for n, p in self.trainable.items()}

    def step(self) -> tuple[float, float, int]:
        """(wall seconds, CPU seconds of this process, response tokens trained) of one update step."""
        from agl_trainer.learning.update import update_step

        start, start_cpu = time.perf_counter(), time.process_time()
        stats = update_step(
            self.model,
            self.optimizer,
            self.samples,
            clip_eps=self.clip_eps,
            pad_id=self.pad_id,
            max_grad_norm=self.max_grad_norm,
            micro_batch_tokens=self.micro_batch_tokens,
        )
        return time.perf_counter() - start, time.process_time() - start_cpu, stats.tokens

    def lora_max_change(self) -> float:
        return max(float((p.detach() - self.before[n]).abs().max()) for n, p in self.trainable.items())


# -- the comparison --------------------------------------------------------------------------------------


class TrlSide:
    def __init__(self, python: str, spec: dict[str, Any]) -> None:
        self.spec_file = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="agl-bench-", delete=False)
        json.dump(spec, self.spec_file)
        self.spec_file.close()
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="agl-bench-trl-", delete=False)
        self.process = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--worker", self.spec_file.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=tempfile.gettempdir(),
        )
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG) :])
        self.process.wait()
        self.log.seek(0)
        tail = self.log.read()[-4000:]
        raise SystemExit(
            f"TRL worker exited ({self.process.returncode}) before answering; its stderr ends:\n{tail}"
        )

    def step(self) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        return self._read()

    def finish(self) -> dict[str, Any]:
        done = self._read()
        self.process.wait(timeout=60)
        return done

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        os.unlink(self.spec_file.name)
        self.log.close()
        os.unlink(self.log.name)


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sequences", type=_positive, default=8, help="sequences per step (batch)")
    parser.add_argument("--group-size", type=_positive, default=4, help="completions per prompt (GRPO group)")
    parser.add_argument("--prompt-tokens", type=_positive, default=64)
    parser.add_argument("--completion-tokens", type=_positive, default=64)
    parser.add_argument(
        "--micro-batch",
        type=_positive,
        default=None,
        help="sequences per forward/backward pass (default: the whole batch)",
    )
    parser.add_argument("--threads", type=_positive, default=1, help="torch threads on both sides")
    parser.add_argument("--repeats", type=_positive, default=5, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trl-python",
        default=str(ROOT / ".venv-trl" / "bin" / "python"),
        help="interpreter with TRL installed (see bench/setup_trl_env.sh)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    args.micro_batch = args.micro_batch or args.sequences
    if args.group_size < 2:
        parser.error("--group-size must be at least 2 (GRPO needs a baseline within the group)")
    if args.sequences % args.group_size:
        parser.error(f"--sequences ({args.sequences}) must be a multiple of --group-size ({args.group_size})")
    if args.sequences % args.micro_batch:
        parser.error(
            f"--sequences ({args.sequences}) must be a multiple of --micro-batch ({args.micro_batch})"
        )
    if args.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {args.warmup}")
    if not Path(args.trl_python).is_file():
        parser.error(
            f"no TRL environment at {args.trl_python}: create it with "
            f"`bash bench/setup_trl_env.sh {sys.executable}` or pass --trl-python"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return trl_worker(args.worker)

    import warnings

    import torch

    torch.set_num_threads(args.threads)
    import peft
    import transformers

    transformers.logging.disable_progress_bar()
    # peft asks transformers a deprecated question on every wrap; nothing to act on here
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    batch = make_batch(args)
    agl = AglSide(args, batch)  # converts the model into agl's cache on first use
    steps = args.warmup + args.repeats
    spec = {
        "batch": batch,
        "model_dir": agl.model_dir,
        "tokenizer_dir": agl.tokenizer_dir,
        "threads": args.threads,
        "seed": args.seed,
        "steps": steps,
        "micro_batch": args.micro_batch,
        "learning_rate": agl.learning_rate,
        "clip_eps": agl.clip_eps,
        "max_grad_norm": agl.max_grad_norm,
        "lora_r": agl.lora_r,
        "lora_alpha": agl.lora_alpha,
    }
    step_tokens = args.sequences * (args.prompt_tokens + args.completion_tokens)
    completion_tokens = args.sequences * args.completion_tokens
    # per side: wall seconds and CPU seconds of each timed step
    times: dict[str, tuple[list[float], list[float]]] = {"agl": ([], []), "trl": ([], [])}
    trl_generate_s: list[float] = []
    # absolute (not resolved: a venv's python is a link): the TRL side runs in the temp directory
    trl_side = TrlSide(os.path.abspath(args.trl_python), spec)
    try:
        ours = {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
        }
        theirs = trl_side.ready["versions"]
        mismatched = [k for k in ours if ours[k] != theirs[k]]
        if mismatched:
            print(
                "warning: the environments differ: "
                + ", ".join(f"{k} {ours[k]} vs {theirs[k]}" for k in mismatched)
            )
        trainable = sum(p.numel() for p in agl.trainable.values())
        if trainable != trl_side.ready["trainable"]:
            raise SystemExit(
                f"the LoRA adapters differ: {trainable} trainable parameters (agl) vs "
                f"{trl_side.ready['trainable']} (TRL)"
            )
        for i in range(steps):
            # alternate who goes first, so neither side always runs right after the other
            for side in ("agl", "trl") if i % 2 == 0 else ("trl", "agl"):
                if side == "agl":
                    seconds, cpu_seconds, trained = agl.step()
                    if trained != completion_tokens:
                        raise SystemExit(
                            f"agl trained {trained} response tokens, expected {completion_tokens}"
                        )
                else:
                    result = trl_side.step()
                    if result["tokens"] != step_tokens:
                        raise SystemExit(
                            f"TRL took {result['tokens']} tokens in a step, expected {step_tokens}"
                        )
                    if result["threads"] != args.threads:
                        raise SystemExit(
                            f"TRL ran with {result['threads']} torch threads, expected {args.threads}"
                        )
                    seconds, cpu_seconds = result["seconds"], result["cpu_seconds"]
                    if i >= args.warmup:
                        trl_generate_s.append(result["generate_seconds"])
                if i >= args.warmup:
                    times[side][0].append(seconds)
                    times[side][1].append(cpu_seconds)
        done = trl_side.finish()
    finally:
        trl_side.close()

    changes = {"agl": agl.lora_max_change(), "trl": done["lora_max_change"]}
    names = {"agl": "agl update_step", "trl": "TRL GRPOTrainer"}
    print(
        f"SmolLM2-135M-Instruct + LoRA (r={agl.lora_r}, alpha={agl.lora_alpha:g}, {'/'.join(LORA_TARGETS)}), "
        f"{trainable:,} trainable parameters; CPU, {args.threads} torch thread(s) per side"
    )
    print(
        f"batch: {args.sequences} sequences ({args.sequences // args.group_size} prompts x"
        f" {args.group_size}), {args.prompt_tokens} prompt + {args.completion_tokens} completion tokens"
        f" each = {step_tokens} tokens, {args.micro_batch} sequences per forward pass"
    )
    print(
        f"medians over {args.repeats} steps per side after {args.warmup} warm-up; torch {ours['torch']}, "
        f"transformers {ours['transformers']}, peft {ours['peft']}, trl {theirs['trl']}"
    )
    print()
    print(
        f"{'update step':<17} {'median s':>9} {'min s':>7} {'max s':>7} {'tokens/s':>9} {'compl. tok/s':>13}"
        f" {'CPU s':>7} {'tokens/CPU s':>13} {'LoRA max |dw|':>14}"
    )
    wall = {side: statistics.median(w) for side, (w, _) in times.items()}
    cpu = {side: statistics.median(c) for side, (_, c) in times.items()}
    for side, (w, _) in times.items():
        print(
            f"{names[side]:<17} {wall[side]:>9.3f} {min(w):>7.3f} {max(w):>7.3f}"
            f" {step_tokens / wall[side]:>9.1f} {completion_tokens / wall[side]:>13.1f} {cpu[side]:>7.3f}"
            f" {step_tokens / cpu[side]:>13.1f} {changes[side]:>14.2e}"
        )
    print(
        "TRL's fixed rollout, reward and advantages: median"
        f" {statistics.median(trl_generate_s) * 1000:.1f} ms per step, left out of its times above"
    )
    print(
        f"per CPU second (less sensitive to other load on the machine): ratio {cpu['trl'] / cpu['agl']:.2f}x"
    )
    problems = [
        f"{names[side]} did not change its LoRA weights" for side, change in changes.items() if not change > 0
    ]
    for problem in problems:
        print(f"error: {problem}")
    agl_rate, trl_rate = step_tokens / wall["agl"], step_tokens / wall["trl"]
    ratio = agl_rate / trl_rate
    worst = min(ratio, cpu["trl"] / cpu["agl"])
    ok = worst >= TARGET_RATIO and not problems
    verdict = "ok" if ok else f"missed by {TARGET_RATIO - worst:.2f}x" if not problems else "missed"
    print(
        f"train step: {agl_rate:.0f} tokens/s (agl) vs {trl_rate:.0f} (TRL GRPOTrainer), ratio {ratio:.2f}x, "
        f"target >= {TARGET_RATIO}x wall and per CPU second: {verdict}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
