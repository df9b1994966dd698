"""How the trainer's process shares the CPU with torch's OpenMP threads: a thread done computing lets its
pool of OpenMP workers go (so the thread computing next holds the only pool and its workers spin between
parallel regions instead of being woken for each), and torch's pools are sized. Checked in fresh
interpreters, whose threads are only their own."""

from __future__ import annotations

import json
import subprocess
import sys

_RELEASE = """
import json, os, sys, threading, time
import torch
from agl_trainer.cpu import release_openmp_threads

def threads():
    return len(os.listdir("/proc/self/task"))

def settle(expected, timeout=10.0):
    deadline = time.monotonic() + timeout
    while threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()

torch.set_num_threads(2)
alone = threads()
torch.randn(4_000_000).exp()  # a parallel region: this thread's pool gets its second thread
with_pool = threads()
released = release_openmp_threads()
after = settle(alone)
{backend}
print(json.dumps({{"alone": alone, "with_pool": with_pool, "released": released, "after": after, **extra}}))
"""

_BACKEND = """
from agl_core.gateway.backend import ChatRequest
from agl_trainer.generation import hf_backend
from agl_trainer.model import load_policy
import asyncio
if {keep}:  # the worker keeps its pool (what the backend did before)
    hf_backend.release_openmp_threads = lambda: False
model, tokenizer = load_policy("tiny", seed=0)
backend = hf_backend.HFBackend(model, tokenizer, model_name="tiny")
request = ChatRequest(messages=[{{"role": "user", "content": "hello " * 300}}], max_tokens=4, temperature=0.0)
async def run():
    return [e async for e in backend.generate("tiny", request)]
asyncio.run(run())
time.sleep(1.0)  # the worker is past its batch, waiting for the next request
release_openmp_threads()
extra = {{"idle": threads()}}
"""


def _run(code: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_thread_done_computing_lets_its_openmp_workers_go():
    got = _run(_RELEASE.format(backend="extra = {}"))
    assert got["with_pool"] == got["alone"] + 1  # the pool's worker
    assert got["released"] is True
    assert got["after"] == got["alone"]  # it exited; the next parallel region starts it again


def test_the_backends_worker_lets_its_pool_go_when_no_request_waits():
    """After a batch with nothing queued, the backend's worker thread waits for requests without its
    OpenMP worker (one thread fewer than a worker that keeps its pool), so the thread that computes next
    (the update) holds the only pool."""
    released = _run(_RELEASE.format(backend=_BACKEND.format(keep=False)))
    kept = _run(_RELEASE.format(backend=_BACKEND.format(keep=True)))
    assert released["idle"] == kept["idle"] - 1


def test_size_torch_threads():
    code = (
        "import torch; from agl_trainer.cpu import size_torch_threads; size_torch_threads(2); "
        "size_torch_threads(1); print(torch.get_num_threads(), torch.get_num_interop_threads())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["1", "1"]
