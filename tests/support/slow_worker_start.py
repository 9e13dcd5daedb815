"""A Dask preload that holds each worker's start, before it registers with the scheduler, for
as long as a spawned worker took to import torch here: forked workers are up again in about
1.5 s (blocks/worker_forkserver.py), too soon to be down when Dask's lost-worker timer runs
out (tests/test_worker_restarts.py)."""

from __future__ import annotations

import time

from distributed import Worker

START_S = 5.0


def dask_setup(worker: Worker) -> None:
    time.sleep(START_S)
