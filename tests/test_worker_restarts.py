"""A worker of the project's own clusters comes back from a restart, however soon after the last.

The gang restarts the workers of ranks that did not stop (tasks/gang/supervise.py). Dask's
cluster object closes a worker's nanny for good 15 s after the scheduler lost that worker
(distributed.yaml's `lost-worker-timeout`) unless a worker of its name is up at that
moment; a worker restarting again just then, importing torch (4-5 s here when workers were
spawned), was lost (docs/architecture.md, "Facts: Dask"). The test restarts a worker a second
time so that it is down when the first restart's 15 s run out: its cluster's workers take
as long to start as spawned ones did (tests/support/slow_worker_start.py), where the
project's forked workers are back in about 1.5 s.
"""

from __future__ import annotations

import os
import sys
import time

import distributed

from prefect_ddp.blocks.cluster import LOCAL_CLUSTER_PRELOAD, PRELOADED_MODULES, create_local_cluster
from prefect_ddp.tasks.gang import cluster_workers

DASK_LOST_WORKER_TIMEOUT_S = 15  # distributed.yaml's default
SECOND_RESTART_AFTER_S = DASK_LOST_WORKER_TIMEOUT_S - 3
RESTART_TIMEOUT_S = 60


def preloaded() -> bool:
    return all(module in sys.modules for module in PRELOADED_MODULES)


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


def restart_every_worker(client: distributed.Client) -> None:
    """Restart the workers through their nannies, as the gang does, and see new processes up."""
    before = client.run(os.getpid)
    client.restart_workers(sorted(cluster_workers(client)), timeout=RESTART_TIMEOUT_S)
    client.wait_for_workers(len(before), timeout=RESTART_TIMEOUT_S)
    after = client.run(os.getpid)
    assert len(after) == len(before) and not set(after.values()) & set(before.values()), f"{before} -> {after}"


def test_a_worker_restarted_again_while_the_first_restarts_timer_runs_out_comes_back(prefect_api):
    slow_to_start = [*LOCAL_CLUSTER_PRELOAD, "tests.support.slow_worker_start"]
    with create_local_cluster(n_workers=2, preload=slow_to_start) as cluster, distributed.Client(cluster) as client:
        n_workers = len(cluster_workers(client))
        first = time.monotonic()
        restart_every_worker(client)
        sleep_until(first + SECOND_RESTART_AFTER_S)
        restart_every_worker(client)  # down, starting slowly, when the first restart's timer ends
        sleep_until(first + DASK_LOST_WORKER_TIMEOUT_S + 2)  # a nanny closed by that timer is gone now
        assert len(cluster_workers(client)) == n_workers
        assert set(client.run(preloaded).values()) == {True}
