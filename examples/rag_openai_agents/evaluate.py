"""Score the agent on a split without training: ``python evaluate.py dev.jsonl [--limit N] [--show K]``.

Serves SmolLM2-135M-Instruct (or ``--model``) through agl's gateway in this process, runs ``solve`` on
each task (``--workers`` at a time) and prints the mean reward with its standard error. Use it on the
``dev`` split while changing the agent; ``val`` is for the trainer's before/after measurement only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("split", type=Path, help="a JSONL file of tasks, e.g. dev.jsonl")
    parser.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default="smollm2", help="smollm2, or a local Hugging Face model directory")
    parser.add_argument("--adapter", type=Path, default=None, help="a PEFT adapter directory to load first")
    parser.add_argument("--max-tokens", type=int, default=16, help="the gateway's default_max_tokens")
    parser.add_argument("--agentic", action="store_true", help="the model makes every search (solve_agentic)")
    parser.add_argument("--show", type=int, default=5, help="print the replies of this many tasks")
    args = parser.parse_args(argv)
    for flag in ("limit", "workers", "max_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.adapter is not None and not (args.adapter / "adapter_config.json").is_file():
        parser.error(f"--adapter {args.adapter} is not a PEFT adapter directory (no adapter_config.json)")
    path = args.split if args.split.is_file() else HERE / args.split
    if not path.is_file():
        parser.error(f"no task file {args.split} (looked here and in {HERE})")
    tasks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][: args.limit]

    import warnings

    import torch

    from agl_core._serve import BackgroundServer
    from agl_core.gateway import create_gateway_app
    from agl_core.runner import LLM
    from agl_trainer.hf_backend import HFBackend
    from agl_trainer.model import load_policy

    torch.set_num_threads(1)
    # peft asks transformers a deprecated question when it wraps a model; nothing a user can act on
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    sys.path.insert(0, str(HERE))
    import agent
    from reward import score

    model, tokenizer = load_policy(args.model)
    if args.adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    backend = HFBackend(model, tokenizer, model_name="agl-policy", default_max_tokens=args.max_tokens)
    server = BackgroundServer(create_gateway_app(backend)).start()
    llm = LLM(base_url=f"{server.url}/v1", model="agl-policy")

    def run(task: dict) -> tuple[dict, str, float]:
        reply = ""
        try:
            reply = asyncio.run(agent.answer(task, llm, agentic=args.agentic))
        except Exception as exc:  # report, score 0, go on
            reply = f"<{type(exc).__name__}: {exc}>"
        return task, reply, score(reply, task["answer"])

    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(args.workers) as pool:
            results = list(pool.map(run, tasks))
    finally:
        server.stop()
        backend.close()
    rewards = [r for _, _, r in results]
    for task, reply, r in results[: args.show]:
        print(f"{r:.3f}  {task['question']}  gold={task['answer']!r}  reply={reply!r}")
    se = statistics.stdev(rewards) / len(rewards) ** 0.5 if len(rewards) > 1 else 0.0
    print(
        f"{path.name}: mean reward {statistics.fmean(rewards):.3f} ± {se:.3f} (SE, n={len(rewards)} tasks)"
        f" in {time.monotonic() - t0:.0f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
