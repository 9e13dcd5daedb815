"""The run's cluster starts beside the flow's listing and closes beside its report.

What it decides for the user: that a run's cluster is up without the flow waiting for it
where it can, and that whatever happens (a failure before the cluster is needed, a start
that fails, a close under way when the flow ends) no cluster outlives its `with` block.
Real LocalClusters: threaded ones where processes add nothing to what is checked.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import psutil
import pytest
from distributed import Client, LocalCluster
from prefect_dask import DaskTaskRunner

from prefect_ddp.blocks.cluster import DaskCluster, create_local_cluster
from prefect_ddp.blocks.cluster_lifetime import ClusterLifetime
from prefect_ddp.blocks.warm_cluster import IN_USE, WarmClaim, WarmClusterUnavailable

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


# multiprocessing's own helpers, which stay for the process's life once started: the resource tracker
# (with the first spawned worker) and the forkserver that forks the workers (blocks/worker_forkserver.py).
LIFELONG_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def live_children() -> set[int]:
    """This process's live descendants, less multiprocessing's LIFELONG_HELPERS (its own children
    only: a process the forkserver forks carries the forkserver's command line). Left out of both
    sides, so a worker forked from a forkserver started before the test still counts as started."""
    live = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and not lifelong_helper(child):
                live.add(child.pid)
        except psutil.NoSuchProcess:  # gone meanwhile (a zombie's reading raises its subclass)
            continue
    return live


def lifelong_helper(process: psutil.Process) -> bool:
    return process.ppid() == os.getpid() and any(helper in " ".join(process.cmdline()) for helper in LIFELONG_HELPERS)


def started_since(before: set[int]) -> set[int]:
    """This process's live descendants that are not, and do not descend from, those in `before`:
    the session's services start children of their own at any time (the work pool's `prefect-ddp
    worker` starts `prefect worker start` once its warm cluster is up)."""
    started = set()
    for pid in live_children() - before:
        try:
            ancestors = {parent.pid for parent in psutil.Process(pid).parents()}
        except psutil.NoSuchProcess:  # gone meanwhile
            continue
        if not ancestors & before:
            started.add(pid)
    return started


def test_a_flow_that_fails_before_it_needs_the_cluster_leaves_no_worker_process_behind(prefect_api):
    before = live_children()  # the session's services
    with pytest.raises(ValueError, match="listing failed"):
        with ClusterLifetime(lambda: DaskTaskRunner(cluster_class=create_local_cluster,
                                                    cluster_kwargs={"n_workers": 1})) as cluster:
            assert not cluster._start.done()
            raise ValueError("listing failed")  # while the cluster is still starting
    # The block waited for the start, then closed what it started: no worker process is left.
    assert cluster.runner._cluster is not None and cluster.runner._cluster.status.name == "closed"
    # A worker process closed by its nanny may take a moment to be reaped on a busy machine.
    deadline = time.monotonic() + 30
    while (left := started_since(before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [" ".join(psutil.Process(pid).cmdline())[:200] for pid in left if psutil.pid_exists(pid)]


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


def warm_that_fails() -> DaskTaskRunner:
    raise WarmClusterUnavailable("its holder could not replace the last run's workers (CommClosedError: closed)")


def test_a_run_the_warm_cluster_cannot_serve_starts_its_own_and_says_why(tmp_path, caplog):
    """It failed after 120 s where the holder had not replaced the last run's workers."""
    (tmp_path / IN_USE).write_text("{}")  # this run's claim
    claim = WarmClaim(ticket=None, folder=tmp_path, lock=open(tmp_path / "lock", "w"), replace_first=False)
    with caplog.at_level(logging.INFO, logger="prefect_ddp"):
        with ClusterLifetime(warm_that_fails, claim, own=threaded_runner) as cluster:
            assert cluster.ready().client.submit(sum, [1, 2]).result() == 3
            assert not cluster.is_warm
    assert "Not using the warm Dask cluster after all: its holder could not replace the last run's workers " \
           "(CommClosedError: closed). Starting a cluster for this run." in caplog.text
    assert claim.lock.closed and not (tmp_path / IN_USE).exists()  # let go: the next run may claim it


def listening_ports(host: str) -> set[int]:
    return {c.laddr.port for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.ip == host}


def test_a_runs_own_cluster_speaks_tls_and_shows_its_dashboard_on_loopback_only(prefect_api):
    """Its scheduler took plain TCP from anyone on the host, and its dashboard listened on 0.0.0.0."""
    with ClusterLifetime(DaskCluster(n_workers=1, gpu=False).task_runner) as cluster:
        runner = cluster.ready()
        address = runner.client.scheduler.address
        assert address.startswith("tls://")
        with pytest.raises(OSError):  # without the run's certificate, no connection: no one else's tasks
            Client(address.replace("tls://", "tcp://"), timeout=5)
        assert runner.client.submit(sum, [1, 2]).result() == 3
        dashboard = runner._cluster.scheduler.http_server.port
        assert dashboard in listening_ports("127.0.0.1") and dashboard not in listening_ports("0.0.0.0")
