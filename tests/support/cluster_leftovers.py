"""What a test left on the session's Dask cluster, found and freed before the next test takes it.

Every test on the `dask_cluster` fixture shares one cluster of 2 workers (tests/conftest.py).
A test that fails half-way can leave it in use: a deployment run it started trains on in the
process worker's child and holds both workers' leases for good, a lease is taken and never
given back, a task or a rank (its Dask task cancelled, its thread still running) keeps a
worker's only thread, or a worker is left frozen. Each test after it then waited in
`leased_workers` until pytest's timeout: one failure became ten (issue 47).

So after each such test `SharedCluster.free_after` looks (a scheduler round trip and a
worker round trip: milliseconds), and where something is left it cancels the test's
deployment runs, waits for leases and tasks to be given back, and, if they are not, ends the
runs' processes and restarts the workers. It returns what it found and did, for the test
report (docs/testing.md, "The session's shared services").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

import distributed
import psutil
from distributed.core import Status
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterExpectedStartTime,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled, Cancelling

from prefect_ddp.tasks.gang import cluster_workers
from prefect_ddp.tasks.gang.fencing import LOCK_PREFIX
from prefect_ddp.tasks.gang.lease import HOLDER_PREFIX
from prefect_ddp.tasks.gang.progress import FROZEN_AFTER_S

# Waiting for what a test left to be given back by itself: a cancelled deployment run stops its
# ranks (tasks/gang/supervise.py's grace) and gives back its leases; a killed holder's leases
# come back after the scheduler's lease timeout (30 s), then its ranks leave on their fencing.
# Generous, for a loaded machine; it is only ever spent after a test that left something.
GIVE_BACK_S = 90.0
# What the test was still ending as it returned (a task whose result was just sent) is gone
# within this; the report stays quiet about it.
SETTLE_S = 3.0
POLL_S = 0.5
# A worker that does not answer a `client.run` within this is taken for frozen.
WORKER_ANSWER_S = 30.0
RESTART_S = 180.0
GONE = {Status.closing, Status.closing_gracefully, Status.closed, Status.failed}
UNFINISHED = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.CANCELLING, StateType.PAUSED]


@dataclass
class Leftovers:
    """What holds the cluster's workers now; empty (falsy) when the next test may take them."""

    leases: dict[str, str] = field(default_factory=dict)  # worker -> its lease holder
    tasks: dict[str, list[str]] = field(default_factory=dict)  # worker -> keys it runs or the scheduler gave it
    silent: list[str] = field(default_factory=list)  # workers that stopped answering (frozen)
    missing: int = 0  # workers fewer than the cluster should have
    flow_runs: dict[str, str] = field(default_factory=dict)  # deployment run id -> "name (STATE)", not final

    def __bool__(self) -> bool:
        return bool(self.leases or self.tasks or self.silent or self.missing or self.flow_runs)

    def describe(self) -> str:
        parts = [f"{address} leased by {holder}" for address, holder in self.leases.items()]
        parts += [f"{address} running {', '.join(keys)}" for address, keys in self.tasks.items()]
        parts += [f"{address} not answering (frozen?)" for address in self.silent]
        parts += [f"{self.missing} worker(s) missing"] if self.missing else []
        parts += [f"deployment run {name} unfinished" for name in self.flow_runs.values()]
        return "; ".join(parts) or "nothing"


def _scheduler_view(lock_prefix: str, holder_prefix: str, silent_s: float,
                    dask_scheduler: distributed.Scheduler) -> dict[str, Any]:
    """Run on the scheduler: its workers, the leases held on them, what it gave them to run, who is silent."""
    semaphores = dask_scheduler.extensions["semaphores"]
    variables = dask_scheduler.extensions["variables"].variables
    now = time.time()
    workers = list(dask_scheduler.workers)
    leases = {}
    for address in workers:
        if semaphores.leases.get(lock_prefix + address):
            record = variables.get(holder_prefix + address)
            leases[address] = record["value"] if record else "a gang (its holder not yet set)"
    return {
        "workers": workers,
        "leases": leases,
        "processing": {ws.address: [str(ts.key) for ts in ws.processing] for ws in dask_scheduler.workers.values()
                       if ws.processing},
        "silent": [ws.address for ws in dask_scheduler.workers.values() if now - ws.last_seen >= silent_s],
    }


