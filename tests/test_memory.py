"""The trainer's allocator settings (``agl_trainer.memory``), checked in fresh interpreters: freed memory
in the middle of the heap goes back to the kernel, and the arena cap is set unless the user set one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")

PROBE = """
import os, sys
from agl_trainer.memory import release_free_memory

def rss_mb():
    with open(f"/proc/{os.getpid()}/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith("VmRSS")) / 1024

# 300 MB in 100 KB blocks (below glibc's mmap threshold: they live in the heap), then every other one
# freed: the heap cannot shrink from its top, so without a trim those pages stay resident
blocks = [bytearray(100 * 1024) for _ in range(3000)]
for b in blocks:
    b[::4096] = b"x" * len(b[::4096])  # touch every page
del blocks[::2]
before = rss_mb()
if sys.argv[1] == "trim":
    release_free_memory()
print(before, rss_mb())
"""


def _run(*args: str, env: dict[str, str] | None = None) -> list[float]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        env=env or dict(os.environ),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [float(x) for x in done.stdout.split()]


def test_release_free_memory_returns_freed_heap_pages_to_the_kernel():
    before, after = _run("trim")
    assert before - after > 100, (before, after)  # about 150 MB were freed in the middle of the heap
    kept_before, kept_after = _run("none")
    assert kept_before - kept_after < 20, (kept_before, kept_after)  # without it they stay resident


def test_the_arena_cap_is_set_unless_the_user_chose_one():
    code = "from agl_trainer.memory import limit_arenas; print(limit_arenas())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    ours = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert ours.stdout.strip() == "True", ours.stderr
    theirs = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**env, "MALLOC_ARENA_MAX": "4"},
        timeout=120,
    )
    assert theirs.stdout.strip() == "False", theirs.stderr
