"""Dask workers started from a process that imported prefect_ddp never run its `__main__` again.

A worker process that Python starts by spawn or from a forkserver first re-imports the script
that started it (as `__mp_main__`), as multiprocessing does for every such child. A script
whose top level calls `batch_predict`, `transfer_learning`, `sweep` or `run_gang` without
`if __name__ == "__main__":` then ran that call again in every worker: each started a flow run
of its own and a cluster of its own, which multiprocessing refuses while a child is still
starting, so every nanny failed and the script waited for workers that never came
(docs/deployments.md, "Runs from a plain script"). Code piped on stdin failed at once: there is
no file `<stdin>` to import.

A Dask worker needs nothing of the script: Dask sends what it runs with cloudpickle, which
sends functions and classes defined in `__main__` by value (tasks/gang/sending.py). So the
worker processes of a Dask nanny start as they do from a notebook, whose `__main__` has no
file: without the script's path or module name in what multiprocessing hands them. Every other
process (a user's own pool, a DataLoader's loaders) starts as Python starts it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from multiprocessing import spawn
from typing import Any

# The name a Dask nanny gives the process of its worker (distributed/nanny.py, WorkerProcess.start).
DASK_WORKER_PROCESS = "Dask Worker process (from Nanny)"
# What multiprocessing's preparation data holds of the parent's `__main__` (multiprocessing/spawn.py).
MAIN_ENTRIES = ("init_main_from_path", "init_main_from_name")


def without_main(get_preparation_data: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    """`get_preparation_data`, leaving the parent's `__main__` out of a Dask worker process's."""

    @functools.wraps(get_preparation_data)
    def preparation_data(name: str) -> dict[str, Any]:
        data = get_preparation_data(name)
        if name == DASK_WORKER_PROCESS:
            for entry in MAIN_ENTRIES:
                data.pop(entry, None)
        return data

    preparation_data.leaves_main_out = True  # type: ignore[attr-defined]
    return preparation_data


def start_workers_without_main() -> None:
    """From now on, worker processes Dask nannies start in this process do not import its `__main__`.

    Idempotent. Both spawn and forkserver children read `spawn.get_preparation_data` from the
    module as they start, so replacing it there is enough.
    """
    if not getattr(spawn.get_preparation_data, "leaves_main_out", False):
        spawn.get_preparation_data = without_main(spawn.get_preparation_data)  # type: ignore[assignment]
