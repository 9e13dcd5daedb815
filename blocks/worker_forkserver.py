"""Workers of the local CPU clusters this project starts are forked from a process that has
already imported torch and torchvision, instead of each importing them anew.

Spawning a worker cost about 5 s of CPU here, nearly all of it importing torch and
torchvision (docs/architecture.md, "Facts: Dask"). Dask can start worker processes from a
multiprocessing forkserver (`distributed.worker.multiprocessing-method`), which imports its
preload modules once and forks each worker from itself: a 2-worker cluster started in 1.3 s
of wall time instead of 5.2 s (`python -m bench.worker_start`), and so does every worker a
nanny restarts after a rank was killed or a gang stopped.

Prefect is not preloaded: it reads its settings (PREFECT_API_URL among them) once, on import,
and each worker is told its API URL only after the fork, by its nanny.

A forked worker starts with the forkserver's environment, which was this process's when the
first worker started. `create_local_cluster`'s nannies hand each worker this process's
environment of the moment they start it, and the worker drops what it inherited that they did
not give (blocks/nanny_environment.py), so it sees what a spawned worker would: a variable set,
changed or removed since (where, as with spawn, a variable this process has wins over Dask's
`distributed.nanny.*environ` defaults).

A process's default start method is the one that started it: each worker sets spawn back
(`dask_setup`, this module being one of its preloads), so a DataLoader that names no start
method starts its loaders in a worker as before, not through a forkserver of the worker's own
that outlives them. The project's own loaders fork (tasks/data/dataset.py).

The GPU cluster (dask-cuda) keeps spawn: this project has not measured CUDA in workers
forked from a process that imported torch (docs/architecture.md, "Facts: Dask").
"""

from __future__ import annotations

import multiprocessing

from distributed import Worker

FORKSERVER_PRELOAD = ["distributed", "torch", "torchvision"]
FORKSERVER_CONFIG = {"distributed.worker.multiprocessing-method": "forkserver"}
SPAWN_CONFIG = {"distributed.worker.multiprocessing-method": "spawn"}


def preload_forkserver() -> None:
    """Have the forkserver import torch and torchvision before it forks the first worker.

    Dask sets its own preload list (distributed and its dependencies) the first time it takes
    its multiprocessing context in a process, and never again: this replaces it afterwards.
    A forkserver already running keeps what it has imported; its workers import torch
    themselves, as spawned ones do.
    """
    from distributed.utils import get_mp_context

    get_mp_context()
    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)


def dask_setup(worker: Worker) -> None:
    """Dask calls this in each worker as it starts: spawn, a spawned worker's default, back as its start method."""
    multiprocessing.set_start_method("spawn", force=True)
