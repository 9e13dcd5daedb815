"""The supervisor's side of growing a gang back: set the attempt's grow flag once a worker is free for it.

See tasks/gang/resizing.py for the ranks' side and the whole exchange.
"""

from __future__ import annotations

import time

import distributed

from prefect_ddp.tasks.gang.fencing import LOCK_PREFIX
from prefect_ddp.tasks.gang.resizing import grow_flag_name
from prefect_ddp.tasks.reporting import run_logger

# How often the supervisor of a gang below its top size asks which workers are free.
GROW_POLL_S = 5.0


def free_workers(client: distributed.Client) -> list[str]:
    """The cluster's workers that no gang holds now: read from the scheduler's tables, changing
    nothing (unlike lease.py's `_tidy`), so a supervisor may ask every few seconds whether its
    gang could grow."""

    # Nested, so that Dask sends it by value (as lease.py's `_tidy`).
    def on_scheduler(lock_prefix: str, dask_scheduler: distributed.Scheduler) -> list[str]:
        semaphores = dask_scheduler.extensions["semaphores"]
        held = {name.removeprefix(lock_prefix) for name, leases in semaphores.leases.items()
                if isinstance(name, str) and name.startswith(lock_prefix) and leases and name in semaphores.max_leases}
        return [address for address in dask_scheduler.workers if address not in held]

    free: list[str] = client.run_on_scheduler(on_scheduler, LOCK_PREFIX)
    return free


class GrowWatch:
    """The supervisor's side: set the attempt's grow flag once a worker is free for it."""

    def __init__(self, client: distributed.Client, stop_flag: str, size: int, top: int | None,
                 not_growing: set[str] | None = None) -> None:
        self.client = client
        self.size, self.top = size, top
        # Free by the lock tables, yet not taken by the last regroup (a stale rank there, say): not asked for again.
        self.not_growing = not_growing or set()
        self._event = distributed.Event(grow_flag_name(stop_flag), client=client)
        self._next_check = time.monotonic() + GROW_POLL_S
        self.requested: list[str] | None = None  # the free workers seen when the flag was set

    def check(self) -> None:
        """At most every GROW_POLL_S: set the flag where workers are free and the gang is below its top."""
        if self.requested is not None or (self.top is not None and self.size >= self.top):
            return
        if time.monotonic() < self._next_check:
            return
        self._next_check = time.monotonic() + GROW_POLL_S
        try:
            free = [address for address in free_workers(self.client) if address not in self.not_growing]
        except Exception as exc:  # the gang trains on at its size; the next check asks again
            run_logger().debug("Could not ask the scheduler for free workers: %r", exc)
            return
        if free:
            self.requested = free
            run_logger().info("Worker(s) %s are free: asking the gang of %d to regroup larger at its next boundary.",
                              free, self.size)
            self._event.set()

    def close(self) -> None:
        """Take the flag out of the scheduler (a set Event stays there until cleared)."""
        self._event.clear()
