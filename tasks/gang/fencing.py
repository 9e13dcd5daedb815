"""Fencing: a rank whose gang no longer holds its worker stops before it acts again.

A gang's lease on a worker is a `distributed.Lock` in the scheduler (tasks/gang/lease.py),
kept alive by the flow process's client and given back by the scheduler once that client
has not renewed it for its lease timeout (30 s): the flow process was killed, frozen or cut
off. Its ranks cannot tell; they trained on and wrote checkpoints and `model.pt` into a
folder that a new run of the same job, on other workers of the cluster, was resuming from
(a gang that takes *their* worker ends them first: tasks/gang/stale.py, but nothing ended
one on a worker nobody took). So each rank carries its lease's id, the scheduler's own token
for that acquire, and asks whether the scheduler still holds it: between steps
(`ctx.check_stop()`, at most every READ_EVERY_S) and right before rank 0 writes a
checkpoint (`ctx.check_lease()`, which also wants an answer: `check_lease`). Once it is gone
the rank leaves as if stopped, and a peer that fails because it left is recorded as stopped
too. Every acquire has an id of its own, so a rank of an old attempt stays fenced off even
when its flow run leases the same worker anew.
"""

from __future__ import annotations

import math
import time

import distributed

from prefect_ddp.tasks.gang.errors import GangError, GangStopped
from prefect_ddp.tasks.reporting import run_logger

PREFIX = "prefect-ddp-worker-lease"
LOCK_PREFIX = f"{PREFIX}:"
READ_EVERY_S = 5.0
# Before a write, a scheduler that did not answer is asked this many times more, this far apart.
UNANSWERED_RETRIES = 3
UNANSWERED_WAIT_S = 1.0

# The last read in this process: (lease id, time.monotonic() of the read, whether held).
# One rank runs per worker process, so one entry is enough.
_last_read: tuple[str, float, bool] = ("", -math.inf, True)


def lock_name(address: str) -> str:
    """The name of the scheduler lock that leases the worker at `address`."""
    return LOCK_PREFIX + address


def lease_id(lock: distributed.Lock) -> str:
    """The scheduler's id of the lease `lock` holds now (distributed keeps it in `Lock._leases`)."""
    return str(lock._leases[-1])


def lease_held(client: distributed.Client, address: str, lease: str) -> bool:
    """Whether the scheduler still holds lease `lease` on the worker at `address`."""

    # Nested, so that Dask sends it by value: the scheduler of an existing cluster may not
    # have this package installed (as tasks/gang/sending.py allows for).
    def on_scheduler(name: str, lease: str, dask_scheduler: distributed.Scheduler) -> bool:
        semaphores = dask_scheduler.extensions["semaphores"]
        # Under a name still registered: a frozen client's renewal can bring a lease back under
        # a closed name, where nothing expires it (tasks/gang/lease.py, _tidy).
        return name in semaphores.max_leases and lease in semaphores.leases.get(name, {})

    held: bool = client.run_on_scheduler(on_scheduler, lock_name(address), lease)
    return held


def fenced(address: str, lease: str | None, max_age_s: float = READ_EVERY_S) -> bool:
    """Whether the scheduler no longer holds lease `lease` on the worker at `address`.

    Reads at most every `max_age_s` (0: now). False without a lease (a unit test, a context
    made by hand) or outside a Dask worker, and when asking fails (a connection error): between
    steps, a rank that cannot reach its scheduler trains on and asks again `max_age_s` later
    (with the scheduler gone for good the read waits, as every call of the worker's client
    does, until the worker itself closes). Before a write, `check_lease` wants an answer.
    """
    return lease_held_now(address, lease, max_age_s) is False


def lease_held_now(address: str, lease: str | None, max_age_s: float = READ_EVERY_S) -> bool | None:
    """Whether the scheduler holds lease `lease` (read at most every `max_age_s`): True without a
    lease or outside a Dask worker, None when asking failed."""
    global _last_read
    if lease is None:
        return True
    last_lease, read_at, was_held = _last_read
    if last_lease == lease and (not was_held or time.monotonic() - read_at < max_age_s):
        return was_held
    try:
        client = distributed.get_worker().client
    except ValueError:  # not inside a Dask worker
        return True
    try:
        held = lease_held(client, address, lease)
    except (OSError, TimeoutError) as exc:
        run_logger().debug("Could not ask the scheduler about lease %s: %r", lease, exc)
        return None
    _last_read = (lease, time.monotonic(), held)
    return held


def check_lease(rank: int, address: str, lease: str | None, max_age_s: float = READ_EVERY_S) -> None:
    """Raise GangStopped once the scheduler no longer holds this rank's lease (`fenced`); with
    `max_age_s=0` (right before a write), also when the scheduler cannot be asked.

    A write goes only where the lease is known to be held: a rank cut off from its scheduler
    cannot tell whether the lease was given back meanwhile and a new gang resumes from the
    folder it would write to. That is a GangError, a failure, not a stop: the gang re-forms
    from the last checkpoint written, as after any failed write.
    """
    held = lease_held_now(address, lease, max_age_s)
    for _ in range(UNANSWERED_RETRIES if max_age_s == 0 else 0):  # before a write: a moment's blip is asked again
        if held is not None:
            break
        time.sleep(UNANSWERED_WAIT_S)
        held = lease_held_now(address, lease, 0)
    if held is False:
        raise GangStopped(
            f"Rank {rank} on {address} left: its gang no longer holds this worker (the scheduler gave the "
            "lease back after the flow process stopped renewing it: killed, frozen or cut off), so it must "
            "not train or write on. The run's retry, or the next run, resumes from the last checkpoint."
        )
    if held is None and max_age_s == 0:
        raise GangError(
            f"Rank {rank} on {address} did not write: it could not ask the scheduler whether its gang still "
            "holds this worker, and a gang that lost it must not write into the run's folder. The gang "
            "re-forms from the last checkpoint written; if this repeats, check the network between the "
            "workers and the scheduler."
        )
