"""Worker leases on real clusters: every worker seen, none shared, nothing left in the scheduler.

distributed 2025.4 to 2026.6 (which pyproject allows) default `Client.scheduler_info()` to
`n_workers=5`; from 2026.7 it returns every worker. The client below keeps the old default,
so that the test shows the trap on whichever version is installed.

A lease is a `distributed.Lock` and a holder `distributed.Variable` per worker address, in
the scheduler. A nanny brings a restarted worker back at a new address, so on a long-lived
cluster these would pile up (one of each per address ever seen) unless each gang takes
its own away; the tests read the scheduler's own tables to see that nothing is left.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dask
import distributed
import pytest

from prefect_ddp.tasks.gang import GangError, cluster_workers
from prefect_ddp.tasks.gang.lease import PREFIX, leased_workers
from tests.support.external_dask import REPO

SINCE = r"\(since \d\d:\d\d:\d\d UTC\)"  # when the holder took the worker, as the message says it
# A gang's flow process that dies in its block, its lease and holder still in the scheduler.
DIES_HOLDING = """
import os, sys
import distributed
from prefect_ddp.tasks.gang.lease import leased_workers

with distributed.Client(sys.argv[1]) as client, leased_workers(client, 1, "a gang whose process died", 5):
    os._exit(3)
"""


class ClientWithTheFiveWorkerDefault(distributed.Client):
    """A real client whose `scheduler_info()` has distributed 2025.4-2026.6's default."""

    def scheduler_info(self, n_workers: int = 5, **kwargs: Any) -> Any:
        return super().scheduler_info(n_workers=n_workers, **kwargs)


@pytest.fixture(scope="module")
def seven_workers() -> Iterator[distributed.LocalCluster]:
    """More workers than the old default shows; threads in this process, so cheap to start."""
    with distributed.LocalCluster(n_workers=7, processes=False, threads_per_worker=1, dashboard_address=":0") as cluster:
        yield cluster


@pytest.fixture
def nanny_client() -> Iterator[distributed.Client]:
    """A client of 2 worker processes with nannies, which restart a worker at a new address.

    A cluster of its own: the test restarts a worker and reads the scheduler's tables, which
    the session's shared cluster fills with other tests' state.
    """
    with (distributed.LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
          distributed.Client(cluster) as client):
        yield client


def lease_entries(client: distributed.Client) -> dict[str, list[str]]:
    """Each of the scheduler's semaphore and variable tables that holds a name of a lease, with those names."""

    def read(dask_scheduler: distributed.Scheduler) -> dict[str, list[str]]:
        semaphores = dask_scheduler.extensions["semaphores"]
        tables = {"max_leases": semaphores.max_leases, "leases": semaphores.leases,
                  "lease_timeouts": semaphores.lease_timeouts, "events": semaphores.events,
                  **{f"metrics[{metric!r}]": values for metric, values in semaphores.metrics.items()},
                  "variables": dask_scheduler.extensions["variables"].variables}
        found = {table: sorted(name for name in names if isinstance(name, str) and name.startswith(PREFIX))
                 for table, names in tables.items()}
        return {table: names for table, names in found.items() if names}

    return client.run_on_scheduler(read)


def replace_worker(client: distributed.Client, address: str) -> str:
    """Restart the worker at `address` through its nanny; the new process's address."""
    before = set(cluster_workers(client))
    client.restart_workers([address])
    client.wait_for_workers(len(before))
    (new,) = set(cluster_workers(client)) - before
    return new


def test_a_lease_sees_and_takes_every_worker_of_a_cluster_of_seven(seven_workers):
    everyone = sorted(seven_workers.scheduler.workers)
    with ClientWithTheFiveWorkerDefault(seven_workers.scheduler_address) as client:
        assert len(client.scheduler_info()["workers"]) == 5  # the trap
        assert sorted(cluster_workers(client)) == everyone
        with leased_workers(client, world_size=7, holder="test", timeout_s=5) as leased:
            assert sorted(leased) == everyone


