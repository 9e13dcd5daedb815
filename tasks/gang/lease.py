"""Worker leases: a gang holds its workers from choosing them to its end, alone.

Two gangs on one cluster (two trials of a sweep, two flow runs, two users) must never
share a worker: two ranks in one process cannot both join a process group, and a rank
queued behind another gang's would stall its own rendezvous. Each worker has a
`distributed.Lock` in the scheduler, named after its address; a gang takes one per rank,
all or none, so two gangs never hold half each and wait on each other. Locks live in the
scheduler, so they hold across flow runs and processes; the scheduler gives a lock back
when the client holding it is gone (`distributed.scheduler.locks.lease-timeout`, 30 s).
A `distributed.Variable` beside each lock says who holds it, for the message of a gang
that waited in vain.

Nothing of a lease outlives its gang in the scheduler. A nanny brings a restarted worker
back at a new address, so on a long-lived cluster a lock and a holder per address ever
seen would pile up there. When a gang ends (its block is over, or it waited in vain) it
tidies up: every worker lock that no gang holds or is acquiring is closed and every
holder of a lock no gang holds is deleted. A lock whose client died is given back by the
lease timeout, as before, and tidied by the next gang that ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone

import dask
import distributed
from dask.utils import parse_timedelta

from prefect_ddp.tasks.gang.errors import GangError
from prefect_ddp.tasks.gang.fencing import LOCK_PREFIX, PREFIX, lease_id, lock_name
from prefect_ddp.tasks.gang.plan import by_host, cluster_workers
from prefect_ddp.tasks.gang.stale import end_stale_ranks, stale_ranks
from prefect_ddp.tasks.reporting import run_logger

HOLDER_PREFIX = f"{PREFIX}-holder:"
POLL_S = 1.0
# Tries to take a free worker's lock that other gangs' tidying keeps closing under us.
TAKE_TRIES = 3


def _holder(address: str, client: distributed.Client) -> distributed.Variable:
    return distributed.Variable(HOLDER_PREFIX + address, client=client)


def _take(address: str) -> distributed.Lock | None:
    """The worker's lock, taken now; None when another gang holds it.

    A Lock registers its name in the scheduler, then acquires it: another gang's tidying may
    close a lock nobody holds in between, and the scheduler then answers "Semaphore or Lock
    `NAME` not known.". A fresh Lock registers it again; after TAKE_TRIES such answers the
    worker counts as not free now, and the gang asks again at its next poll.
    """
    for _ in range(TAKE_TRIES):
        lock = distributed.Lock(lock_name(address))
        try:
            return lock if lock.acquire(blocking=False) else None
        except RuntimeError as exc:
            if "not known" not in str(exc):
                raise
    return None


def _try_take(client: distributed.Client, workers: list[str], wanted: int,
              at_least: int | None = None) -> list[tuple[str, distributed.Lock]] | None:
    """Up to `wanted` of `workers` (and no fewer than `at_least`, default: `wanted`), each locked
    for this gang; None (and nothing held) when too few are free."""
    taken: list[tuple[str, distributed.Lock]] = []
    for address in workers:
        lock = _take(address)
        if lock is not None:
            taken.append((address, lock))
            if len(taken) == wanted:
                break
    if len(taken) >= min(wanted, at_least or wanted) and _own_lease_timeout(client, taken):
        return taken
    for _, lock in taken:  # all or none: never sit on some workers while waiting for more
        lock.release()
    return None


def _own_lease_timeout(client: distributed.Client, taken: list[tuple[str, distributed.Lock]]) -> bool:
    """Give the locks just taken this client's lease timeout; False when one of them is lost already.

    The scheduler keeps a lock name's timeout from the client that registered it first
    ("Facts: Dask"), and a name no gang holds may be registered by a client configured with
    a shorter one just before this gang takes it: the lease would then expire under a live
    gang, whose client renews at its own pace, and fence its ranks (tasks/gang/fencing.py).
    Lengthening the timeout of a lease this gang holds alone takes nothing from anyone.
    """
    setting = dask.config.get("distributed.scheduler.locks.lease-timeout")
    ours = None if setting == "inf" else parse_timedelta(setting, default="s")

    # Nested, so that Dask sends it by value (see _tidy).
    def on_scheduler(leases: dict[str, str], ours: float | None, dask_scheduler: distributed.Scheduler) -> bool:
        semaphores = dask_scheduler.extensions["semaphores"]
        for name, lease in leases.items():
            if lease not in semaphores.leases.get(name, {}):
                return False
            kept = semaphores.lease_timeouts.get(name)
            if ours is None or (kept is not None and kept < ours):
                semaphores.lease_timeouts[name] = ours
        return True

    held: bool = client.run_on_scheduler(on_scheduler, {lock_name(a): lease_id(lock) for a, lock in taken}, ours)
    return held


def _tidy(client: distributed.Client) -> dict[str, str]:
    """Close the worker locks no gang holds, delete their holders; {address: holder} of the others.

    It runs as one plain function on the scheduler, so within one turn of its event loop: no
    acquire comes between a lock's check and its close. A lock with a lease is never closed
    (a second gang would register it afresh and take the worker its holder trains on), nor
    one with an acquire under way (that acquire, ending, writes its counters for the name
    back into the scheduler's tables). It only reads the tables otherwise, so asking who
    holds workers creates nothing, where `Lock.locked()` adds an entry for the name.
    """

    # Nested, so that Dask sends it by value: the scheduler of an existing cluster may not
    # have this package installed (as tasks/gang/sending.py allows for).
    def on_scheduler(lock_prefix: str, holder_prefix: str, dask_scheduler: distributed.Scheduler) -> dict[str, str]:
        semaphores = dask_scheduler.extensions["semaphores"]
        variables = dask_scheduler.extensions["variables"].variables
        held: dict[str, str] = {}
        # `leases` too: `Lock.locked()` (an older prefect-ddp's, a test's) leaves an entry there.
        for name in {*semaphores.max_leases, *semaphores.leases}:
            if not (isinstance(name, str) and name.startswith(lock_prefix)):
                continue
            address = name.removeprefix(lock_prefix)
            if name not in semaphores.max_leases:
                # Leases under a closed name: a client that froze past its lease timeout renewed
                # it on waking (the scheduler adds back ids it does not know), and nothing
                # would ever expire it. Its ranks are fenced off (tasks/gang/fencing.py).
                semaphores.leases.pop(name, None)
            elif semaphores.leases.get(name):
                record = variables.get(holder_prefix + address)
                held[address] = record["value"] if record else "unknown"  # taken, holder not yet set
            elif not semaphores.metrics["pending"].get(name):
                semaphores.close(name=name)
                semaphores.leases.pop(name, None)
        for name in [name for name in variables if isinstance(name, str) and name.startswith(holder_prefix)]:
            if name.removeprefix(holder_prefix) not in held:
                del variables[name]
        return held

    holders: dict[str, str] = client.run_on_scheduler(on_scheduler, LOCK_PREFIX, HOLDER_PREFIX)
    return holders


def _held_by(client: distributed.Client, workers: list[str], stuck: dict[str, str]) -> str:
    """Who holds each of `workers` that is not free, and since when; `stuck`: {address: why} of
    those no gang holds that still run a stale rank (`end_stale_ranks`)."""
    try:
        holders = _tidy(client)
    except Exception as exc:  # the message of the gang's own error must still come through
        return f"unknown (the scheduler did not say: {exc!r})"
    held = {address: f"by {holders[address]}" for address in workers if address in holders}
    held |= {address: why for address, why in stuck.items() if address in workers and address not in held}
    return "; ".join(f"{address} {why}" for address, why in held.items()) or "none now"


def _wait_for_free(client: distributed.Client, world_size: int | None, timeout_s: float,
                   min_world_size: int | None = None) -> list[tuple[str, distributed.Lock]]:
    """`world_size` workers (default: all), taken together once that many are free, and none
    of them still running a rank of an earlier gang (`end_stale_ranks`); with
    `min_world_size`, as many up to `world_size` as are free once at least that many are.

    Ending stale ranks is not counted against `timeout_s` (it is bounded on its own: a grace,
    then a restart): a gang that has just restarted workers takes them again before its
    deadline is checked, so it never fails on the workers it has just freed."""
    deadline = time.monotonic() + timeout_s
    waited = False
    stuck: dict[str, str] = {}  # workers whose stale rank could not be ended: not taken while it runs
    while True:
        if stuck:  # a stale rank that left late (after its grace, on a worker with no nanny) frees it
            stuck = {address: why for address, why in stuck.items() if address in stale_ranks(client, list(stuck))}
        workers = by_host(cluster_workers(client))
        wanted = world_size or len(workers)
        least = min_world_size or wanted  # never above world_size (run.check_size_range)
        asked = f"world_size={wanted}" if least == wanted else f"min_world_size={least}"
        if not workers or least > len(workers):
            raise GangError(
                f"{asked} needs {least} Dask workers (one rank each) but the "
                f"cluster has {len(workers)}: {workers}. Lower world_size or add workers."
            )
        taken = _try_take(client, [address for address in workers if address not in stuck], wanted, least)
        if taken is not None:
            unusable = end_stale_ranks(client, [address for address, _ in taken])
            if not unusable:
                return taken
            _give_back(client, taken)  # and take afresh: restarted workers are back at new addresses
            stuck |= {address: why for address, why in unusable.items() if why != "restarted"}
            if "restarted" in unusable.values():
                continue  # take again now, whatever the deadline: the restarted workers are free
        if not waited:
            run_logger().info("Waiting up to %.0f s for %d free worker(s) of the cluster's %d. Held: %s.",
                              timeout_s, least, len(workers), _held_by(client, workers, stuck))
            waited = True
        if time.monotonic() > deadline:
            raise GangError(
                f"{asked} needs {least} free workers, but after waiting "
                f"{timeout_s:.0f}s fewer of the cluster's {len(workers)} are free. Held: "
                f"{_held_by(client, workers, stuck)}. Wait for those runs, add workers, lower "
                "world_size, or raise the lease timeout."
            )
        time.sleep(POLL_S)


def _give_back(client: distributed.Client, taken: list[tuple[str, distributed.Lock]]) -> None:
    """Release `taken` and tidy the scheduler, without raising: the gang's own error, if
    any, is the one its caller must see."""
    try:
        for _, lock in taken:
            lock.release()  # a lease the scheduler already timed out only logs a warning there
        _tidy(client)
    except Exception:
        run_logger().exception(
            "Could not give back the workers %s or tidy their leases in the Dask scheduler; it "
            "gives them back after its lease timeout, and the next gang to end tidies.",
            [address for address, _ in taken],
        )


@contextmanager
def leased_workers(client: distributed.Client, world_size: int | None, holder: str,
                   timeout_s: float, min_world_size: int | None = None) -> Iterator[dict[str, str]]:
    """Take `world_size` free workers (default: all) for the block; give them back after it.
    With `min_world_size`, take as many up to `world_size` as are free once at least that many are.

    Yields {address: lease id}: each rank carries its worker's lease id, to stop once the
    scheduler no longer holds it (tasks/gang/fencing.py). Waits up to `timeout_s` for
    enough workers to be free, then raises GangError naming who holds the others. Either
    way the scheduler keeps nothing of this gang's leases once the block is over.

    Example:
        with leased_workers(client, world_size=2, holder="flow run 1234", timeout_s=600) as leases:
            ...  # one rank on each worker of `leases`
    """
    taken: list[tuple[str, distributed.Lock]] = []
    with client.as_current():
        try:
            taken = _wait_for_free(client, world_size, timeout_s, min_world_size)
            since = datetime.now(timezone.utc).strftime("%H:%M:%S UTC")
            for address, _ in taken:  # once all are taken: a take given back sets no holder
                _holder(address, client).set(f"{holder} (since {since})")
            yield {address: lease_id(lock) for address, lock in taken}
        finally:
            _give_back(client, taken)
