"""The run's cluster starts beside the flow's listing and closes beside its report.

What it decides for the user: that a run's cluster is up without the flow waiting for it
where it can, and that whatever happens (a failure before the cluster is needed, a start
that fails, a close under way when the flow ends) no cluster outlives its `with` block.
Real LocalClusters: threaded ones where processes add nothing to what is checked.
"""

from __future__ import annotations

import threading

import psutil
import pytest
from distributed import LocalCluster
from prefect_dask import DaskTaskRunner

from prefect_ddp.blocks.cluster import create_local_cluster
from prefect_ddp.blocks.cluster_lifetime import ClusterLifetime

START_TIMEOUT_S = 60


def threaded_runner() -> DaskTaskRunner:
    return DaskTaskRunner(cluster_class=LocalCluster,
                          cluster_kwargs={"processes": False, "n_workers": 1, "dashboard_address": ":0"})


def test_the_cluster_starts_while_the_flow_works_and_closes_when_the_block_ends():
    with ClusterLifetime(threaded_runner) as cluster:
        assert threading.current_thread() is threading.main_thread()
        # The flow has not asked for it: the start is under way in a thread of its own.
        cluster._start.result(timeout=START_TIMEOUT_S)
        assert cluster.runner._client is not None
        runner = cluster.ready()
        assert runner.client.submit(sum, [1, 2]).result() == 3
        started = runner._cluster
    assert started.status.name == "closed"


def test_a_close_in_background_goes_on_while_the_flow_reports_and_is_done_when_the_block_ends():
    reported = threading.Event()
    with ClusterLifetime(threaded_runner) as cluster:
        started = cluster.ready()._cluster
        cluster.close_in_background()
        cluster.close_in_background()  # twice is once
        reported.set()  # the flow's report, written while the cluster closes
    assert reported.is_set()
    assert started.status.name == "closed"


def live_children() -> set[int]:
    """This process's live descendants, less multiprocessing's resource tracker (it stays for
    the process's life once the first worker has been spawned)."""
    return {child.pid for child in psutil.Process().children(recursive=True)
            if child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(child.cmdline())}


def test_a_flow_that_fails_before_it_needs_the_cluster_leaves_no_worker_process_behind(prefect_api):
    before = live_children()  # the session's services
    with pytest.raises(ValueError, match="listing failed"):
        with ClusterLifetime(lambda: DaskTaskRunner(cluster_class=create_local_cluster,
                                                    cluster_kwargs={"n_workers": 1})) as cluster:
            assert not cluster._start.done()
            raise ValueError("listing failed")  # while the cluster is still starting
    # The block waited for the start, then closed what it started: no worker process is left.
    assert cluster.runner._cluster is not None and cluster.runner._cluster.status.name == "closed"
    assert live_children() - before == set()


def broken_cluster(**kwargs):
    raise OSError("no ports left")


def test_a_start_that_fails_raises_in_the_flow_where_it_asks_for_the_cluster():
    with pytest.raises(OSError, match="no ports left"):
        with ClusterLifetime(lambda: DaskTaskRunner(cluster_class=broken_cluster)) as cluster:
            cluster.ready()


def unreachable_scheduler() -> DaskTaskRunner:
    raise ConnectionError("Cannot reach the Dask scheduler at tcp://127.0.0.1:1")


def test_bad_input_found_before_the_cluster_is_needed_is_what_the_flow_reports():
    """Not the cluster's failure to start, which the flow never asked to see."""
    with pytest.raises(ValueError, match="only one class"):
        with ClusterLifetime(unreachable_scheduler):
            raise ValueError("only one class")
