"""Ranks whose gang is gone (its flow process killed) end: by themselves once their leases are
gone, or by the next gang that takes their workers.

The killed gang's ranks run on the session's cluster, as on an external one. Once the
scheduler has given their leases back (its lease timeout, 3 s here) they leave between
steps (`tasks/gang/fencing.py`); a rank that never reaches a step's end is ended by the next
gang that finds it there (`tasks/gang/stale.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dask
import distributed
from distributed.comm.core import CommClosedError
import pytest
from prefect.client.orchestration import get_client

from prefect_ddp.tasks.gang import GangError, GangStopped, cluster_workers, fencing, stale
from prefect_ddp.tasks.gang import lease as lease_module
from prefect_ddp.tasks.gang.lease import leased_workers
from tests.support.api_helpers import all_logs, rank_task_runs
from tests.support.gang_functions import gang_flow

REPO = Path(__file__).resolve().parent.parent
FLOW_PROCESS = """
import json, sys
from tests.support.gang_functions import gang_flow
gang_flow(**json.loads(sys.argv[1]))
"""
RANKS_START_S = 120


def workers_of(address: str) -> set[str]:
    with distributed.Client(address) as client:
        return set(client.scheduler_info(n_workers=-1)["workers"])


def killed_while_training(address: str, fn_name: str, config: dict, marks: Path) -> None:
    """A flow process whose gang runs `fn_name`, SIGKILLed once both ranks run: its ranks run on."""
    env = os.environ | {"DASK_DISTRIBUTED__SCHEDULER__LOCKS__LEASE_TIMEOUT": "3s"}
    process = subprocess.Popen([sys.executable, "-c", FLOW_PROCESS,
                                json.dumps({"address": address, "fn_name": fn_name, "config": config})],
                               cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + RANKS_START_S
        while len(list(marks.glob("running-*"))) < 2:
            assert process.poll() is None, f"the flow process exited {process.returncode}"
            assert time.monotonic() < deadline, "the killed gang's ranks never started"
            time.sleep(0.2)
    finally:
        process.kill()
        process.wait(timeout=30)


def stale_warnings(flow_run_id) -> list[str]:
    with get_client(sync_client=True) as api:
        return [log.message for log in all_logs(api, flow_run_id, "earlier gang") if "earlier gang" in log.message]


@pytest.mark.parametrize("fn_name, restarted", [
    ("loop", False),  # leaves on its own gang's flag, which the next gang sets, or on its lease's loss
    ("asleep_in_c", True),  # ignores every flag: its worker is restarted
])
def test_the_next_gang_ends_the_ranks_of_a_killed_flow_process_and_starts(dask_cluster, tmp_path, fn_name, restarted,
                                                                         monkeypatch):
    if restarted:
        # A rank asleep in C never reads its flag: the next gang (this process's flow) waits out the
        # whole grace before it restarts the worker. 3 s of it decide the same as GRACE_S's 15; the
        # rank that leaves on its flag keeps the full grace, which it must leave within.
        monkeypatch.setattr(stale, "GRACE_S", 3.0)
    address = dask_cluster.scheduler_address
    before = workers_of(address)
    killed_while_training(address, fn_name, {"marks": str(tmp_path), "seconds": 600}, tmp_path)
    state = gang_flow(address, "report", {}, lease_timeout_s=300, return_state=True)
    results = state.result()  # before the fix: "already belongs to a process group" on both ranks
    assert [r["rank_sum"] for r in results] == [1.0, 1.0]
    assert (workers_of(address) != before) == restarted  # a rank that left on its flag keeps its worker
    if not restarted:
        left = sorted(p.read_text() for p in tmp_path.glob("left-*"))
        # Each left its loop: on the flag, or on the peer that left first closing their connection.
        assert len(left) == 2 and "GangStopped" in left, left
    # The killed run's rank task runs end too: Cancelled on the flag, Crashed with their worker.
    killed_run = (tmp_path / "running-0").read_text()
    ranks = rank_task_runs(killed_run, 2)
    assert {r.state.type.value for r in ranks} == {"CRASHED" if restarted else "CANCELLED"}, ranks
    if not restarted:
        return  # its ranks may have seen their leases gone and left before the next gang looked
    [warning, *_] = stale_warnings(state.state_details.flow_run_id)
    assert re.search(r"tcp://\S+: rank [01] of flow run \S+ \(.+\), running since \d\d:\d\d:\d\d UTC", warning), warning


def test_a_stale_rank_on_a_worker_that_cannot_restart_is_never_taken_and_the_wait_names_it(monkeypatch):
    monkeypatch.setattr(stale, "GRACE_S", 1.0)
    with (distributed.LocalCluster(n_workers=1, processes=False, protocol="tcp", dashboard_address=":0") as cluster,
          distributed.Client(cluster) as client):
        (worker,) = cluster_workers(client)
        # In-process workers have no nanny: this test's own thread stands for the rank left running there.
        with stale.running(worker, 0, "flow run old-gang (1234)", None):
            with pytest.raises(GangError, match=rf"Held: {re.escape(worker)} still runs rank 0 of flow run old-gang "
                                                r"\(1234\), running since \d\d:\d\d:\d\d UTC, which did not stop, and "
                                                r"could not be restarted \(a worker without a nanny\): restart it by hand\."):
                with leased_workers(client, world_size=1, holder="the next gang", timeout_s=2):
                    pass
        with leased_workers(client, world_size=1, holder="the next gang", timeout_s=30) as leased:
            assert list(leased) == [worker]  # once the rank has ended, the worker is taken as any other
        # One that leaves after its grace, within the same wait, frees its worker for that wait.
        leaves = threading.Thread(target=stay_running, args=(worker, 3.0))
        leaves.start()
        try:
            with leased_workers(client, world_size=1, holder="the next gang", timeout_s=60) as leased:
                assert list(leased) == [worker]
        finally:
            leaves.join()


def stay_running(worker: str, seconds: float) -> None:
    with stale.running(worker, 0, "flow run slow-to-leave (5678)", None):
        time.sleep(seconds)


def start_rank_asleep_in_c(dask_worker: distributed.Worker) -> None:
    """Run on a worker: a thread marked as a rank, asleep in C, as one of a gang whose process died."""
    def rank() -> None:
        with stale.running(dask_worker.address, 0, "flow run asleep (9999)", None):
            ctypes.CDLL(None).sleep(600)

    threading.Thread(target=rank, daemon=True).start()


def test_a_worker_restarted_for_its_stale_rank_is_taken_at_once_even_past_a_short_lease_timeout(monkeypatch):
    monkeypatch.setattr(stale, "GRACE_S", 1.0)
    with (distributed.LocalCluster(n_workers=1, processes=True, protocol="tcp", dashboard_address=":0") as cluster,
          distributed.Client(cluster) as client):
        (worker,) = cluster_workers(client)
        client.run(start_rank_asleep_in_c, workers=[worker])
        with leased_workers(client, world_size=1, holder="the next gang", timeout_s=0.5) as leased:
            assert list(leased) != [worker] and len(leased) == 1  # the same worker, back at a new address
            assert client.run(stale.running_rank, workers=list(leased)) == {next(iter(leased)): None}


def test_the_ranks_of_a_killed_flow_process_leave_by_themselves_once_its_leases_are_gone(dask_cluster, tmp_path):
    """No later gang comes: the ranks see their lease given back (tasks/gang/fencing.py) and leave."""
    address = dask_cluster.scheduler_address
    before = workers_of(address)
    killed_while_training(address, "loop", {"marks": str(tmp_path)}, tmp_path)
    deadline = time.monotonic() + 180  # lease timeout 3 s, the scheduler's check, a read every 5 s: a busy machine
    while len(list(tmp_path.glob("left-*"))) < 2:
        assert time.monotonic() < deadline, "the ranks of the killed flow process trained on without their leases"
        time.sleep(0.5)
    assert "GangStopped" in [p.read_text() for p in tmp_path.glob("left-*")]
    ranks = rank_task_runs((tmp_path / "running-0").read_text(), 2)
    assert {r.state.type.value for r in ranks} == {"CANCELLED"}, ranks  # stopped, not failed: both
    assert any("no longer holds this worker" in (r.state.message or "") for r in ranks), ranks
    assert workers_of(address) == before  # they left between steps: no worker was restarted


@contextlib.contextmanager
def one_worker_leases_checked_often() -> Iterator[tuple[distributed.Client, str]]:
    """A client of an in-process cluster of one worker whose scheduler checks leases' expiry every 100 ms."""
    with (dask.config.set({"distributed.scheduler.locks.lease-validation-interval": "100ms"}),
          distributed.LocalCluster(n_workers=1, processes=False, protocol="tcp", dashboard_address=":0") as cluster,
          distributed.Client(cluster) as client):
        (worker,) = cluster_workers(client)
        yield client, worker


