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
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import distributed

from tasks.gang.errors import GangError
from tasks.gang.plan import by_host, cluster_workers

PREFIX = "prefect-ddp-worker-lease"
POLL_S = 1.0


def _lock(address: str) -> distributed.Lock:
    return distributed.Lock(f"{PREFIX}:{address}")


def _holder(address: str, client: distributed.Client) -> distributed.Variable:
    return distributed.Variable(f"{PREFIX}-holder:{address}", client=client)


def _try_take(client: distributed.Client, workers: list[str], wanted: int, holder: str) -> list[tuple[str, distributed.Lock]] | None:
    """`wanted` of `workers`, each locked for this gang; None (and nothing held) when too few are free."""
    taken: list[tuple[str, distributed.Lock]] = []
    for address in workers:
        lock = _lock(address)
        if lock.acquire(blocking=False):
            _holder(address, client).set(holder)
            taken.append((address, lock))
            if len(taken) == wanted:
                return taken
    for _, lock in taken:  # all or none: never sit on some workers while waiting for more
        lock.release()
    return None


def _held_by(client: distributed.Client, workers: list[str]) -> str:
    holders = {}
    for address in workers:
        if _lock(address).locked():
            try:
                holders[address] = _holder(address, client).get(timeout=1)
            except (TimeoutError, distributed.TimeoutError):
                holders[address] = "unknown"
    return "; ".join(f"{address} by {who}" for address, who in holders.items()) or "none now"


@contextmanager
def leased_workers(client: distributed.Client, world_size: int | None, holder: str,
                   timeout_s: float) -> Iterator[list[str]]:
    """Take `world_size` free workers (default: all) for the block; give them back after it.

    Waits up to `timeout_s` for enough workers to be free, then raises GangError naming
    who holds the others.
    """
    deadline = time.monotonic() + timeout_s
    with client.as_current():
        while True:
            workers = by_host(cluster_workers(client))
            wanted = world_size or len(workers)
            if not workers or wanted > len(workers):
                raise GangError(
                    f"world_size={wanted} needs {wanted} Dask workers (one rank each) but the "
                    f"cluster has {len(workers)}: {workers}. Lower world_size or add workers."
                )
            taken = _try_take(client, workers, wanted, holder)
            if taken is not None:
                break
            if time.monotonic() > deadline:
                raise GangError(
                    f"world_size={wanted} needs {wanted} free workers, but after waiting "
                    f"{timeout_s:.0f}s fewer of the cluster's {len(workers)} are free. Held: "
                    f"{_held_by(client, workers)}. Wait for those runs, add workers, lower "
                    "world_size, or raise the lease timeout."
                )
            time.sleep(POLL_S)
        try:
            yield [address for address, _ in taken]
        finally:
            for _, lock in taken:
                try:
                    lock.release()
                except Exception:  # the scheduler already gave it back (lease timed out)
                    pass
