"""Generation throughput of the transformers backend (``HFBackend``, what ``serving.backend: hf`` serves)
against a plain batched ``model.generate()`` loop on the same prompts, same model and threads.

    python bench/generation.py [--requests 16] [--max-tokens 40] [--repeats 3] [--threads 2] [--device cpu]

Two workloads, on SmolLM2-135M-Instruct (the main job's model):

- ``together``: all requests at once (one batch for both sides): generated tokens per second.
- ``staggered``: the requests arrive one by one, ``--gap-ms`` apart, as an agent fleet's calls do. The
  backend with continuous batching lets a late request join the batch being decoded; without it
  (``continuous=False``, run to completion) it waits for the batch. ``generate()`` gets the same arrivals
  in groups: each call takes every request that has arrived when it starts, so it waits like the
  backend without continuous batching. Reported: tokens/s from the first arrival to the last answer, and
  the mean time from a request's arrival to its answer.

The last line compares the backend's ``together`` tokens/s with ``generate()``'s (target: at least 1.0x).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

import torch

from agl_core.gateway.backend import ChatRequest, Completion

SYSTEM = (
    "You are a careful assistant that solves arithmetic word problems. Think step by step, write the"
    " expression you need, call the calculator tool when a computation is not trivial, and end with the"
    " final answer as a plain number on its own line. Never invent numbers that are not in the question."
)
QUESTIONS = [
    f"A shop sells {a} boxes with {b} pencils each and then {c} more pencils. How many pencils is that?"
    for a, b, c in [
        (3, 12, 7),
        (5, 9, 4),
        (8, 6, 11),
        (2, 25, 3),
        (7, 7, 7),
        (4, 15, 9),
        (6, 13, 2),
        (9, 4, 5),
    ]
]


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


def plain_generate(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int) -> int:
    """One batched ``generate()`` call (left padding, sampling at temperature 1); returns the tokens it
    generated, EOS included, padding after it not."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            pad_token_id=pad,
        )
    generated = out[:, width:]
    stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    total = 0
    for row in generated.tolist():
        for n, token in enumerate(row, start=1):
            if token in stops:
                total += n
                break
        else:
            total += len(row)
    return total


async def _backend_run(backend: Any, requests: list[ChatRequest], gap_s: float) -> tuple[float, list[float]]:
    """Send ``requests`` ``gap_s`` apart; seconds from the first to the last answer, and each latency."""
    latencies: list[float] = []

    async def one(request: ChatRequest, delay: float) -> None:
        await asyncio.sleep(delay)
        sent = time.monotonic()
        async for event in backend.generate("bench", request):
            if isinstance(event, Completion):
                latencies.append(time.monotonic() - sent)

    started = time.monotonic()
    await asyncio.gather(*(one(r, i * gap_s) for i, r in enumerate(requests)))
    return time.monotonic() - started, latencies


def _plain_staggered(
    model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int, gap_s: float
) -> tuple[float, list[float], int]:
    """generate() calls, each taking the requests that have arrived when it starts."""
    started = time.monotonic()
    arrivals = [started + i * gap_s for i in range(len(prompts))]
    latencies: list[float] = []
    tokens = 0
    next_up = 0
    while next_up < len(prompts):
        now = time.monotonic()
        if arrivals[next_up] > now:
            time.sleep(arrivals[next_up] - now)
            now = time.monotonic()
        batch = [i for i in range(next_up, len(prompts)) if arrivals[i] <= now]
        tokens += plain_generate(model, tokenizer, [prompts[i] for i in batch], max_tokens)
        done = time.monotonic()
        latencies += [done - arrivals[i] for i in batch]
        next_up = batch[-1] + 1
    return time.monotonic() - started, latencies, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gap-ms", type=float, default=150.0)
    parser.add_argument("--device", default="cpu", help="where both sides run: cpu, cuda or cuda:N (cpu)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from agl_trainer.hf_backend import HFBackend
    from agl_trainer.model import load_policy, torch_device

    try:
        device = torch_device(args.device)
    except (ValueError, RuntimeError) as exc:  # no GPU, or not a device name torch knows
        parser.error(f"--device: {exc}")
    model, tokenizer = load_policy("smollm2")
    model.to(device)
    model.eval()
    backends = {
        "continuous": HFBackend(model, tokenizer, model_name="bench", max_batch=args.requests),
        "run to completion": HFBackend(
            model, tokenizer, model_name="bench", max_batch=args.requests, continuous=False
        ),
    }
    requests = [
        ChatRequest(messages=_messages(i), max_tokens=args.max_tokens, temperature=1.0)
        for i in range(args.requests)
    ]
    prompts = [backends["continuous"].render_prompt(r.messages, None) for r in requests]
    print(
        f"{args.requests} requests, prompts of {statistics.mean(map(len, prompts)):.0f} tokens, up to"
        f" {args.max_tokens} new tokens, on {device} with {args.threads} CPU threads, {args.repeats} repeats"
        " (medians)"
    )
    plain_generate(model, tokenizer, prompts[:2], 4)  # warm-up
    together: dict[str, list[float]] = {"generate()": [], "backend": []}
    staggered: dict[str, list[tuple[float, float]]] = {"generate()": [], **{k: [] for k in backends}}
    for _ in range(args.repeats):
        t0 = time.monotonic()
        tokens = plain_generate(model, tokenizer, prompts, args.max_tokens)
        together["generate()"].append(tokens / (time.monotonic() - t0))
        backend = backends["continuous"]
        before = backend.generated_tokens
        seconds, _ = asyncio.run(_backend_run(backend, requests, 0.0))
        together["backend"].append((backend.generated_tokens - before) / seconds)
        gap = args.gap_ms / 1000
        seconds, latencies, tokens = _plain_staggered(model, tokenizer, prompts, args.max_tokens, gap)
        staggered["generate()"].append((tokens / seconds, statistics.mean(latencies)))
        for name, backend in backends.items():
            before = backend.generated_tokens
            seconds, latencies = asyncio.run(_backend_run(backend, requests, gap))
            staggered[name].append(
                ((backend.generated_tokens - before) / seconds, statistics.mean(latencies))
            )
    print("\nall at once              tokens/s")
    for name, values in together.items():
        print(f"  {name:<22} {statistics.median(values):>8.1f}")
    print(f"\narriving {args.gap_ms:.0f} ms apart    tokens/s   mean latency s")
    for name, pairs in staggered.items():
        label = name if name == "generate()" else f"backend, {name}"
        print(
            f"  {label:<22} {statistics.median(p[0] for p in pairs):>8.1f}"
            f"   {statistics.median(p[1] for p in pairs):>8.2f}"
        )
    for backend in backends.values():
        backend.close()
    ratio = statistics.median(together["backend"]) / statistics.median(together["generate()"])
    verdict = "met" if ratio >= 1.0 else f"MISSED by {1 / ratio:.2f}x"
    print(f"\nbackend / generate(), all at once: {ratio:.2f}x (target >= 1.0x): {verdict}")
    return 0 if ratio >= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