def _release_leases_of_gone_workers(lock_prefix: str, holder_prefix: str,
                                    dask_scheduler: distributed.Scheduler) -> list[str]:
    """Run on the scheduler: close the worker locks (and delete the holders) of workers it no
    longer has; the addresses whose leases were still held."""
    semaphores = dask_scheduler.extensions["semaphores"]
    variables = dask_scheduler.extensions["variables"].variables
    released = []
    for name in [n for n in {*semaphores.max_leases, *semaphores.leases}
                 if isinstance(n, str) and n.startswith(lock_prefix)]:
        address = name.removeprefix(lock_prefix)
        if address in dask_scheduler.workers:
            continue
        if semaphores.leases.pop(name, None):  # before the close, which would warn of each
            released.append(address)
        semaphores.close(name=name)
        variables.pop(holder_prefix + address, None)
    return released


def unfinished_deployment_runs(since: datetime) -> dict[str, str]:
    """{id: "name (STATE)"} of the deployment runs created since `since` (the test's start) that
    have not ended: the process worker may still start them, or runs them now. Runs the
    server's scheduler created for a deployment's schedule are not the test's."""
    with get_client(sync_client=True) as api:
        runs = api.read_flow_runs(flow_run_filter=FlowRunFilter(
            expected_start_time=FlowRunFilterExpectedStartTime(after_=since),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=UNFINISHED))))
    return {str(run.id): f"{run.name!r} ({run.state.type.value if run.state else 'no state'})"
            for run in runs if run.deployment_id is not None and not run.auto_scheduled}


def cancel_flow_runs(ids: list[str], why: str) -> None:
    """Cancel each run as the UI's Cancel does: one that may have a process (Pending, Running)
    goes Cancelling, and the process worker that started it ends it; one that has none yet is
    Cancelled at once, so the worker never starts it."""
    with get_client(sync_client=True) as api:
        for flow_run_id in ids:
            run = api.read_flow_run(UUID(flow_run_id))
            if run.state is None or run.state.is_final():
                continue
            has_process = run.state.type in (StateType.PENDING, StateType.RUNNING, StateType.CANCELLING)
            api.set_flow_run_state(flow_run_id, Cancelling(message=why) if has_process else Cancelled(message=why),
                                   force=True)


def end_flow_runs(ids: list[str], why: str) -> None:
    """Set each run Cancelled, whatever its state: its process is gone."""
    with get_client(sync_client=True) as api:
        for flow_run_id in ids:
            api.set_flow_run_state(flow_run_id, Cancelled(message=why), force=True)


