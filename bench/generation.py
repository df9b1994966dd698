"""Generation in the transformers backend (``HFBackend``, what ``serving.backend: hf`` serves) against the
machine's limits, and against the backend as it was before its slots and prefix cache.

    python bench/generation.py [--rows 16] [--max-tokens 40] [--repeats 3] [--threads 2] [--device cpu]

The workload is the main job's: SmolLM2-135M-Instruct, and the AutoGen calculator agent's requests
(``examples/calc_autogen``): its system prompt, calculator schema and four worked examples (a prefix of
about 450 tokens shared by every call), then one held-out question. Two backends on the same model, each
measured in the same run:

- ``today``: ``kv_cache="dynamic"``, no prefix cache: every prompt prefilled whole, transformers'
  ``DynamicCache`` concatenated per layer per token (the backend before the slots);
- ``slots``: the preallocated cache written in place, prompt prefixes reused, and decoding steps that run
  the model's modules directly (the default);
- ``slots, forward pass``: the same with every decoding step through the model's forward pass
  (``direct_decode=False``), which shows what the direct steps gain;
- on a CPU with oneDNN bfloat16 (``fast_linear.available(torch.bfloat16)``), for a float32 model:
  ``slots, bfloat16 products`` (``matmul_dtype="bfloat16"``, every weight packed: the products round to
  bfloat16, the rest stays float32) and, so that the precision's own gain is not credited to the slots,
  ``today, bfloat16 model`` (today's path with a copy of the whole model in bfloat16). ``--no-bf16``
  leaves both out.

What it prints:

1. The machine, measured here: memory read bandwidth (GB/s, summing a 1 GiB tensor) and matrix FLOP/s
   (a 2048x2048 float matmul), with ``--threads`` threads.
2. Prefill of a repeated prefix: ``--rows`` requests with fresh questions arrive together (one token
   each), after a first call has seen the prefix; seconds in prefill (the backend's own counter), prompt
   tokens per second, and the FLOP bound of prefilling every prompt token (2 x parameters x tokens plus
   attention). Target: ``slots`` at least 10x faster than ``today``.
3. Decoding ``--rows`` rows: the same requests with ``--max-tokens`` new tokens each (stop tokens masked,
   sampling at temperature 1 with the same seeds on both sides); decoded tokens per second of decoding,
   beside the machine's bound: a decoding step reads every weight once, the keys and values of the prefix
   all rows share once, and each row's own, so it takes at least (those bytes) / bandwidth; and it
   multiplies every row by every weight, so it takes at least (its FLOPs) / the matmul rate. For 16 rows
   on a 2-core CPU the second is the larger. Target: ``slots`` at least 2x ``today``. ``--packed-mb``
   sets how much of the weights ``slots`` keeps packed for oneDNN (``serving.hf.packed_weights_mb``, 128
   by default; 700 packs all of SmolLM2).
4. For reference, end to end (prefill and decode) for the same requests: both backends and one batched
   ``model.generate()`` call, with transformers' static cache.

Medians over ``--repeats``; every repeat uses new questions. Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from agl_core.gateway.backend import ChatRequest, Completion

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "calc_autogen"
#: The calculator tool as AutoGen describes it to the model (``FunctionTool(calculator).schema``).
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Compute an arithmetic expression (numbers, + - * / and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"description": "expression", "title": "Expression", "type": "string"}
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
        "strict": False,
    },
}


#: ``serving.hf.packed_weights_mb``'s default.
PACKED_MB = 128.0
#: Room for every SmolLM2 weight packed in bfloat16 (260 MiB) or float32 (513 MiB).
ALL_PACKED_MB = 700.0


def agent_messages(question: str) -> list[dict[str, Any]]:
    """What the calculator agent sends for ``question``: system prompt, worked examples, the question."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        import agent
        from calc_tool import call_text
    finally:
        sys.path.remove(str(EXAMPLE))
    messages: list[dict[str, Any]] = [{"role": "system", "content": agent.SYSTEM_PROMPT}]
    for asked, expression in agent.EXAMPLES:
        messages += [
            {"role": "user", "content": asked, "name": "user"},
            {"role": "assistant", "content": call_text(expression)},
        ]
    return [*messages, {"role": "user", "content": question, "name": "user"}]


def questions() -> list[str]:
    lines = (EXAMPLE / "val.jsonl").read_text().splitlines()
    return [json.loads(line)["question"] for line in lines if line.strip()]


