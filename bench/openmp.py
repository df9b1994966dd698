"""What OpenMP's thread pools cost generation: SmolLM2's decoding step of 16 rows in a thread of its own,
as the transformers backend runs it, with and without another thread's pool alive.

    python bench/openmp.py [--steps 20] [--threads 2] [--matmul-dtype float32]

torch's CPU build runs its parallel operations on GNU OpenMP, which gives every thread that runs one a
pool of worker threads, kept until that thread exits. When it manages more threads than the machine has
cores, it throttles: a worker spins about a hundred times waiting for the next parallel region and then
sleeps, and each region after that wakes it through the kernel. ``OMP_WAIT_POLICY=PASSIVE`` makes every
worker sleep at once, whatever the count. A decoding step is some 1,500 small parallel regions, so each
wake-up counts. Each case runs in a fresh interpreter (OpenMP reads its environment once):

- ``alone``: the step's thread holds the only pool;
- ``main thread's pool alive``: the main thread ran one parallel operation first (as the trainer's main
  thread has, loading the model or updating it);
- ``... then released``: the same, after the main thread called
  :func:`agl_trainer.cpu.release_openmp_threads` (what the trainer does before waiting for rollouts);
- ``OMP_WAIT_POLICY=PASSIVE``: alone, with passive waiting (what ``agl train`` set before).

The step is :class:`agl_trainer.generation.direct_decode.DirectDecode`'s, with every weight packed
(``serving.hf.packed_weights_mb`` 700) and grouped products, over a slot cache of 16 rows holding 490
columns of which the first 470 are shared; medians over ``--steps`` steps after three to warm up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CASES = {
    "alone": ({}, "none"),
    "main thread's pool alive": ({}, "pool"),
    "... then released": ({}, "release"),
    "OMP_WAIT_POLICY=PASSIVE": ({"OMP_WAIT_POLICY": "PASSIVE"}, "none"),
}

_CASE = """
import json, statistics, sys, threading, time
import torch
from agl_trainer.cpu import release_openmp_threads
from agl_trainer.generation import fast_linear
from agl_trainer.generation.direct_decode import DirectDecode, layer_groups
from agl_trainer.model import load_policy

steps, threads, dtype, before = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3]), sys.argv[4]
torch.set_num_threads(threads)
model, _ = load_policy("smollm2")
model.eval()
config = model.config
heads = config.num_key_value_heads
dim = config.hidden_size // config.num_attention_heads
layers = config.num_hidden_layers
rows, width, shared = 16, 490, 470
release_openmp_threads()  # loading ran parallel regions here: start each case from none
if before in ("pool", "release"):
    torch.randn(4_000_000).exp()  # one parallel operation in the main thread
if before == "release":
    release_openmp_threads()
times = []

def run():
    cache = torch.randn(rows, layers, 2, heads, 577, dim)
    kv = [(cache[:, i, 0], cache[:, i, 1]) for i in range(layers)]
    linears = fast_linear.PackedLinears(
        lambda: model, rows=rows, budget_bytes=700 * 2**20, groups=layer_groups, dtype=dtype
    )
    step = DirectDecode(lambda: model, linears)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad(), linears:
        for i in range(steps + 3):
            positions = torch.randint(width - 20, width, (rows,), generator=generator)
            ids = torch.randint(0, 1000, (rows,), generator=generator)
            started = time.perf_counter()
            step.step(kv, ids, positions, shared, {})
            if i >= 3:
                times.append(time.perf_counter() - started)

thread = threading.Thread(target=run)
thread.start()
thread.join()
print(json.dumps(times))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="decoding steps measured per case (20)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (2)")
    parser.add_argument(
        "--matmul-dtype", default="float32", choices=["float32", "bfloat16"], help="serving.hf.matmul_dtype"
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.threads < 1:
        parser.error("--steps and --threads must be at least 1")
    if args.matmul_dtype == "bfloat16":
        import torch

        from agl_trainer.generation import fast_linear

        if not fast_linear.available(torch.bfloat16):
            parser.error("--matmul-dtype bfloat16: this PyTorch or CPU has no oneDNN bfloat16")
    print(
        f"SmolLM2-135M decoding step, 16 rows, {args.threads} torch threads, {args.matmul_dtype} products;"
        f" medians of {args.steps} steps, each case in a fresh interpreter\n"
    )
    print(f"  {'case':<28} {'ms/step':>8}")
    medians: dict[str, float] = {}
    for name, (env, before) in CASES.items():
        environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
        out = subprocess.run(
            [sys.executable, "-c", _CASE, str(args.steps), str(args.threads), args.matmul_dtype, before],
            capture_output=True,
            text=True,
            env=environ,
            timeout=1800,
        )
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        medians[name] = 1000 * statistics.median(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"  {name:<28} {medians[name]:>8.1f}")
    ratio = medians["main thread's pool alive"] / medians["... then released"]
    print(f"\nanother thread's pool alive costs the step {ratio:.2f}x; released, it costs nothing more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
