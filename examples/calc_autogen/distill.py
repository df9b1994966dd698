"""Learn from a stronger policy's production traces: capture, export to a file, import, rate, fine-tune.

    python examples/calc_autogen/distill.py --teacher runs/calc_autogen [--out runs/calc_distill]
    agl train examples/calc_autogen/config.sft.yaml

1. **Production.** The calculator agent (``agent.py``, unchanged but for one header naming each
   episode's session) answers the problems of ``train.jsonl`` through ``agl gateway`` in
   production-capture mode, which serves the base model with the teacher's LoRA adapter (published as
   any new policy version is, ``POST /agl/v1/policy``). No runner, no rollout: the gateway records each
   call under the rollout of its session and registers the sessions in a production store. The spans of
   the gateway and of the agent (agl_autogen) go to ``traces.jsonl`` through
   :class:`agl_core.otel.otlp_file.OtlpJsonLinesExporter`, the lines the OpenTelemetry Collector's ``file``
   exporter writes. The application's own check of each answer lands in ``feedback.jsonl``, apart.
2. **A fresh store.** ``agl import traces.jsonl --store store.sqlite``: the spans regrouped into one
   rollout per session (``imp-s-<hash of the session id>``, as the gateway named them).
3. **Late rewards.** Each feedback line becomes the episode reward of its session's rollout, reward id
   ``feedback-<session>``, given after the fact (``Store.add_rewards``, what ``agl reward`` does one at a
   time); running the step again stores nothing twice.
4. ``agl train examples/calc_autogen/config.sft.yaml`` fine-tunes the *base* model on the calls of the
   rollouts rewarded 1 (``algorithm: sft``, ``traces.filter.reward_min``) and scores the held-out problems
   before and after (paired standard error).

``--teacher`` is a LoRA adapter directory or a training run's output folder (its newest checkpoint's
adapter); ``--teacher base`` collects from the base model itself (self-distillation of its successes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def find_adapter(teacher: str) -> Path | None:
    """The LoRA adapter directory ``teacher`` names: itself, or a run's newest checkpoint's adapter."""
    if teacher == "base":
        return None
    path = Path(teacher)
    if (path / "adapter_config.json").is_file():
        return path
    checkpoints = sorted((path / "checkpoints").glob("step-*/adapter"))
    if checkpoints and (checkpoints[-1] / "adapter_config.json").is_file():
        return checkpoints[-1]
    raise SystemExit(
        f"distill.py: --teacher {teacher}: neither a LoRA adapter directory (adapter_config.json) nor a"
        " run folder with checkpoints/step-*/adapter; train one first (bash scripts/demo.sh), or pass"
        " --teacher base"
    )


def agl(*argv: str) -> str:
    """Run an agl command in this process; return what it printed."""
    from agl_core.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    if code:
        raise RuntimeError(f"agl {' '.join(argv)} exited with {code}:\n{out.getvalue()}")
    return out.getvalue().rstrip()


def collect(
    out: Path,
    adapter: Path | None,
    tasks: list[dict[str, Any]],
    *,
    samples: int,
    workers: int,
    echo: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Step 1: the agent in production behind a capturing gateway; returns the feedback lines."""
    import httpx
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from agl_core import LLM, semconv
    from agl_core.gateway.capture import Capture
    from agl_core.otel.otlp_file import OtlpJsonLinesExporter
    from agl_core.testing import Collector, GatewayServer
    from agl_trainer.generation.hf_backend import HFBackend
    from agl_trainer.model import load_policy

    trace_file = out / "traces.jsonl"
    # the agent's process: agl_autogen records on the global tracer provider
    agent_provider = TracerProvider(resource=Resource.create({"service.name": "calc-agent"}))
    agent_provider.add_span_processor(BatchSpanProcessor(OtlpJsonLinesExporter(trace_file)))
    trace.set_tracer_provider(agent_provider)
    tracer = agent_provider.get_tracer("calc-distill")
    from agent import run_agent  # imported after the provider is set: agl_autogen.instrument() runs here

    model, tokenizer = load_policy("smollm2")
    backend = HFBackend(model, tokenizer, model_name="agl-policy", default_max_tokens=40, max_batch=16)
    feedback: list[dict[str, Any]] = []
    try:
        with (
            Collector(path=out / "production.sqlite") as production,
            GatewayServer(backend, capture=Capture(production.url)) as gateway,
        ):
            # the gateway's spans: to the same file, as a Collector beside it would write them
            gateway.tracer_provider.add_span_processor(BatchSpanProcessor(OtlpJsonLinesExporter(trace_file)))
            if adapter is not None:
                answer = httpx.post(
                    f"{gateway.url}/agl/v1/policy",
                    json={"version": 1, "path": str(adapter), "kind": "lora"},
                    timeout=120,
                )
                answer.raise_for_status()
            echo(
                f"gateway {gateway.v1} (capture; production store {production.url}) serving the base model"
                + ("" if adapter is None else f" with the teacher's adapter {adapter}")
            )
            llm = LLM(base_url=gateway.v1, model="agl-policy")
            episodes = [(task, n) for task in tasks for n in range(samples)]
            started = time.monotonic()

            async def run_all() -> None:
                limit = asyncio.Semaphore(workers)

                async def one(task: dict[str, Any], n: int) -> None:
                    session = f"calc-{task['id']}-{n}"
                    async with limit:
                        # the session names the episode twice: on the agent's spans (OpenTelemetry's
                        # session.id, as OpenInference's using_session sets it) and on its model calls
                        with tracer.start_as_current_span(
                            "episode", attributes={semconv.SESSION_ID: session}
                        ):
                            outcome = await run_agent(
                                task["question"],
                                task["answer"],
                                llm,
                                headers={semconv.HEADER_SESSION_ID: session},
                            )
                    feedback.append(
                        {"session_id": session, "reward": outcome.reward, "time_ns": time.time_ns()}
                    )
                    if len(feedback) % 50 == 0 or len(feedback) == len(episodes):
                        right = sum(f["reward"] for f in feedback)
                        echo(
                            f"  {len(feedback)}/{len(episodes)} episodes, {right:.0f} right"
                            f" ({time.monotonic() - started:.0f} s)"
                        )

                await asyncio.gather(*(one(task, n) for task, n in episodes))

            asyncio.run(run_all())
            agent_provider.force_flush()
            gateway.tracer_provider.force_flush()
            if gateway.capture is None or not gateway.capture.flush():
                raise RuntimeError("the gateway did not register its sessions in the production store")
    finally:
        agent_provider.shutdown()
        backend.close()
    feedback.sort(key=lambda f: f["session_id"])
    with (out / "feedback.jsonl").open("w", encoding="utf-8") as file:
        file.writelines(json.dumps(f) + "\n" for f in feedback)
    right = sum(f["reward"] for f in feedback)
    echo(f"{len(feedback)} episodes, {right:.0f} right; spans in {trace_file}, feedback in feedback.jsonl")
    return feedback


