"""How the trainer's process shares the CPU between torch's thread pool and its own Python threads.

torch's CPU build runs its intra-op pool on GNU OpenMP, whose threads by default *spin* for a while after
each parallel region, waiting for the next one. On a 2-core machine the trainer's other threads (the
gateway answering the agents, the runners, the store) then find both cores busy with threads doing
nothing, and the generation loop's many small parallel regions (one per layer per token) keep them
spinning. ``OMP_WAIT_POLICY=PASSIVE`` makes them sleep instead. OpenMP reads it once, when torch loads
it, so :func:`passive_openmp` runs before the commands import torch; a user's own setting wins.

Measured (``bench/main_job_profile.py --steps 2 --val-tasks 10``, quiet 2-core machine): 266 s of CPU for
a 185 s job spinning, 229 s for 169 s passive; the update phase 29.5 -> 27.2 s, generation unchanged.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["passive_openmp", "size_torch_threads"]

logger = logging.getLogger(__name__)


def passive_openmp() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` for this process unless the user set it or torch is already loaded
    (then it could no longer take effect). Returns whether it was set."""
    if os.environ.get("OMP_WAIT_POLICY"):
        return False
    if "torch" in sys.modules:
        logger.debug("torch is loaded already: OpenMP's wait policy stays as it is")
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def size_torch_threads(threads: int) -> None:
    """``threads`` for torch's intra-op pool, one for its inter-op pool (the trainer runs no parallel
    graphs, and each pool thread it starts is one more thread on the same cores)."""
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already started or set (a second run in one process): it stays as it is
        pass
