"""On a GPU: the decoding step replayed from a CUDA graph generates what the step run eagerly generates,
and what transformers' own ``generate()`` does, for the main job's model and requests.

    python bench/gpu_equality.py [--device cuda] [--dtype float32|bfloat16] [--rows 8] [--max-tokens 24]

Three ways to generate the same greedy completions of the calculator agent's requests (SmolLM2-135M in
float32, or bfloat16 with ``--dtype``): the transformers backend with fixed-shape steps replayed from a
CUDA graph (the default on a GPU), the same backend with the narrow steps run eagerly
(``static_decode=False``), and ``generate()`` one prompt at a time. It prints, for each pair, the rows
whose tokens agree in full and the largest difference of log-probability over the tokens they share, and
exits 1 when a row's tokens differ before its log-probs have drifted by ``--tolerance`` (a real
disagreement, not a near tie that rounding broke the other way), or when the graph was never replayed. The
CPU's equivalent is a test (``tests/test_hf_prefix_cache.py``); this is the same check where graphs exist.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation import CALCULATOR, _run, agent_messages, questions  # noqa: E402

from agl_core.gateway.backend import ChatRequest  # noqa: E402


def generate_one(model: Any, prompt_ids: list[int], max_new: int) -> tuple[list[int], list[float]]:
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [
        float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.logits, tokens, strict=False)
    ]
    return tokens, logprobs


def compare(
    a: tuple[list[int], list[float]], b: tuple[list[int], list[float]], tolerance: float
) -> tuple[bool, float, bool]:
    """(tokens equal, largest log-prob difference over the shared prefix, a real disagreement)."""
    (ta, la), (tb, lb) = a, b
    shared = 0
    while shared < min(len(ta), len(tb)) and ta[shared] == tb[shared]:
        shared += 1
    diff = max((abs(x - y) for x, y in zip(la[: shared + 1], lb[: shared + 1], strict=False)), default=0.0)
    equal = ta == tb
    # tokens that part while the log-probs still agree closely: one path computes something else
    real = not equal and diff < tolerance and shared < min(len(ta), len(tb))
    return equal, diff, real


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype")
    parser.add_argument(
        "--tolerance", type=float, default=None, help="log-prob agreement (1e-3 in float32, 0.05 in bfloat16)"
    )
    args = parser.parse_args(argv)
    if args.rows < 1 or args.max_tokens < 1:
        parser.error("--rows and --max-tokens must be at least 1")
    if args.tolerance is None:
        args.tolerance = 1e-3 if args.dtype == "float32" else 0.05
    if not args.tolerance > 0:
        parser.error("--tolerance must be above 0")
    if args.rows > len(questions()):
        parser.error(f"--rows must be at most {len(questions())} (the held-out questions)")
    from agl_trainer.generation.hf_backend import HFBackend
    from agl_trainer.model import load_policy

    model, tokenizer = load_policy("smollm2")
    device = torch.device(args.device)
    model.to(device=device, dtype=getattr(torch, args.dtype)).eval()
    graphs = HFBackend(model, tokenizer, model_name="bench", max_batch=args.rows, static_decode=True)
    narrow = HFBackend(model, tokenizer, model_name="bench", max_batch=args.rows, static_decode=False)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device} ({name}), {args.dtype}")
    print(
        f"graphs backend: fixed-shape steps {graphs._static is not None},"
        f" CUDA graphs {bool(graphs._static and graphs._static.graphs)}"
    )
    requests = [
        ChatRequest(
            messages=agent_messages(q), tools=[CALCULATOR], max_tokens=args.max_tokens, temperature=0.0
        )
        for q in questions()[: args.rows]
    ]
    results = {}
    for name, backend in (("graph", graphs), ("narrow", narrow)):
        results[name] = [(list(c.response_ids), list(c.response_logprobs)) for c in _run(backend, requests)]
    replayed = bool(graphs._static is not None and graphs._static.graphs and graphs._static._checked)
    prompts = [list(graphs.render_prompt(r.messages, [CALCULATOR])) for r in requests]
    results["generate()"] = [
        generate_one(model, p, len(results["narrow"][i][0])) for i, p in enumerate(prompts)
    ]
    failed = device.type == "cuda" and not replayed
    print(f"graph captured and its first replay matched the eager step: {replayed}")
    for left, right in (("graph", "narrow"), ("graph", "generate()"), ("narrow", "generate()")):
        rows = [compare(a, b, args.tolerance) for a, b in zip(results[left], results[right], strict=True)]
        equal = sum(r[0] for r in rows)
        real = sum(r[2] for r in rows)
        diff = max(r[1] for r in rows)
        failed = failed or real > 0
        print(
            f"{left:>7} vs {right:<11} rows with equal tokens {equal}/{len(rows)},"
            f" largest log-prob difference {diff:.2e}, disagreements {real}"
        )
    graphs.close()
    narrow.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
