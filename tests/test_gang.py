"""The gang on a real LocalCluster with 2 worker processes, gloo, and a real Prefect server."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextvars import copy_context
from datetime import timedelta

import pytest
from prefect import flow
from prefect_dask import DaskTaskRunner

from tasks.gang import GangError, run_gang
from tests.api_helpers import rank_task_runs
from tests.gang_functions import (
    fail_on_rank_1,
    hold_worker,
    kill_worker_on_rank_1,
    report_rank,
    sleep_past_the_deadline,
)


@flow(name="gang-test")
def gang_flow(address: str, fn_name: str, config: dict, world_size: int | None = None, max_restarts: int = 0,
              timeout_s: float | None = None, lease_timeout_s: float = 600):
    fn = {"report": report_rank, "fail": fail_on_rank_1, "kill": kill_worker_on_rank_1,
          "sleep": sleep_past_the_deadline, "hold": hold_worker}[fn_name]
    with DaskTaskRunner(address=address) as runner:
        return run_gang(fn, config, task_runner=runner, world_size=world_size, max_restarts=max_restarts,
                        init_timeout=timedelta(seconds=60),
                        timeout=timedelta(seconds=timeout_s) if timeout_s else None,
                        lease_timeout=timedelta(seconds=lease_timeout_s))


def test_one_rank_per_worker_agreeing_on_the_world(dask_cluster):
    results = gang_flow(dask_cluster.scheduler_address, "report", {"lr": 0.1})
    contexts = [r["ctx"] for r in results]
    assert [c.rank for c in contexts] == [0, 1]
    assert {c.world_size for c in contexts} == {2} and all(r["dist_world"] == 2 for r in results)
    assert len({c.worker_address for c in contexts}) == 2
    assert {c.worker_address for c in contexts} <= set(dask_cluster.scheduler_info["workers"])
    assert len({r["pid"] for r in results}) == 2
    assert len({(c.master_addr, c.master_port) for c in contexts}) == 1
    assert {c.backend for c in contexts} == {"gloo"}
    assert [c.local_rank for c in contexts] == [0, 1] and {c.local_world_size for c in contexts} == {2}
    assert all(r["rank_sum"] == 1.0 and r["config"] == {"lr": 0.1} for r in results)


def test_world_size_one_runs_without_a_process_group(dask_cluster):
    (result,) = gang_flow(dask_cluster.scheduler_address, "report", {}, world_size=1)
    assert result["ctx"].world_size == 1 and result["initialized"] is False


def test_world_larger_than_the_cluster_is_a_clear_error(dask_cluster):
    with pytest.raises(GangError, match=r"world_size=3 needs 3 Dask workers .* has 2"):
        gang_flow(dask_cluster.scheduler_address, "report", {}, world_size=3)


def test_a_failing_rank_fails_the_gang_and_every_rank_ends(dask_cluster):
    state = gang_flow(dask_cluster.scheduler_address, "fail", {}, return_state=True)
    assert state.is_failed()
    with pytest.raises(GangError, match="Rank 1 on tcp://.* ended FAILED: .*boom on rank 1, attempt 0"):
        state.result()
    runs = rank_task_runs(state.state_details.flow_run_id, 2)
    assert [r.name for r in runs] == ["rank-0", "rank-1"]
    assert all(r.state.is_final() and not r.state.is_completed() for r in runs)


def test_gang_is_re_formed_after_a_failure_on_the_same_workers(dask_cluster):
    results = gang_flow(dask_cluster.scheduler_address, "fail", {"fail_attempts": 1}, max_restarts=1)
    assert [r["ctx"].attempt for r in results] == [1, 1]
    assert all(r["rank_sum"] == 1.0 for r in results)


def test_a_killed_worker_is_noticed_and_the_gang_re_formed(dask_cluster):
    before = set(dask_cluster.scheduler_info["workers"])
    state = gang_flow(dask_cluster.scheduler_address, "kill", {}, max_restarts=1, return_state=True)
    results = state.result()
    assert [r["ctx"].attempt for r in results] == [1, 1]
    assert {r["ctx"].worker_address for r in results} != before  # the nanny's new worker
    runs = rank_task_runs(state.state_details.flow_run_id, 4)
    assert len(runs) == 4 and all(r.state.is_final() for r in runs)
    assert sum(r.state.is_completed() for r in runs) == 2


def test_ranks_past_the_deadline_are_stopped_and_their_workers_freed(dask_cluster):
    state = gang_flow(dask_cluster.scheduler_address, "sleep", {"seconds": 600}, timeout_s=2, return_state=True)
    with pytest.raises(GangError, match=r"did not finish within its timeout; ranks \[0, 1\] were still running"):
        state.result()
    runs = rank_task_runs(state.state_details.flow_run_id, 2)
    assert [r.state.type.value for r in runs] == ["CRASHED", "CRASHED"]
    # The stuck ranks' workers were restarted, so the next gang runs at once.
    results = gang_flow(dask_cluster.scheduler_address, "report", {})
    assert [r["rank_sum"] for r in results] == [1.0, 1.0]


def test_two_gangs_at_once_never_share_a_worker(dask_cluster):
    with ThreadPoolExecutor(2) as pool:
        # copy_context: each thread talks to the session's server, as this one does.
        runs = [pool.submit(copy_context().run, gang_flow, dask_cluster.scheduler_address, "hold", {"seconds": 8},
                            world_size=1) for _ in range(2)]
        (a,), (b,) = [run.result() for run in runs]
    assert a["worker"] != b["worker"]
    assert a["started"] < b["ended"] and b["started"] < a["ended"]  # side by side, not one after the other


def wait_until_leased(cluster, timeout_s: float = 60) -> None:
    """Until another gang holds every worker of `cluster`."""
    from distributed import Client, Lock

    from tasks.gang.lease import PREFIX

    with Client(cluster.scheduler_address) as client, client.as_current():
        deadline = time.monotonic() + timeout_s
        while not all(Lock(f"{PREFIX}:{a}").locked() for a in cluster.scheduler_info["workers"]):
            assert time.monotonic() < deadline, "the first gang never leased both workers"
            time.sleep(0.2)


def test_a_gang_waits_for_free_workers_then_names_who_holds_them(dask_cluster):
    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(copy_context().run, gang_flow, dask_cluster.scheduler_address, "hold", {"seconds": 12})
        wait_until_leased(dask_cluster)
        started = time.monotonic()
        with pytest.raises(GangError, match=r"needs 1 free workers, but after waiting 2s fewer of the cluster's 2 are free\. "
                                            r"Held: tcp://\S+ by flow run \S+ \(.+\); tcp://\S+ by flow run"):
            gang_flow(dask_cluster.scheduler_address, "report", {}, world_size=1, lease_timeout_s=2)
        assert time.monotonic() - started >= 2
        assert len(holder.result()) == 2  # the holder was not disturbed
    assert [r["rank_sum"] for r in gang_flow(dask_cluster.scheduler_address, "report", {})] == [1.0, 1.0]
