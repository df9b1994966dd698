"""The calculator agent in production, kept improving by ``agl improve``, unattended.

    python examples/calc_autogen/improve_demo.py [--out runs/calc_improve] [--rounds 4] [--corrupt-round 3]

The scene, each part a process or thread of its own:

1. **Production.** ``agl store serve`` (the production store) and ``agl gateway serve --backend hf
   --capture`` serving the base SmolLM2-135M-Instruct with an admin token. A client population starts a
   session of the calculator agent (``agent.py``, unchanged) every ``--interval`` seconds on a problem of
   ``train.jsonl``, at most ``--concurrency`` at once, each naming its session with ``x-agl-session-id``.
2. **Users.** A simulated user rates each session ``--reward-delay`` seconds after it ended: 1 when the
   answer was right, else 0, sent to the store as the session rollout's late episode reward (what
   ``agl reward`` does). While the data of round ``--corrupt-round`` is gathered, every rating is
   inverted: the deliberately corrupted round.
3. **The service.** ``agl improve improve.yaml`` runs ``--rounds`` rounds on its own: each trains a
   candidate from the serving version on the newly rated sessions, gates it on the held-out problems
   against the serving version, and publishes a promoted one to the gateway.
4. **The report** (``OUT/report.md``, ``OUT/calls_by_version.png``): each version's held-out score against
   the base (paired SE, scored again after the run on the same problems), its live reward (the users'
   ratings of the sessions it served), the gate's numbers, and the share of calls each version served over
   time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, process: subprocess.Popen[Any], timeout_s: float, what: str) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"improve_demo: {what} exited with {process.returncode}; see its log")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"improve_demo: {what} did not answer {url} within {timeout_s:.0f}s")


class Users:
    """Rates each finished session after a delay; inverts the ratings while the corrupted round's data is
    gathered (the service's state says which round that is)."""

    def __init__(self, store_url: str, state_file: Path, corrupt_round: int, delay_s: float, log: Path):
        self.store_url, self.state_file = store_url, state_file
        self.corrupt_round, self.delay_s = corrupt_round, delay_s
        self.pending: queue.Queue[tuple[float, str, float]] = queue.Queue()
        self.log = log.open("a", encoding="utf-8")
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _rounds_started(self) -> int:
        try:
            return int(json.loads(self.state_file.read_text())["rounds"])
        except (OSError, ValueError, KeyError):
            return 0

    def _loop(self) -> None:
        from agl_core import session_rollout_id
        from agl_core.pipeline.rewards import Reward
        from agl_core.store import StoreClient

        client = StoreClient(self.store_url)
        while not (self.stopping.is_set() and self.pending.empty()):
            try:
                ended, session, right = self.pending.get(timeout=0.5)
            except queue.Empty:
                continue
            time.sleep(max(0.0, ended + self.delay_s - time.time()))
            corrupted = self._rounds_started() == self.corrupt_round - 1
            value = 1.0 - right if corrupted else right
            reward = Reward(f"user-{session}", value, source="user", rollout_id=session_rollout_id(session))
            for _ in range(60):  # the session's record may still be on its way; the store may be busy
                try:
                    client.add_rewards([reward])
                    break
                except Exception:
                    time.sleep(1.0)
            self.log.write(
                json.dumps(
                    {
                        "session": session,
                        "right": right,
                        "reward": value,
                        "corrupted": corrupted,
                        "time": time.time(),
                    }
                )
                + "\n"
            )
            self.log.flush()
        client.close()


def clients(
    gateway: str,
    tasks: list[dict[str, Any]],
    users: Users,
    stop: threading.Event,
    interval_s: float,
    concurrency: int,
    seed: int,
) -> None:
    """Start a session every ``interval_s`` seconds (at most ``concurrency`` at once) until ``stop``."""
    from agent import run_agent

    from agl_core import LLM

    llm = LLM(base_url=f"{gateway}/v1", model="policy")
    rng = random.Random(seed)

    async def main() -> None:
        limit = asyncio.Semaphore(concurrency)
        running: set[asyncio.Task[None]] = set()

        async def one(n: int, task: dict[str, Any]) -> None:
            session = f"calc-session-{n:05d}"
            try:
                outcome = await run_agent(
                    task["question"], task["answer"], llm, headers={"x-agl-session-id": session}
                )
                users.pending.put((time.time(), session, outcome.reward))
            except Exception as exc:  # a failed session gets no rating
                print(f"session {session} failed: {exc}", flush=True)
            finally:
                limit.release()

        n = 0
        while not stop.is_set():
            await limit.acquire()
            job = asyncio.create_task(one(n, rng.choice(tasks)))
            running.add(job)
            job.add_done_callback(running.discard)
            n += 1
            await asyncio.sleep(interval_s)
        if running:
            await asyncio.gather(*running, return_exceptions=True)

    asyncio.run(main())


def report(out: Path, config_path: Path, store_url: str, echo: Any) -> None:
    """Score every version against the base on the held-out problems; live rewards; the plot."""
    from agl_trainer.config import load_config
    from agl_trainer.evaluate import evaluate
    from agl_trainer.improve.state import STATE_FILE, ImproveState
    from agl_trainer.improve.watch import StoreWatcher
    from agl_trainer.stats import mean_se, paired_change

    config = load_config(config_path, [f"output_dir={out / 'service'}", f"traces.store={store_url}"])
    state = ImproveState.load(out / "service" / STATE_FILE, "calc")
    assert state is not None
    watcher = StoreWatcher(config.traces)  # type: ignore[arg-type]
    watcher.refresh()
    live = watcher.live_rewards()
    calls = watcher.calls_by_version()
    served = watcher.versions_of_rollouts()
    watcher.close()
    # what the users could not corrupt: whether each session's answer was right, by the version serving it
    from agl_core import session_rollout_id

    right: dict[int, list[float]] = {}
    corrupted = 0
    for line in (out / "ratings.jsonl").read_text().splitlines():
        rating = json.loads(line)
        corrupted += bool(rating["corrupted"])
        versions = served.get(session_rollout_id(rating["session"]), set())
        if len(versions) == 1:
            right.setdefault(next(iter(versions)), []).append(float(rating["right"]))
    plain = config.model_copy(update={"improve": None})
    echo("scoring the base model on the held-out problems")
    base = evaluate(plain).result
    rows = []
    for v in state.versions:
        if v.adapter is None or v.version == 0:
            score, change = base, (0.0, 0.0, base.n)
        else:
            echo(f"scoring v{v.version} on the held-out problems")
            score = evaluate(plain, checkpoint=v.adapter).result
            paired = paired_change(base.task_scores, score.task_scores)
            change = (paired.change, paired.se, paired.n)
        rewards = live.get(v.version, [])
        live_mean, live_se = mean_se(rewards) if rewards else (float("nan"), float("nan"))
        gate = v.gate
        parent = "-" if v.parent is None else f"v{v.parent}"
        rows.append(
            f"| v{v.version} | {v.status} | {parent} | {len(v.trained_on)} |"
            f" {score.mean:.3f} ± {score.se:.3f} | {change[0]:+.3f} ± {change[1]:.3f} |"
            + (
                f" {gate.change:+.3f} ± {gate.se:.3f} ({gate.decision}) |"
                if gate and gate.change is not None
                else " - |"
            )
            + (f" {live_mean:.3f} ± {live_se:.3f} (n={len(rewards)}) |" if rewards else " - |")
            + (" {:.3f} ± {:.3f} |".format(*mean_se(right[v.version])) if right.get(v.version) else " - |")
        )
    lines = [
        f"# agl improve on the calculator agent ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"held-out: the first {base.n} problems of val.jsonl, greedy; live: the users' ratings of the"
        f" sessions each version served, the {corrupted} inverted ones included; right answers: the same"
        " sessions by whether the answer was right.",
        "",
        "| version | status | parent | sessions trained on | held-out | vs base (paired) | gate: vs parent"
        " (paired) | live reward (ratings) | live: right answers |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "events:",
        *[
            f"- {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['kind']}: {e['message']}"
            for e in state.events
        ],
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    echo("\n".join(lines))
    plot_calls(calls, out / "calls_by_version.png")


def plot_calls(calls: list[tuple[int, int]], path: Path, bin_s: float = 30.0) -> None:
    """Share of the gateway's calls each version served, per ``bin_s`` seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not calls:
        return
    start = calls[0][0]
    versions = sorted({v for _, v in calls})
    bins: dict[int, dict[int, int]] = {}
    for t, v in calls:
        b = int((t - start) / 1e9 // bin_s)
        bins.setdefault(b, dict.fromkeys(versions, 0))[v] += 1
    xs = sorted(bins)
    shares = [[bins[b][v] / sum(bins[b].values()) for b in xs] for v in versions]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.stackplot([x * bin_s / 60 for x in xs], shares, labels=[f"v{v}" for v in versions], step="post")
    ax.set_xlabel("minutes since the first call")
    ax.set_ylabel(f"share of calls ({bin_s:.0f} s bins)")
    ax.set_ylim(0, 1)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_title("which version served the production calls")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    from agl_trainer.config import add_override_argument

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/calc_improve"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--corrupt-round", type=int, default=3, help="0: none")
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between session starts")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--reward-delay", type=float, default=5.0)
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="write the report of a finished --out again (its store file)",
    )
    add_override_argument(parser, "improve.min_new_rollouts=16")  # passed on to agl improve
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.interval <= 0 or args.concurrency < 1 or args.reward_delay < 0:
        parser.error("--rounds and --concurrency must be at least 1, --interval above 0, --reward-delay >= 0")
    out: Path = args.out.resolve()
    if args.report_only:
        report(out, HERE / "improve.yaml", str(out / "store.sqlite"), print)
        return 0
    if out.exists() and any(out.iterdir()):
        parser.error(f"{out} is not empty; remove it or pass another --out")
    out.mkdir(parents=True, exist_ok=True)
    tasks = [json.loads(line) for line in (HERE / "train.jsonl").read_text().splitlines() if line.strip()]
    store_port, gateway_port = free_port(), free_port()
    store_url, gateway = f"http://127.0.0.1:{store_port}", f"http://127.0.0.1:{gateway_port}"
    env = {**os.environ, "AGL_GATEWAY_ADMIN_TOKEN": secrets.token_hex(16)}
    agl = [sys.executable, "-m", "agl_core.cli"]
    logs = {name: (out / f"{name}.log").open("w") for name in ("store", "gateway", "improve")}
    processes: list[subprocess.Popen[Any]] = []
    stop = threading.Event()
    started = time.monotonic()

    def echo(line: str) -> None:
        print(f"[{time.monotonic() - started:6.0f}s] {line}", flush=True)

    try:
        store = subprocess.Popen(
            [
                *agl,
                "store",
                "serve",
                "--db",
                str(out / "store.sqlite"),
                "--http-port",
                str(store_port),
                "--no-grpc",
            ],
            stdout=logs["store"],
            stderr=subprocess.STDOUT,
            env=env,
        )
        processes.append(store)
        wait_http(f"{store_url}/healthz", store, 60, "agl store serve")
        gw = subprocess.Popen(
            [
                *agl,
                "gateway",
                "serve",
                "--backend",
                "hf",
                "--model",
                "smollm2",
                "--served-name",
                "policy",
                "--capture",
                "--store-url",
                store_url,
                "--port",
                str(gateway_port),
                "--admin-token",
                env["AGL_GATEWAY_ADMIN_TOKEN"],
                "--threads",
                "1",
                "--max-tokens",
                "40",
            ],
            stdout=logs["gateway"],
            stderr=subprocess.STDOUT,
            env=env,
        )
        processes.append(gw)
        wait_http(f"{gateway}/health", gw, 300, "agl gateway serve")
        echo(f"production: store {store_url}, gateway {gateway} (capture, base model)")
        users = Users(
            store_url,
            out / "service" / "improve.json",
            args.corrupt_round,
            args.reward_delay,
            out / "ratings.jsonl",
        )
        population = threading.Thread(
            target=clients,
            args=(gateway, tasks, users, stop, args.interval, args.concurrency, 0),
            daemon=True,
        )
        population.start()
        gateways = json.dumps(
            [{"url": gateway, "admin_token_env": "AGL_GATEWAY_ADMIN_TOKEN", "name": "production"}]
        )
        improve = subprocess.Popen(
            [
                *agl,
                "improve",
                str(HERE / "improve.yaml"),
                "--set",
                f"output_dir={out / 'service'}",
                "--set",
                f"traces.store={store_url}",
                "--set",
                f"improve.rounds={args.rounds}",
                "--set",
                f"improve.gateways={gateways}",
                *[x for o in args.overrides for x in ("--set", o)],
            ],
            stdout=logs["improve"],
            stderr=subprocess.STDOUT,
            env=env,
        )
        processes.append(improve)
        echo(
            f"agl improve started ({args.rounds} rounds; round {args.corrupt_round} gets inverted ratings);"
            f" its log: {out / 'improve.log'}"
        )
        seen = 0
        while improve.poll() is None:
            time.sleep(5)
            text = (out / "improve.log").read_text()
            for line in text.splitlines()[seen:]:
                if line.startswith(
                    ("round", "production", "publishing", "rolled", "done", "waiting for the")
                ):
                    echo(line)
            seen = len(text.splitlines())
        echo(f"agl improve exited with {improve.returncode}")
        stop.set()
        population.join(timeout=300)
        users.stopping.set()
        users.thread.join(timeout=120)
        if improve.returncode != 0:
            return improve.returncode
        report(out, HERE / "improve.yaml", store_url, echo)
        echo(f"done in {(time.monotonic() - started) / 60:.1f} min: {out / 'report.md'}")
        return 0
    finally:
        stop.set()
        for process in reversed(processes):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()


if __name__ == "__main__":
    raise SystemExit(main())
