"""The harness frees the session's cluster of what a test left there (tests/support/cluster_leftovers.py,
run after every test on `dask_cluster` by tests/conftest.py): one failed test held both
workers and every gang test after it waited until its timeout (issue 47)."""

from __future__ import annotations

import contextlib
import time
from datetime import datetime, timezone

import distributed

from prefect_ddp.tasks.gang import cluster_workers
from prefect_ddp.tasks.gang.lease import leased_workers
from tests.support.cluster_leftovers import SharedCluster

LEAVER = "tests/test_example.py::test_that_failed_holding_a_gang"


def test_a_lease_left_held_is_freed_and_the_next_gang_takes_both_workers_at_once(dask_cluster):
    shared = SharedCluster(dask_cluster, workers=2)
    leaver = distributed.Client(dask_cluster.scheduler_address, set_as_default=False)
    never_left = contextlib.ExitStack()
    try:
        started = datetime.now(timezone.utc)
        assert shared.free_after(LEAVER, started) is None  # nothing left: nothing done, nothing said
        workers = cluster_workers(leaver)
        # As a test that failed inside the block and kept its client: never given back.
        never_left.enter_context(leased_workers(leaver, None, LEAVER, timeout_s=60))
        report = shared.free_after(LEAVER, started, give_back_s=1)  # no need to wait long for what never comes
        assert report is not None
        assert report.startswith(f"{LEAVER} left the session's Dask cluster in use: "), report
        for address in workers:
            assert f"{address} leased by {LEAVER} (since " in report, report
        assert "restarted the workers" in report and report.endswith("the cluster is free."), report
        assert not shared.leftovers()
        # The next gang takes both workers at once, the leaver's client still renewing its old leases.
        with leased_workers(leaver, None, "the next test", timeout_s=60) as leases:
            assert len(leases) == 2 and not set(leases) & set(workers)  # restarted: new addresses
    finally:
        never_left.close()  # leases of the workers as they were: the scheduler knows them no more
        leaver.close()
        shared.close()


def test_a_task_left_running_is_seen_until_it_ends_even_once_cancelled_in_dask(dask_cluster):
    """A task keeps a worker's only thread: a rank sent there waits behind it, and its gang
    with it (a rank whose Dask task was cancelled runs on too, as `executing`)."""
    shared = SharedCluster(dask_cluster, workers=2)
    try:
        (worker, _) = cluster_workers(shared.client)
        with distributed.Client(dask_cluster.scheduler_address, set_as_default=False) as leaver:
            sleep = leaver.submit(time.sleep, 3, workers=[worker], pure=False)
            deadline = time.monotonic() + 120
            while not shared.leftovers().tasks:
                assert time.monotonic() < deadline, "the sleep never started"
                time.sleep(0.1)
            leaver.cancel([sleep], force=True)  # the scheduler forgets it; its thread sleeps on
            assert sleep.cancelled() and not leaver.processing()[worker]
            assert shared.leftovers().tasks == {worker: [sleep.key]}
        assert not shared.wait_until_free(120, since=None)  # until it has slept its 3 s
    finally:
        shared.close()
