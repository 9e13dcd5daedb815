"""Ranks left running by an earlier gang, found and ended before a new gang takes their workers.

A lease says which gang may use a worker, but it does not end what runs there. When a
gang's supervisor dies (its flow process killed, its host lost) nobody sets its stop flag:
its ranks train on, and once the scheduler gives their leases back (the client's lease
timeout, 30 s) the next gang takes those workers. Its rank then shared a process with the
old one and failed ("This process already belongs to a process group"), every attempt
again, until the old training ended by itself: the "poisoned workers" that slowed whole
test sessions down (issue 33). A rank that ignores its stop (it never calls
`ctx.check_stop()`, or sleeps in C code) does the same after a stop whose worker restart
failed.

So each rank says, in its worker process, that it runs (`running`), and a gang that has
just taken its workers asks them (`end_stale_ranks`) before it plans any rank: a rank found
there belongs to a gang that no longer holds the worker, since leases are exclusive. It is
asked to stop through its own gang's flag, given GRACE_S to leave between steps,
and its worker is restarted where it does not. (A rank whose lease is gone also stops by
itself, tasks/gang/fencing.py, but only between steps: one asleep in C never does.) A worker that cannot be restarted (no nanny)
is not used, and the gang's wait names it, the gang it ran for, and since when.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone

import distributed

from prefect_ddp.tasks.gang.plan import cluster_workers
from prefect_ddp.tasks.gang.progress import remove_unresponsive
from prefect_ddp.tasks.gang.states import crash_task_runs
from prefect_ddp.tasks.gang.supervise import FAILURE_GRACE_S, WORKER_RETURN_TIMEOUT_S
from prefect_ddp.tasks.reporting import run_logger

# How long a stale rank has to leave on its flag before its worker is restarted: the same
# grace a stopping gang gives its own ranks.
GRACE_S = FAILURE_GRACE_S
POLL_S = 0.5


@dataclass(frozen=True)
class RunningRank:
    """A rank as its worker process knows it while it runs."""

    rank: int
    holder: str  # the gang's lease holder: "flow run NAME (ID)"
    stop_flag: str | None
    since: float  # time.time() when it started
    task_run_id: str | None = None  # its Prefect task run, given a final state if its worker is restarted

    def describe(self) -> str:
        started = datetime.fromtimestamp(self.since, timezone.utc).strftime("%H:%M:%S UTC")
        return f"rank {self.rank} of {self.holder}, running since {started}"


# The ranks this process runs now, by the address of their worker: one rank per worker, and
# one worker per process but where a cluster runs its workers in threads (processes=False).
_running: dict[str, RunningRank] = {}
_running_lock = threading.Lock()


@contextmanager
def running(worker_address: str, rank: int, holder: str, stop_flag: str | None,
            task_run_id: str | None = None) -> Iterator[None]:
    """Mark the worker at `worker_address` as running the rank for the block."""
    with _running_lock:
        _running[worker_address] = RunningRank(rank, holder, stop_flag, time.time(), task_run_id)
    try:
        yield
    finally:
        with _running_lock:
            _running.pop(worker_address, None)


def running_rank(dask_worker: distributed.Worker) -> dict[str, object] | None:
    """Run on a worker (`client.run`): the rank running there, as a dict, or None."""
    with _running_lock:
        rank = _running.get(dask_worker.address)
    return asdict(rank) if rank is not None else None


def stale_ranks(client: distributed.Client, addresses: list[str]) -> dict[str, RunningRank]:
    """The ranks still running on `addresses`, by worker."""
    found = client.run(running_rank, workers=addresses, on_error="ignore")  # one that left: nothing runs there
    # By the fields this release knows: a worker of another release may say more or less.
    return {address: RunningRank(**{f.name: info.get(f.name) for f in fields(RunningRank)})
            for address, info in found.items() if info is not None}


def end_stale_ranks(client: distributed.Client, addresses: list[str]) -> dict[str, str]:
    """End the ranks an earlier gang left running on `addresses` (just leased by this gang).

    Returns {address: why} for each worker this gang cannot use now: restarted (it comes back
    at a new address, to be leased again) or still running its stale rank (it has no nanny).
    Empty when nothing was running there, the usual case: one `client.run` round trip.
    """
    stale = stale_ranks(client, addresses)
    if not stale:
        return {}
    run_logger().warning(
        "Workers still run ranks of an earlier gang, whose stop never reached them (its flow process died, "
        "or they ignore the stop): %s. Asking them to stop, then restarting the workers where they do not "
        "within %.0f s.", "; ".join(f"{a}: {r.describe()}" for a, r in stale.items()), GRACE_S,
    )
    flags = {a: distributed.Event(rank.stop_flag, client=client) for a, rank in stale.items() if rank.stop_flag}
    for flag in flags.values():
        flag.set()
    deadline = time.monotonic() + GRACE_S
    while stale and time.monotonic() < deadline:
        time.sleep(POLL_S)
        stale = {a: r for a, r in stale_ranks(client, list(stale)).items() if r == stale[a]}
    unusable = _restart(client, stale) if stale else {}
    for address, flag in flags.items():
        if unusable.get(address, "restarted") == "restarted":  # its rank is gone: a set flag stays in the
            flag.clear()  # scheduler until cleared; one still running must go on seeing it
    return unusable


def _restart(client: distributed.Client, stale: dict[str, RunningRank]) -> dict[str, str]:
    """Restart the workers of ranks that did not stop; {address: why} of each now unusable."""
    addresses = list(stale)
    count = len(cluster_workers(client))
    run_logger().warning("Restarting workers %s: their stale ranks did not stop.", addresses)
    try:
        client.restart_workers(addresses, timeout=WORKER_RETURN_TIMEOUT_S)
        client.wait_for_workers(count, timeout=WORKER_RETURN_TIMEOUT_S)  # back at new addresses, to be leased
    except Exception as exc:  # no nanny, or the restart timed out: the worker stays as it is
        run_logger().warning("Could not restart workers %s (%r); they are left out of this gang.", addresses, exc)
    client.run_on_scheduler(remove_unresponsive, addresses)
    present = set(cluster_workers(client))
    still = stale_ranks(client, [a for a in addresses if a in present])
    # A rank ended with its worker reports nothing more: its task run would stay Running.
    crash_task_runs([rank.task_run_id for a, rank in stale.items() if a not in still and rank.task_run_id],
                    "Ended by a later gang that needed its worker: this rank's own gang was gone (its flow "
                    "process died) or it ignored the stop, so its worker was restarted.")
    return {a: ("restarted" if a not in still else
                f"still runs {still[a].describe()}, which did not stop, and could not be restarted (a worker "
                "without a nanny): restart it by hand")
            for a in addresses}