def fenced_on(client: distributed.Client, worker: str, lease: str) -> bool:
    """`fencing.fenced` as the rank on `worker` would ask it, now."""
    return client.submit(fencing.fenced, worker, lease, 0, workers=[worker], pure=False).result()


def test_a_lease_given_back_fences_its_ranks_off_even_when_their_worker_is_leased_again():
    with one_worker_leases_checked_often() as (client, worker):
        with leased_workers(client, world_size=1, holder="the old gang", timeout_s=30) as leases:
            old = leases[worker]
            assert not fenced_on(client, worker, old)
        assert fenced_on(client, worker, old)
        with leased_workers(client, world_size=1, holder="the new gang", timeout_s=30) as leases:
            assert fenced_on(client, worker, old)  # the worker is leased again, but not by the old lease
            assert not fenced_on(client, worker, leases[worker])
        with pytest.raises(GangStopped, match="no longer holds this worker"):
            client.submit(fencing.check_lease, 0, worker, old, workers=[worker], pure=False).result()


def test_a_rank_that_cannot_ask_its_scheduler_writes_nothing_but_trains_on(monkeypatch):
    """Issue 46: `fenced` answered "not fenced" when the scheduler could not be asked, so rank 0
    wrote its checkpoint though its lease might have been given back. Right before a write
    (`max_age_s=0`) an unanswered question is now a failure (the gang re-forms from the last
    checkpoint), not a stop; between steps the rank trains on."""
    with one_worker_leases_checked_often() as (client, worker):
        with leased_workers(client, world_size=1, holder="a cut-off gang", timeout_s=30) as leases:
            def cut_off(*args):
                raise CommClosedError("in <TCP (closed) ConnectionPool.run_function>: Stream is closed")

            monkeypatch.setattr(fencing, "lease_held", cut_off)  # the worker runs in this process
            with pytest.raises(GangError, match="could not ask the scheduler whether its gang still holds") as raised:
                client.submit(fencing.check_lease, 0, worker, leases[worker], 0, workers=[worker], pure=False).result()
            assert not isinstance(raised.value, GangStopped)  # a failure, retried; a stop would end the run
            client.submit(fencing.check_lease, 0, worker, leases[worker], workers=[worker], pure=False).result()
            assert not fenced_on(client, worker, leases[worker])