def memory_bandwidth(device: torch.device, repeats: int = 5) -> float:
    """Bytes per second read by summing a 1 GiB float tensor (median of ``repeats``)."""
    x = torch.ones(2**28, dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        x.sum()
        _sync(device)
        times.append(time.perf_counter() - t0)
    del x
    return 2**30 / statistics.median(times[1:])


def matmul_flops(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n matmul in ``dtype`` (median of ``repeats``): n = 2048 on the CPU, 8192 on a
    GPU (where a smaller product measures its launch, not its arithmetic)."""
    n = 8192 if device.type == "cuda" else 2048
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times[1:])


def products_s(model: Any, rows: int, packed_mb: float, repeats: int = 7) -> tuple[float, int]:
    """Seconds of one decoding step's matrix products and nothing else (median of ``repeats``), and how
    many there are: every linear layer of ``model`` (the output layer included) applied to ``rows`` rows
    of one token, on the CPU through the backend's oneDNN layers with packed copies within ``packed_mb``,
    in a thread of its own as the backend's steps run. No step of the model can be quicker."""
    from contextlib import nullcontext
    from threading import Thread

    from agl_trainer.generation import fast_linear

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(rows, 1, layer.in_features, device=device, dtype=dtype) for layer in layers]
    on_cpu = device.type == "cpu" and dtype == torch.float32 and fast_linear.available()
    times: list[float] = []

    def run() -> None:
        linears = fast_linear.PackedLinears(lambda: model, rows=rows, budget_bytes=int(packed_mb * 2**20))
        with torch.no_grad(), linears if on_cpu else nullcontext():
            for _ in range(repeats + 1):
                _sync(device)
                t0 = time.perf_counter()
                for layer, x in zip(layers, inputs, strict=True):
                    layer(x)
                _sync(device)
                times.append(time.perf_counter() - t0)

    thread = Thread(target=run, name="bench-products")
    thread.start()
    thread.join()
    return statistics.median(times[1:]), len(layers)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_flops(model: Any, prompt_tokens: list[int]) -> float:
    """FLOPs to prefill prompts of these lengths: every token through every weight but the embedding
    (2 x parameters), the last token of each through the output layer, and causal attention."""
    config = model.config
    embedding = config.vocab_size * config.hidden_size
    weights = sum(p.numel() for p in model.parameters()) - embedding
    width = config.num_attention_heads * getattr(
        config, "head_dim", config.hidden_size // config.num_attention_heads
    )
    flops = 0.0
    for n in prompt_tokens:
        flops += 2 * weights * n + 2 * embedding
        flops += 4 * config.num_hidden_layers * width * n * (n + 1) / 2  # QK^T and AV over the causal half
    return flops


def decode_bytes(model: Any, token_bytes: int, rows: int, context: float, shared: int) -> float:
    """Bytes one decoding step must read: every weight (the output layer's shared with the embedding
    once), the keys and values of the ``shared`` prefix tokens every row attends to once, and each of
    ``rows`` rows' own keys and values over the rest of its ``context`` tokens."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights + (shared + rows * (context - shared)) * token_bytes


def decode_flops(model: Any, rows: int, context: float) -> float:
    """FLOPs of one decoding step: each of ``rows`` new tokens through every weight (the output layer
    included, the embedding a lookup) and attention over its ``context`` tokens."""
    config = model.config
    embedding = config.vocab_size * config.hidden_size
    weights = sum(p.numel() for p in model.parameters()) - embedding
    width = config.num_attention_heads * getattr(
        config, "head_dim", config.hidden_size // config.num_attention_heads
    )
    return rows * (2 * (weights + embedding) + 4 * config.num_hidden_layers * width * context)


class _NoStop:
    """Logits processor: masks the stop tokens, so every row decodes the same number of tokens."""

    def __init__(self, stop_ids: frozenset[int]) -> None:
        self.stop = sorted(stop_ids)

    def __call__(self, prompt_ids: Any, response: Any, logits: torch.Tensor) -> torch.Tensor:
        logits[self.stop] = float("-inf")
        return logits


def _run(backend: Any, requests: list[ChatRequest]) -> list[Completion]:
    async def one(request: ChatRequest) -> Completion:
        return [e async for e in backend.generate("bench", request) if isinstance(e, Completion)][0]

    async def together() -> list[Completion]:
        return list(await asyncio.gather(*(one(r) for r in requests)))

    return asyncio.run(together())


def _counters(backend: Any) -> dict[str, float]:
    names = ("prefill_s", "decode_s", "generated_tokens", "prefilled_tokens", "reused_tokens", "decode_steps")
    return {name: float(getattr(backend, name)) for name in names}


def _delta(backend: Any, before: dict[str, float]) -> dict[str, float]:
    now = _counters(backend)
    return {k: now[k] - before[k] for k in now}


def plain_generate(
    model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int, static: bool, width: int = 0
) -> float:
    """Seconds for one batched ``generate()`` of ``max_tokens`` new tokens per prompt (left-padded to
    ``width`` or the longest prompt, sampling, no early stop), transformers' static cache when ``static``.
    One ``width`` for every call keeps the static cache's shape, so whatever transformers compiles for it
    is compiled once."""
    width = max(width, *(len(p) for p in prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    extra = {"cache_implementation": "static"} if static else {}
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            pad_token_id=pad,
            **extra,
        )
    _sync(device)
    return time.perf_counter() - t0


def profile_round(backend: Any, requests: list[ChatRequest], path: Path) -> None:
    """One round of ``requests`` (a prefill of one token each, then decoding) under torch.profiler, every
    thread's operators by total CPU time written to ``path``, the first lines printed."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if backend.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    short = [dataclasses.replace(r, max_tokens=1) for r in requests]
    try:  # the backend generates in a thread of its own
        from torch._C._profiler import _ExperimentalConfig

        extra: dict[str, Any] = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        extra = {}
    with profile(activities=activities, **extra) as prof:
        _run(backend, short)
        _run(backend, requests)
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
    path.write_text(table)
    print("\nprofile of one slots round (prefill, then decoding), by total CPU time:")
    print("\n".join(table.splitlines()[:24]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="requests decoded together (16)")
    parser.add_argument("--max-tokens", type=int, default=40, help="new tokens per request (40)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (2)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype")
    parser.add_argument(
        "--packed-mb",
        type=float,
        default=PACKED_MB,
        help="slots: MiB of oneDNN-packed weight copies on the CPU (serving.hf.packed_weights_mb; 128);"
        " any other budget also measures slots with 128 beside it",
    )
    parser.add_argument("--json", type=Path, help="also write every repeat's figures to this JSON file")
    parser.add_argument(
        "--profile",
        type=Path,
        help="after the repeats, profile one round of slots (prefill, then decoding) with torch.profiler and"
        " write its operators, by total CPU time, to this file",
    )
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="measure only these backends besides today (e.g. slots)"
    )
    parser.add_argument(
        "--no-bf16", action="store_true", help="leave out the bfloat16 rows on a CPU that has bfloat16"
    )
    args = parser.parse_args(argv)
    for name in ("rows", "max_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.packed_mb < 0:
        parser.error("--packed-mb must be 0 or more")
    pool = questions()
    if args.rows * (args.repeats + 1) > len(pool):
        parser.error(f"--rows x (--repeats + 1) must be at most {len(pool)} (the held-out questions)")
    torch.set_num_threads(args.threads)
    from agl_trainer.cpu import release_openmp_threads
    from agl_trainer.generation.hf_backend import HFBackend
    from agl_trainer.generation.kv_cache import cache_shape, common_prefix
    from agl_trainer.model import load_policy, torch_device

    try:
        device = torch_device(args.device)
    except (ValueError, RuntimeError) as exc:
        parser.error(f"--device: {exc}")
    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_policy("smollm2")
    model.to(device=device, dtype=dtype)
    model.eval()
    shape = cache_shape(model)
    assert shape is not None
    backends = {
        "today": HFBackend(model, tokenizer, model_name="bench", max_batch=args.rows, kv_cache="dynamic"),
        "slots": HFBackend(
            model, tokenizer, model_name="bench", max_batch=args.rows, packed_weights_mb=args.packed_mb
        ),
        "slots, forward pass": HFBackend(
            model,
            tokenizer,
            model_name="bench",
            max_batch=args.rows,
            packed_weights_mb=args.packed_mb,
            direct_decode=False,
        ),
    }
    if device.type == "cpu" and args.packed_mb != PACKED_MB:  # what the other packing budget gives
        backends[f"slots, {PACKED_MB:.0f} MiB packed"] = HFBackend(
            model, tokenizer, model_name="bench", max_batch=args.rows, packed_weights_mb=PACKED_MB
        )
    from agl_trainer.generation import fast_linear

    bf16 = (
        not args.no_bf16
        and device.type == "cpu"
        and dtype == torch.float32
        and fast_linear.available(torch.bfloat16)
    )
    if bf16:  # bfloat16 products, and today's path in bfloat16 for what the precision alone gives
        backends["slots, bfloat16 products"] = HFBackend(
            model,
            tokenizer,
            model_name="bench",
            max_batch=args.rows,
            packed_weights_mb=ALL_PACKED_MB,
            matmul_dtype="bfloat16",
        )
        model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
        backends["today, bfloat16 model"] = HFBackend(
            model_bf16, tokenizer, model_name="bench", max_batch=args.rows, kv_cache="dynamic"
        )
    if device.type == "cuda":  # what the fixed-shape step and its graph each add on a GPU
        backends["slots, no CUDA graph"] = HFBackend(
            model, tokenizer, model_name="bench", max_batch=args.rows, cuda_graphs=False
        )
        backends["slots, narrow steps"] = HFBackend(
            model, tokenizer, model_name="bench", max_batch=args.rows, static_decode=False
        )
    if args.only:
        unknown = sorted(set(args.only) - set(backends))
        if unknown:
            parser.error(f"--only: no backend {', '.join(unknown)}; choose from {', '.join(backends)}")
        backends = {name: b for name, b in backends.items() if name == "today" or name in args.only}
    bandwidth = memory_bandwidth(device)
    flops = matmul_flops(device, dtype)
    print(
        f"SmolLM2-135M-Instruct ({args.dtype}) on {device} with {args.threads} CPU threads: memory read"
        f" {bandwidth / 1e9:.1f} GB/s, {args.dtype} matmul {flops / 1e9:.0f} GFLOP/s (measured now)"
    )

    def request(question: str, max_tokens: int, seed: int | None = None) -> ChatRequest:
        return ChatRequest(
            messages=agent_messages(question),
            tools=[CALCULATOR],
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed,
        )

    prompt_len = len(backends["slots"].render_prompt(request(pool[0], 1).messages, [CALCULATOR]))
    print(
        f"{args.rows} calculator-agent requests at once, prompts of about {prompt_len} tokens,"
        f" {args.max_tokens} new tokens each; medians of {args.repeats} repeats\n"
    )
    for backend in backends.values():  # warm-up, and the first call that sees the shared prefix
        _run(backend, [request(pool[-1], 2)])
    width = max(
        len(backends["today"].render_prompt(request(q, 1).messages, [CALCULATOR]))
        for q in pool[: args.rows * args.repeats]
    )
    warm = [backends["today"].render_prompt(request(pool[-1], 1).messages, [CALCULATOR])] * args.rows
    plain_generate(model, tokenizer, warm, args.max_tokens, static=True, width=width)  # compiles, if it does
    release_openmp_threads()  # the backends' worker holds the only OpenMP pool (agl_trainer.cpu)
    results: dict[str, dict[str, list[float]]] = {name: {} for name in [*backends, "generate()"]}

    def record(name: str, key: str, value: float) -> None:
        results[name].setdefault(key, []).append(value)

    for r in range(args.repeats):
        batch = pool[args.rows * r : args.rows * (r + 1)]
        for name, backend in backends.items():
            # prefill: one token each, so the batch is its prompts
            before = _counters(backend)
            _run(backend, [request(q, 1) for q in batch])
            d = _delta(backend, before)
            record(name, "prefill_s", d["prefill_s"])
            record(name, "prompt_tokens", d["prefilled_tokens"] + d["reused_tokens"])
            record(name, "prefilled_tokens", d["prefilled_tokens"])
            # decoding: the same requests to the end, stop tokens masked, the same seeds on both sides
            backend.logits_processor = _NoStop(backend.stop_ids)
            before = _counters(backend)
            started = time.perf_counter()
            _run(backend, [request(q, args.max_tokens, seed=1000 * r + i) for i, q in enumerate(batch)])
            wall = time.perf_counter() - started
            backend.logits_processor = None
            d = _delta(backend, before)
            record(name, "decode_s", d["decode_s"])
            record(name, "decoded", d["generated_tokens"] - args.rows)
            record(name, "steps", d["decode_steps"])
            record(name, "end_to_end", d["generated_tokens"] / wall)
        prompts = [backends["today"].render_prompt(request(q, 1).messages, [CALCULATOR]) for q in batch]
        seconds = plain_generate(model, tokenizer, prompts, args.max_tokens, static=True, width=width)
        release_openmp_threads()
        record("generate()", "end_to_end", args.rows * args.max_tokens / seconds)
    floor_s, products = products_s(model, args.rows, args.packed_mb)
    if args.profile:
        profile_round(
            backends["slots"], [request(q, args.max_tokens) for q in pool[-args.rows :]], args.profile
        )
    for backend in backends.values():
        backend.close()

    med = {name: {k: statistics.median(v) for k, v in values.items()} for name, values in results.items()}
    prompt_tokens = [prompt_len] * args.rows
    flop_bound_s = prefill_flops(model, prompt_tokens) / flops
    print(
        "prefill of a repeated prefix    seconds  prompt tokens/s  computed tokens  FLOP bound (all tokens)"
    )
    for name in backends:
        m = med[name]
        print(
            f"  {name:<28} {m['prefill_s']:>8.2f} {m['prompt_tokens'] / m['prefill_s']:>16,.0f}"
            f" {m['prefilled_tokens']:>16,.0f}"
            f"   {flop_bound_s:.2f} s ({m['prefill_s'] / flop_bound_s:.1f}x it)"
        )
    context = prompt_len + args.max_tokens / 2
    sample = [
        backends["slots"].render_prompt(request(q, 1).messages, [CALCULATOR]) for q in pool[: args.rows]
    ]
    shared = min(common_prefix(sample[0], other) for other in sample[1:]) if len(sample) > 1 else 0
    step_bytes = decode_bytes(model, shape.token_bytes, args.rows, context, shared)
    step_flops = decode_flops(model, args.rows, context)
    # a step takes at least as long as reading its bytes and as long as its products: the larger bounds it
    bound_s = max(step_bytes / bandwidth, step_flops / flops)
    bound_tps = args.rows / bound_s
    memory_ms, compute_ms = 1000 * step_bytes / bandwidth, 1000 * step_flops / flops
    print(
        f"\ndecoding {args.rows} rows             tokens/s  ms/step   bound: {step_bytes / 1e6:,.0f} MB"
        f" per step ({memory_ms:.1f} ms), {step_flops / 1e9:.1f} GFLOP ({compute_ms:.1f} ms)"
        f" -> {bound_tps:,.0f} tokens/s"
    )
    for name in backends:
        m = med[name]
        tps = m["decoded"] / m["decode_s"]
        print(
            f"  {name:<28} {tps:>9.1f} {1000 * m['decode_s'] / m['steps']:>8.1f}"
            f"   {tps / bound_tps:.0%} of the bound"
        )
    today_tps = med["today"]["decoded"] / med["today"]["decode_s"]
    print(
        f"  {f'its {products} products alone':<28} {args.rows / floor_s:>9.1f} {1000 * floor_s:>8.1f}"
        f"   no step is quicker: at most {args.rows / floor_s / today_tps:.1f}x today"
    )
    print("\nend to end (prefill and decode)  tokens/s")
    for name in [*backends, "generate()"]:
        label = "generate(), static cache" if name == "generate()" else name
        print(f"  {label:<28} {med[name]['end_to_end']:>9.1f}")

    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": str(device),
                    "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "dtype": args.dtype,
                    "rows": args.rows,
                    "max_tokens": args.max_tokens,
                    "prompt_tokens": prompt_len,
                    "bandwidth_bytes_s": bandwidth,
                    "matmul_flop_s": flops,
                    "decode_bound_tokens_s": bound_tps,
                    "prefill_flop_bound_s": flop_bound_s,
                    "products_s": floor_s,
                    "repeats": results,
                },
                indent=1,
            )
        )
    prefill_ratio = med["today"]["prefill_s"] / med["slots"]["prefill_s"]
    decode_ratio = (med["slots"]["decoded"] / med["slots"]["decode_s"]) / (
        med["today"]["decoded"] / med["today"]["decode_s"]
    )
    ok = True
    for what, ratio, target in (("prefill", prefill_ratio, 10.0), ("decoding", decode_ratio, 2.0)):
        verdict = "met" if ratio >= target else "MISSED"
        ok = ok and ratio >= target
        print(f"{what}: slots / today {ratio:.1f}x (target >= {target:.0f}x): {verdict}")
    if "slots, bfloat16 products" in med:

        def tps(name: str) -> float:
            return med[name]["decoded"] / med[name]["decode_s"]

        ratio = tps("slots, bfloat16 products") / today_tps
        verdict = "met" if ratio >= 2.0 else "MISSED"
        print(
            f"decoding: slots with bfloat16 products / today {ratio:.1f}x (target >= 2x): {verdict};"
            f" / today with the model in bfloat16"
            f" {tps('slots, bfloat16 products') / tps('today, bfloat16 model'):.1f}x"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