def flow_run_processes(ids: list[str]) -> list[psutil.Process]:
    """This process's descendants that run one of the flow runs `ids`: a worker sets
    PREFECT__FLOW_RUN_ID in the environment of each run's process."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.environ().get("PREFECT__FLOW_RUN_ID") in ids:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


class SharedCluster:
    """The session's cluster and the harness's own client to it, which finds and frees what a
    test left there. Its client is never the default one: a test's `distributed.Lock()` or
    `get_client()` must not find it."""

    def __init__(self, cluster: distributed.LocalCluster, workers: int) -> None:
        self.cluster = cluster
        self.workers = workers
        self.client = distributed.Client(cluster, set_as_default=False)

    def close(self) -> None:
        self.client.close()

    def wait_for_workers(self, timeout_s: float = 120) -> None:
        """Until all its workers are up: a test before may have killed one, whose nanny brings
        it back seconds later (more on a loaded machine)."""
        self.cluster.wait_for_workers(self.workers, timeout=timeout_s)

    def leftovers(self, since: datetime | None = None) -> Leftovers:
        """What holds the workers now; with `since`, the deployment runs created since then too.
        Without `since`: one scheduler and one worker round trip, milliseconds."""
        # Nested, so that Dask sends it by value: a worker runs it without importing this module.
        def executing(dask_worker: distributed.Worker) -> list[str]:
            """The keys the worker's threads run, a task cancelled in Dask but still running included."""
            return sorted(str(ts.key) for ts in dask_worker.state.executing | dask_worker.state.long_running)

        view = self.client.run_on_scheduler(_scheduler_view, LOCK_PREFIX, HOLDER_PREFIX, FROZEN_AFTER_S)
        heard = [address for address in view["workers"] if address not in view["silent"]]
        try:  # `callback_timeout`: Client.run hands it to Client.sync, its deadline for the answer
            running = self.client.run(executing, workers=heard, on_error="ignore",
                                        callback_timeout=WORKER_ANSWER_S) if heard else {}
        except TimeoutError:  # one froze since its last heartbeat: the scheduler says which soon
            running, view["silent"] = {}, view["silent"] + ["a worker"]
        tasks = {address: sorted(set(view["processing"].get(address, [])) | set(running.get(address, [])))
                 for address in view["workers"]}
        return Leftovers(
            leases=view["leases"], tasks={address: keys for address, keys in tasks.items() if keys},
            silent=view["silent"], missing=max(0, self.workers - len(view["workers"])),
            flow_runs=unfinished_deployment_runs(since) if since is not None else {},
        )

    def free_after(self, test: str, since: datetime, flow_runs: bool = False,
                   give_back_s: float = GIVE_BACK_S) -> str | None:
        """Free the cluster of what `test` (started at `since`) left; None when it left nothing,
        else what was left and what was done, for the report. With `flow_runs` (a test with
        deployments) its unfinished deployment runs count too: the worker may start one later.
        What is not given back within `give_back_s` (after its deployment runs are cancelled)
        is ended: their processes killed, the workers restarted."""
        left = self.leftovers(since if flow_runs else None)
        if not left:
            return None
        first = left
        left = self.wait_until_free(SETTLE_S, since if flow_runs else None)
        if not left:
            return None  # the test's last task was ending as it returned
        runs = unfinished_deployment_runs(since)  # a run of the test may hold them, or start and take them
        done = []
        if runs:
            cancel_flow_runs(list(runs), f"Cancelled by the test harness: {test} ended and left it running")
            done.append(f"cancelled its deployment runs {', '.join(runs.values())}")
        started = time.monotonic()
        left = self.wait_until_free(give_back_s, since if runs else None)
        done.append(f"waited {time.monotonic() - started:.0f} s for the cluster to be given back")
        if left:
            try:
                done += self.force_free(list(left.flow_runs))
            except Exception as exc:  # said in the report; the next test's wait for workers says more
                done.append(f"could not finish ending it: {exc!r}")
            left = self.leftovers(since if runs else None)
        outcome = f"STILL LEFT: {left.describe()}; the next tests may wait for it" if left else "the cluster is free"
        return f"{test} left the session's Dask cluster in use: {first.describe()}. Cleaned up: {'; '.join(done)}; {outcome}."

    def wait_until_free(self, timeout_s: float, since: datetime | None) -> Leftovers:
        """Poll until nothing holds the workers (and, with `since`, no deployment run of the test
        is unfinished), at most `timeout_s`; what is left then."""
        deadline = time.monotonic() + timeout_s
        while (left := self.leftovers(since)) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return left

    def force_free(self, flow_run_ids: list[str]) -> list[str]:
        """End what did not give the workers back: the processes of `flow_run_ids`, then every
        worker (restarted, each at a new address: old leases name no worker any more, and the
        scheduler's locks for the old addresses are closed). What was done, said."""
        done = []
        processes = flow_run_processes(flow_run_ids)
        for process in processes:
            process.kill()
        psutil.wait_procs(processes, timeout=30)
        if processes:
            done.append(f"killed their processes {[p.pid for p in processes]}")
        if flow_run_ids:  # ended for good, by the harness: no worker is left to say so
            end_flow_runs(flow_run_ids, "Ended by the test harness: its process did not stop when cancelled")
            done.append("marked those runs Cancelled")
        before = cluster_workers(self.client)
        self.client.restart(timeout=RESTART_S, wait_for_workers=False)
        done.append(f"restarted the workers {sorted(before)}")
        if lost := self.replace_lost_workers():
            done.append(f"started workers in place of the cluster's workers {lost}, whose nannies had closed")
        self.client.wait_for_workers(self.workers, timeout=RESTART_S)
        released = self.client.run_on_scheduler(_release_leases_of_gone_workers, LOCK_PREFIX, HOLDER_PREFIX)
        if released:
            done.append(f"released the leases still held on {sorted(released)}")
        return done

    def replace_lost_workers(self) -> list[Any]:
        """Start workers in place of those whose nanny closed for good (a worker retired, or
        closed by its scheduler): the cluster keeps their spec, so `scale()` alone sees none
        missing and starts none (nor under a name it still has a closed nanny for). The
        cluster's names of those replaced."""
        lost = [name for name, nanny in self.cluster.workers.items() if nanny.status in GONE]
        for name in lost:
            del self.cluster.worker_spec[name], self.cluster.workers[name]
        if lost:
            self.cluster.scale(self.workers)
        return lost
