"""Asking a gang's ranks to stop between steps, through a flag in the Dask scheduler.

A rank's thread cannot be interrupted from outside: cancelling its Dask future leaves it
running, and only restarting its worker ends it (docs/architecture.md, "Gang: supervision").
So before the supervisor cancels anything it sets a flag, a `distributed.Event` named for
the attempt, and each rank's `ctx.check_stop()` reads it between steps through its worker's
client and leaves the loop; the rank then destroys its process group and its worker is free
for the next gang with no restart. Reads are rate-limited so that calling it after every
optimizer step costs one scheduler round trip a second. The flag lives in the scheduler, so
it reaches ranks on an external cluster from a flow process that is being cancelled.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import distributed

from prefect_ddp.tasks.reporting import run_logger

PREFIX = "prefect-ddp-stop"
READ_EVERY_S = 1.0

# The last reads in this process: {flag name: (time.monotonic() of the read, whether set)}.
# One rank runs per worker process, reading its attempt's stop flag and grow flag
# (tasks/gang/resizing.py): a few entries at a time; older attempts' are dropped.
_last_reads: dict[str, tuple[float, bool]] = {}
_KEEP_READS = 8


def stop_requested(name: str | None, max_age_s: float = READ_EVERY_S) -> bool:
    """Whether the supervisor set flag `name`, as read in the last `max_age_s` seconds.

    False without a flag or outside a Dask worker (a unit test calling the training
    function), and when the scheduler cannot be reached just now: a rank keeps training
    through a passing network error and reads again `max_age_s` later.
    """
    if name is None:
        return False
    read_at, was_set = _last_reads.get(name, (-math.inf, False))
    if was_set or time.monotonic() - read_at < max_age_s:
        return was_set
    try:
        client = distributed.get_worker().client
    except ValueError:  # not inside a Dask worker
        return False
    if name not in _last_reads and len(_last_reads) >= _KEEP_READS:
        _last_reads.clear()
    _last_reads[name] = (time.monotonic(), _read(name, client))
    return _last_reads[name][1]


def _read(name: str, client: distributed.Client) -> bool:
    try:
        is_set: bool = distributed.Event(name, client=client).is_set()
        return is_set
    except (OSError, TimeoutError) as exc:
        run_logger().debug("Could not read the gang's flag %s: %r", name, exc)
        return False


class StopFlag:
    """The supervisor's side of one attempt's flag."""

    def __init__(self, client: distributed.Client) -> None:
        self.name = f"{PREFIX}:{uuid.uuid4().hex}"
        self._event = distributed.Event(self.name, client=client)

    def set(self) -> None:
        self._event.set()

    def remove(self) -> None:
        """Take the flag out of the scheduler (a set Event stays there until cleared)."""
        self._event.clear()


# Flags of the gangs this process supervises now. A signal reaches only the main thread,
# but a sweep runs its trials' gangs in threads of their own: stop_all_gangs reaches those.
_active: set[StopFlag] = set()
_active_lock = threading.Lock()


def stop_all_gangs() -> None:
    """Ask the ranks of every gang this process supervises to stop (a sweep being cancelled)."""
    with _active_lock:
        flags = list(_active)
    for flag in flags:
        try:
            flag.set()
        except Exception:  # the others still need their flag set
            run_logger().exception("Could not set the gang's stop flag %s", flag.name)


# Set by a sweep whose own flow run is being stopped; its trials' threads inherit it with
# the context they are started in.
_scope: ContextVar[threading.Event | None] = ContextVar("gang_stop_scope", default=None)


@contextmanager
def stop_scope() -> Iterator[threading.Event]:
    """Gangs run in this context (and in threads started with a copy of it) stop for good
    once the event is set: no attempt is formed again, and none formed anew.

    Without it a sweep's cancelled trials came back: their ranks left on the stop flag, the
    supervisor took that for a failure, and `max_restarts` re-formed each gang with a fresh
    flag nobody would set, training on while the sweep's process waited for it.
    """
    event = threading.Event()
    token = _scope.set(event)
    try:
        yield event
    finally:
        _scope.reset(token)


def scope_stopped() -> bool:
    """Whether the gangs of this context were told to stop for good."""
    event = _scope.get()
    return event is not None and event.is_set()


@contextmanager
def stop_flag(client: distributed.Client) -> Iterator[StopFlag]:
    """A fresh flag for one attempt, removed from the scheduler when the attempt ends."""
    flag = StopFlag(client)
    with _active_lock:
        _active.add(flag)
    try:
        yield flag
    finally:
        with _active_lock:
            _active.discard(flag)
        try:
            flag.remove()
        except Exception:  # never mask the error that ended the attempt
            run_logger().exception("Could not remove the gang's stop flag %s", flag.name)