def rate(store_path: Path, feedback: list[dict[str, Any]]) -> tuple[int, int]:
    """Step 3: each feedback line as its session's late episode reward. Returns (new, already stored)."""
    from agl_core.importer import session_rollout_id
    from agl_core.pipeline.rewards import Reward
    from agl_core.store import open_store

    rewards = [
        Reward(
            reward_id=f"feedback-{f['session_id']}",
            value=float(f["reward"]),
            source="app-check",
            time_ns=int(f["time_ns"]),
            rollout_id=session_rollout_id(f["session_id"]),
        )
        for f in feedback
    ]
    store = open_store(str(store_path))
    try:
        stored = store.add_rewards(rewards)
    finally:
        store.close()
    new = sum(1 for s in stored if s.created)
    return new, len(stored) - new


def main(argv: list[str] | None = None, echo: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--teacher", required=True, help="LoRA adapter directory, a run folder (newest checkpoint), or 'base'"
    )
    parser.add_argument("--out", default="runs/calc_distill", help="output folder (default: %(default)s)")
    parser.add_argument("--tasks", default=str(HERE / "train.jsonl"), help="problems the agent answers")
    parser.add_argument("--limit", type=int, default=0, help="only the first N problems (0: all)")
    parser.add_argument("--samples", type=int, default=1, help="episodes per problem (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=16, help="episodes in flight (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.workers < 1 or args.limit < 0:
        parser.error("--samples and --workers must be at least 1, --limit at least 0")
    adapter = find_adapter(args.teacher)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("traces.jsonl", "feedback.jsonl", "store.sqlite", "production.sqlite"):
        for stale in out.glob(name + "*"):
            stale.unlink()
    tasks = [json.loads(line) for line in Path(args.tasks).read_text().splitlines() if line.strip()]
    if args.limit:
        tasks = tasks[: args.limit]

    echo("== 1. production: the agent behind a capturing gateway, spans to an OTLP file")
    feedback = collect(out, adapter, tasks, samples=args.samples, workers=args.workers, echo=echo)

    echo("\n== 2. import the file into a fresh store")
    store = out / "store.sqlite"
    echo(f"$ agl import {out / 'traces.jsonl'} --store {store} --quiet")
    echo(agl("import", str(out / "traces.jsonl"), "--store", str(store), "--quiet").splitlines()[0])

    echo("\n== 3. the application's checks arrive later, as episode rewards")
    new, again = rate(store, feedback)
    echo(f"{new} rewards attached ({again} already stored)")
    new, again = rate(store, feedback)
    echo(f"the same feedback again: {new} new, {again} already stored")

    echo("\n== 4. fine-tune the base model on the rollouts rewarded 1, score it on the held-out problems")
    echo(f"$ agl train {HERE / 'config.sft.yaml'} --set traces.store={store.resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