def test_a_lock_left_with_a_shorter_lease_timeout_does_not_end_the_next_gangs_lease():
    """The scheduler keeps a lock name's first lease timeout; a gang takes its locks afresh with its own."""
    with one_worker_leases_checked_often() as (client, worker):
        with dask.config.set({"distributed.scheduler.locks.lease-timeout": "1s"}), client.as_current():
            short = distributed.Lock(fencing.lock_name(worker))
            assert short.acquire(timeout=5)
            short.release()  # given back, but its name stays in the scheduler with a 1 s lease timeout
        with leased_workers(client, world_size=1, holder="the next gang", timeout_s=30) as leases:
            time.sleep(4)  # its client renews every 6 s (30 s / 5): a 1 s timeout would have ended it
            assert not fenced_on(client, worker, leases[worker])


def leases_under(name: str, dask_scheduler: distributed.Scheduler) -> list[str]:
    return list(dask_scheduler.extensions["semaphores"].leases.get(name, {}))


def test_a_lease_renewed_after_its_name_was_closed_counts_as_gone_and_is_dropped():
    """A flow process frozen past its lease timeout wakes and renews: the scheduler adds the lease back
    under a name no longer registered, where nothing would ever expire it."""
    with one_worker_leases_checked_often() as (client, worker):
        with dask.config.set({"distributed.scheduler.locks.lease-timeout": "1s"}), client.as_current():
            frozen = distributed.Lock(fencing.lock_name(worker))
            assert frozen.acquire(timeout=5)
            lease = fencing.lease_id(frozen)
            frozen.refresh_leases = False  # its client froze
            deadline = time.monotonic() + 30
            # Read in the scheduler, not by a rank: a rank that saw its lease gone remembers it.
            while client.run_on_scheduler(leases_under, fencing.lock_name(worker)):
                assert time.monotonic() < deadline, "the frozen client's lease never expired"
                time.sleep(0.2)
            lease_module._tidy(client)  # another gang ended: the name, held by nobody, is closed
            frozen.refresh_leases = True  # it wakes and renews: the scheduler holds its lease again
            deadline = time.monotonic() + 60  # renewals come every 1 s / 5; generous for a loaded machine
            while not client.run_on_scheduler(leases_under, fencing.lock_name(worker)):
                assert time.monotonic() < deadline, "the woken client's renewal never reached the scheduler"
                time.sleep(0.2)
        assert fenced_on(client, worker, lease)
        assert lease_module._tidy(client) == {}  # dropped, not reported held by "unknown"
        with leased_workers(client, world_size=1, holder="the next gang", timeout_s=30) as leases:
            assert not fenced_on(client, worker, leases[worker])