def test_every_read_of_the_worker_set_sees_every_worker_while_the_client_refreshes_its_copy(seven_workers):
    # The client refreshes its cached scheduler_info() every 2 s with a copy of no workers;
    # a read that raced with it saw an empty cluster. Refreshing every millisecond makes
    # the race likely within a few hundred reads.
    everyone = sorted(seven_workers.scheduler.workers)
    with dask.config.set({"distributed.client.scheduler-info-interval": "1ms"}):
        with distributed.Client(seven_workers.scheduler_address) as client:
            seen = [len(cluster_workers(client)) for _ in range(300)]
    assert set(seen) == {len(everyone)}, f"reads that missed workers: {sorted(set(seen) - {len(everyone)})}"


def test_gangs_leave_nothing_in_the_scheduler_after_many_leases_a_wait_in_vain_and_a_restart(nanny_client):
    client = nanny_client
    for number in range(10):
        with leased_workers(client, world_size=1 + number % 2, holder=f"gang {number}", timeout_s=5) as leased:
            assert len(leased) == 1 + number % 2
    with leased_workers(client, world_size=2, holder="gang A", timeout_s=5) as leases:
        held = list(leases)
        with pytest.raises(GangError, match=rf"Held: {re.escape(held[0])} by gang A {SINCE}; {re.escape(held[1])} by gang A {SINCE}\. "):
            with leased_workers(client, world_size=1, holder="gang B", timeout_s=0.1):
                pass
    restarted = replace_worker(client, held[0])
    with leased_workers(client, world_size=2, holder="after the restart", timeout_s=5) as leased:
        assert restarted in leased and held[0] not in leased
    assert lease_entries(client) == {}


def test_concurrent_gangs_never_share_a_worker_never_fail_and_leave_nothing(seven_workers):
    # Sweep trials lease at once like this; each gang also tidies the scheduler as it ends,
    # closing locks under the others' feet.
    holding: dict[str, set[str]] = {}  # worker address -> the gangs in their block that leased it
    clashes: list[str] = []
    guard = threading.Lock()

    def gang(number: int) -> int:
        with distributed.Client(seven_workers.scheduler_address) as client:
            for round_ in range(20):
                name = f"gang {number}, round {round_}"
                with leased_workers(client, world_size=1 + (number + round_) % 3, holder=name, timeout_s=120) as leased:
                    with guard:
                        for address in leased:
                            others = holding.setdefault(address, set())
                            clashes.extend(f"{address}: {other} and {name}" for other in others)
                            others.add(name)
                    time.sleep(0.01)
                    with guard:
                        for address in leased:
                            holding[address].discard(name)
        return round_ + 1

    with ThreadPoolExecutor(6) as pool:
        rounds = [future.result() for future in [pool.submit(gang, number) for number in range(6)]]
    assert rounds == [20] * 6 and clashes == []
    with distributed.Client(seven_workers.scheduler_address) as client:
        assert lease_entries(client) == {}


def test_a_lease_whose_process_died_is_given_back_by_the_lease_timeout_and_then_tidied():
    # The scheduler checks leases every 100 ms, not every 10 s, so that the test is short.
    with (dask.config.set({"distributed.scheduler.locks.lease-validation-interval": "100ms"}),
          distributed.LocalCluster(n_workers=1, processes=False, protocol="tcp", dashboard_address=":0") as cluster,
          distributed.Client(cluster) as client):
        (worker,) = cluster_workers(client)
        dead = subprocess.run(
            [sys.executable, "-c", DIES_HOLDING, cluster.scheduler_address], timeout=120, capture_output=True, text=True,
            env=os.environ | {"PYTHONPATH": str(REPO), "DASK_DISTRIBUTED__SCHEDULER__LOCKS__LEASE_TIMEOUT": "3s"},
        )
        assert dead.returncode == 3, dead.stderr
        with pytest.raises(GangError, match=rf"Held: {re.escape(worker)} by a gang whose process died {SINCE}\. "):
            with leased_workers(client, world_size=1, holder="the next gang", timeout_s=0.1):
                pass
        with leased_workers(client, world_size=1, holder="the next gang", timeout_s=30) as leased:
            assert list(leased) == [worker]
        assert lease_entries(client) == {}
