"""The CPU-bound steps outside training (decode-check, shard writing, batch-predict's decoding) on
every core their Dask worker may use, not on the one thread that runs their task.

dask-cuda's LocalCUDACluster runs one worker per GPU with one thread, pinned to that GPU's
cores: a task that decoded its images in its own thread used one core of them. PIL's JPEG
decode and resize release the GIL, so threads of one process decode in parallel
(docs/architecture.md, "Data: CPU steps on every core").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import distributed
import torch

from prefect_ddp.tasks.gang import cpu_set

Item = TypeVar("Item")
Result = TypeVar("Result")


def cpu_threads() -> int:
    """Threads for one CPU-bound step in this process: the CPUs it may run on (its affinity) over the
    Dask worker threads that share them, at least 1.

    Called in a task's thread: each of a worker's threads may run such a step at once, so each
    takes its share. Outside a Dask worker (a script, the flow's own process) the step is alone.
    """
    return max(1, len(cpu_set()) // worker_threads())


def worker_threads() -> int:
    """The threads of the Dask worker running this task; 1 outside a worker."""
    try:
        nthreads: int = distributed.get_worker().state.nthreads
    except ValueError:  # get_worker's "No worker found"
        return 1
    return nthreads


def map_on_cpus(function: Callable[[Item], Result], items: Sequence[Item]) -> list[Result]:
    """`[function(item) for item in items]`, in order, on `cpu_threads()` threads.

    For functions that spend their time where the GIL is released (PIL's decode and resize,
    torch's operators). An exception `function` raises is raised here, the first in `items`'
    order, as in the list comprehension; items not started by then are not run. The threads
    are this call's own and carry no context: `function` sees no Prefect run context and no
    Dask worker.

    Each thread runs torch's operators on one thread: a new thread takes the process's torch
    threads, and each that ran an operator (batch-predict's transform) started a team of that many,
    up to 96 x 96 threads on a worker of 96 CPUs. One each keeps the threads within the CPUs.
    Setting it sets the default new threads take too, which is given back once the last of the
    process's calls that overlap ends (`_OneTorchThread`): a thread that starts its first operator
    meanwhile elsewhere in the process runs it on one.
    """
    size = max(1, min(cpu_threads(), len(items)))
    with _ONE_TORCH_THREAD, ThreadPoolExecutor(max_workers=size, thread_name_prefix="cpu-share",
                                               initializer=torch.set_num_threads, initargs=(1,)) as threads:
        return list(threads.map(function, items))


class _OneTorchThread:
    """Held while a `map_on_cpus` call runs: the first of overlapping calls keeps the torch threads
    new threads take, the last gives them back, so that overlapping calls never keep each other's 1."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls = 0
        self._kept = 0

    def __enter__(self) -> None:
        with self._lock:
            if not self._calls:
                self._kept = torch.get_num_threads()
            self._calls += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._calls -= 1
            if not self._calls:
                torch.set_num_threads(self._kept)


_ONE_TORCH_THREAD = _OneTorchThread()
