"""Give the memory a finished rank freed back to the operating system.

A rank runs in a thread of its own (`rank.leave_worker_thread_pool`: a pool thread that leaves
the pool, replaced by a new one, so each gang's ranks run in other threads), and glibc serves
each thread from an arena that keeps what the thread freed, in holes between blocks still in
use, for the next allocation. A worker that runs gang after gang kept growing:
two workers of a LocalCluster, the training flow 12 times (mobilenet_v3_small), went
893 -> 1,198 and 865 -> 1,048 MB, and a `malloc_trim(0)` at the end took them back to 928 and
911 (bench/RESULTS.md, "Worker memory over many runs"). Dask's answer, the nanny's
`MALLOC_TRIM_THRESHOLD_`, trims during training and made it slower, so the gang drops it
(blocks/cluster.py). Trimming once, after a rank's training, costs training nothing: about 0.3 s
for 2 GB freed (collection and trim), during which other threads of the worker wait only if
they share the rank's arena (`MALLOC_ARENA_MAX=1`).
"""

from __future__ import annotations

import ctypes
import functools
import gc
from collections.abc import Callable


def return_freed_memory() -> None:
    """Collect the finished rank's garbage, then hand glibc's free pages back (all arenas)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
