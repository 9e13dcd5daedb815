"""The gang reads the whole worker set, also where `scheduler_info()` returns only five.

distributed 2025.4 to 2026.6 (which pyproject allows) default `Client.scheduler_info()` to
`n_workers=5`; from 2026.7 it returns every worker. The client below keeps the old default,
so that the test shows the trap on whichever version is installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import distributed
import pytest

from tasks.gang.lease import leased_workers
from tasks.gang.plan import cluster_workers


class ClientWithTheFiveWorkerDefault(distributed.Client):
    """A real client whose `scheduler_info()` has distributed 2025.4-2026.6's default."""

    def scheduler_info(self, n_workers: int = 5, **kwargs: Any) -> Any:
        return super().scheduler_info(n_workers=n_workers, **kwargs)


@pytest.fixture(scope="module")
def seven_workers() -> Iterator[distributed.LocalCluster]:
    """More workers than the old default shows; threads in this process, so cheap to start."""
    with distributed.LocalCluster(n_workers=7, processes=False, threads_per_worker=1, dashboard_address=":0") as cluster:
        yield cluster


def test_a_lease_sees_and_takes_every_worker_of_a_cluster_of_seven(seven_workers):
    everyone = sorted(seven_workers.scheduler.workers)
    with ClientWithTheFiveWorkerDefault(seven_workers.scheduler_address) as client:
        assert len(client.scheduler_info()["workers"]) == 5  # the trap
        assert sorted(cluster_workers(client)) == everyone
        with leased_workers(client, world_size=7, holder="test", timeout_s=5) as leased:
            assert sorted(leased) == everyone
