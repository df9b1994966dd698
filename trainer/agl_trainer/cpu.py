"""How the trainer's process shares the CPU between torch's OpenMP threads and its own Python threads.

torch's CPU build runs its intra-op pool on GNU OpenMP. Every thread that runs a parallel operation gets a
pool of OpenMP worker threads of its own, kept until that thread exits. The trainer computes in several
threads (the update in its main thread, generation in the transformers backend's worker, adapter loads in
asyncio's executor), so it soon holds two or three pools of ``torch.get_num_threads()`` threads each. Once
OpenMP manages more threads than the machine has cores, it *throttles*: a worker waits a hundred spins
(about a microsecond) for the next parallel region and then sleeps, and every region afterwards wakes it
through the kernel. Generation's decoding step is some 1,500 small parallel regions (products, attention,
cache writes), so on a 2-core machine SmolLM2's step of 16 rows took 99.7 ms instead of 68.4 (92.5
instead of 50.8 with bfloat16 products) once another thread had run one parallel operation (``python
bench/openmp.py``, 2026-11-28). :func:`release_openmp_threads` lets the calling thread's pool go (OpenMP 5's
``omp_pause_resource_all``); a thread that is done computing for a while calls it (the backend's worker
after a batch when no request waits, a thread that then waits for rollouts), so the thread computing next
holds the only pool and its workers spin between regions.

``OMP_WAIT_POLICY=PASSIVE`` (the trainer's commands once set it, to keep idle workers off the cores the
agents need) costs the same wake-up on every region, so it is left to the user; by default a worker spins
for at most a few milliseconds after its last region, then sleeps.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

__all__ = ["release_openmp_threads", "size_torch_threads"]

logger = logging.getLogger(__name__)

#: OpenMP runtimes that implement ``omp_pause_resource_all`` (GNU, LLVM, Intel), as their files start.
_RUNTIMES = ("libgomp", "libomp", "libiomp")
#: ``omp_pause_soft``: the runtime's threads go, and come back at the next parallel region.
_PAUSE_SOFT = 1
_pause: Any = None
_pause_looked_up = False


def _loaded_runtime() -> str | None:
    """The file of the OpenMP runtime this process has loaded (torch's), or ``None``."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith(_RUNTIMES):
                    return path
    except OSError:  # no /proc (macOS, Windows): nothing to release
        pass
    return None


def release_openmp_threads() -> bool:
    """Let the OpenMP worker threads of the calling thread's pool exit (``omp_pause_resource_all``, soft:
    the next parallel region in this thread starts them again, a fraction of a millisecond). Returns
    whether a runtime did it; ``False`` where none is loaded or it lacks the call (OpenMP before 5.0)."""
    global _pause, _pause_looked_up
    if not _pause_looked_up:
        _pause_looked_up = True
        path = _loaded_runtime()
        if path is not None:
            try:
                function = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                logger.debug("%s has no omp_pause_resource_all: OpenMP pools stay", path)
            else:
                function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
                _pause = function
    return _pause is not None and _pause(_PAUSE_SOFT) == 0


def size_torch_threads(threads: int) -> None:
    """``threads`` for torch's intra-op pool, one for its inter-op pool (the trainer runs no parallel
    graphs, and each pool thread it starts is one more thread on the same cores)."""
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already started or set (a second run in one process): it stays as it is
        pass
