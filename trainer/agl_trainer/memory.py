"""Keeping the trainer's resident memory down on CPU, where glibc's allocator is what holds it.

Two habits of glibc's malloc cost a training process gigabytes it does not use:

- every thread that allocates under contention gets its own *arena* (up to 8 per core), and memory freed
  in one arena serves only that arena: the generation thread's KV caches, the update's activations and
  the runners' buffers pile up side by side;
- memory freed inside an arena stays resident until something trims it, so the high-water mark of one
  phase (a batch's KV caches) stays when the next phase (the update) allocates its own.

:func:`limit_arenas` caps the arenas (as ``MALLOC_ARENA_MAX`` does, unless the user set that), early,
before the trainer starts its threads; :func:`release_free_memory` hands freed pages back to the kernel
(``malloc_trim``) between phases. Both do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from typing import Any

__all__ = ["ARENAS", "limit_arenas", "release_free_memory"]

logger = logging.getLogger(__name__)

#: Arenas the trainer's allocations share (glibc's default is 8 per core).
ARENAS = 2
_M_ARENA_MAX = -8  # mallopt parameter number in glibc's malloc.h


@functools.cache
def _glibc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):  # musl, or no C library to load
        return None
    return libc


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``arenas`` for the threads started from now on, unless
    ``MALLOC_ARENA_MAX`` is set (the user's choice wins). Returns whether the cap was set."""
    libc = _glibc()
    if libc is None or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, arenas))


def release_free_memory() -> None:
    """Return the allocator's free pages to the kernel (every arena), so that the next phase's peak does
    not stack on the last one's garbage. Costs milliseconds; a no-op off glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
