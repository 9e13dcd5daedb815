"""The supervisor: watch a gang's ranks, stop them all at the first sign of trouble.

Facts it handles (docs/architecture.md, "Gang: supervision"): when a rank raises, its peers
fail once its connections close (a rank that raised after a DDP step closes them only when
its worker process ends, so its peers wait out the grace); when a worker dies, the nanny
restarts it at a new address and its rank's task sits in `no-worker` forever; a rank blocked
in a collective cannot be interrupted, only its worker restarted.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time
from collections.abc import Collection, Iterator
from concurrent.futures import CancelledError
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from uuid import UUID

import distributed
from prefect.client.schemas.objects import State
from prefect_dask.task_runners import PrefectDaskFuture

from prefect_ddp.tasks.gang.context import RankContext
from prefect_ddp.tasks.gang.errors import GangError, GangHung, GangTimeout
from prefect_ddp.tasks.gang.grow_watch import GrowWatch
from prefect_ddp.tasks.gang.plan import cluster_workers
from prefect_ddp.tasks.gang.progress import HangWatch, remove_unresponsive
from prefect_ddp.tasks.gang.states import crash_unfinished_task_runs
from prefect_ddp.tasks.gang.stopping import StopFlag
from prefect_ddp.tasks.reporting import run_logger

# Surviving gloo ranks fail within ~5 s of a peer's death (docs/architecture.md,
# "Facts: torch and gloo"), and ranks between steps see the stop flag within a second or
# so of a step; give them this long to end on
# their own before they are cancelled and their workers restarted.
FAILURE_GRACE_S = 15.0
# When one rank raises, its peers fail once its connections close; wait this long for them
# so the report names the rank that failed first-hand.
PEER_FAILURE_WINDOW_S = 5.0
# Between two reads of the worker set that must both miss a rank's worker to call it gone.
DEPARTURE_CONFIRM_S = 1.0
# What a rank reports when a peer, not itself, went wrong (gloo and NCCL wordings).
PEER_LOSS = re.compile(r"closed by peer|reset by peer|Broken pipe|remote process exited|Connection refused", re.I)
WORKER_RETURN_TIMEOUT_S = 60.0
# A finished rank's result waits on its worker until the supervisor fetches it: how long one
# fetch waits before the supervisor asks whether that worker is still there.
RESULT_FETCH_WAIT_S = 5.0
# How often the supervisor asks the scheduler how far the ranks have got.
HANG_POLL_S = 2.0


@dataclass(frozen=True)
class Deadline:
    """run_gang's `timeout`: one limit for the whole call, all attempts together."""

    limit_s: float | None
    at: float | None  # on the time.monotonic() clock

    @classmethod
    def after(cls, timeout: timedelta | None) -> Deadline:
        if timeout is None:
            return cls(None, None)
        return cls(timeout.total_seconds(), time.monotonic() + timeout.total_seconds())

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() > self.at

    def exceeded(self, what: str) -> GangTimeout:
        return GangTimeout(
            f"The gang did not finish within its timeout of {self.limit_s:g}s (one limit for the "
            f"whole run_gang call, all attempts together); {what}. Raise timeout, or give the "
            "training less to do."
        )


def wait_for(
    client: distributed.Client, futures: list[distributed.Future[Any]], timeout_s: float,
    return_when: str = "ALL_COMPLETED",
) -> None:
    """distributed.wait on this client (not the process's default one), without raising at
    the timeout or for a cancelled future (the caller tells a cancelled rank apart)."""
    with client.as_current():
        try:
            distributed.wait(futures, timeout=timeout_s, return_when=return_when)
        except (TimeoutError, distributed.TimeoutError, CancelledError):
            pass


def supervise(
    client: distributed.Client, futures: list[PrefectDaskFuture[Any]],
    contexts: list[RankContext], deadline: Deadline, hang: HangWatch | None = None, poll_s: float = 1.0,
    grow: GrowWatch | None = None,
) -> list[State]:
    """Each rank's final state, in rank order, once every rank completed; raise GangError at the
    first sign of trouble (GangHung when no rank made progress for the hang limit). `grow`: ask
    the ranks to regroup larger once a worker is free (a gang formed with a size range)."""
    pending = dict(zip((f.wrapped_future for f in futures), contexts))
    states: dict[int, State] = {}
    next_hang_check = time.monotonic() + HANG_POLL_S
    while pending:
        wait_for(client, list(pending), poll_s, return_when="FIRST_COMPLETED")
        failures = _collect_failures(client, pending, states, deadline)
        gone = _departed(client, pending)
        if failures:
            # Only peers on workers still there can fail in the window: a rank whose worker
            # left never finishes (its task waits in `no-worker`), and waiting for it only
            # delays the next attempt.
            wait_for(client, [f for f, c in pending.items() if c not in gone], PEER_FAILURE_WINDOW_S)
            failures += _collect_failures(client, pending, states, deadline)
            gone += _departed(client, {f: c for f, c in pending.items() if c not in gone})  # left during the window
        failures = [
            f"Worker {c.worker_address} of rank {c.rank} left the cluster (killed, out of memory or lost) while training"
            for c in gone
        ] + failures
        if failures:
            raise GangError(root_cause_first(failures))
        if pending and grow is not None:
            grow.check()
        if pending and hang is not None and time.monotonic() >= next_hang_check:
            next_hang_check = time.monotonic() + HANG_POLL_S
            if (hung := hang.check()) is not None:
                raise GangHung(hung)
        if pending and deadline.passed():
            running = sorted(pending.values(), key=lambda c: c.rank)
            raise deadline.exceeded(
                f"ranks {[c.rank for c in running]} were still running on {[c.worker_address for c in running]}"
            )
    return [states[c.rank] for c in contexts]


def _departed(client: distributed.Client, pending: dict[distributed.Future[Any], RankContext]) -> list[RankContext]:
    """The unfinished ranks whose worker left the cluster: they will never finish.

    A departure is confirmed by a second read of the worker set, a moment later: a worker
    that really left never comes back at its address (the nanny restarts it at a new one),
    while one the scheduler is still adding or that is reconnecting does.
    """
    gone = [c for c in pending.values() if c.worker_address not in set(cluster_workers(client))]
    if gone:
        time.sleep(DEPARTURE_CONFIRM_S)
        alive = set(cluster_workers(client))
        gone = [c for c in gone if c.worker_address not in alive]
    return gone


def _collect_failures(client: distributed.Client, pending: dict[distributed.Future[Any], RankContext],
                      states: dict[int, State], deadline: Deadline) -> list[str]:
    """Take the finished ranks out of `pending`, a completed one's state into `states` by rank;
    returns why each one that did not complete failed."""
    failures = []
    for dask_future in [f for f in pending if f.done()]:
        ctx = pending.pop(dask_future)
        where = f"Rank {ctx.rank} on {ctx.worker_address}"
        if dask_future.cancelled():  # by another client, the dashboard, or the scheduler
            failures.append(f"{where} was cancelled in Dask before it finished")
        elif dask_future.status == "error":
            failures.append(f"{where} failed in Dask: {dask_future.exception()!r}")
        elif isinstance(state := _finished_state(client, dask_future, ctx, deadline), str):
            failures.append(state)
        elif not state.is_completed():
            failures.append(f"{where} ended {state.type.value}: {state.message}")
        else:
            states[ctx.rank] = state
    return failures


def _finished_state(client: distributed.Client, future: distributed.Future[Any], ctx: RankContext,
                    deadline: Deadline) -> State | str:
    """A finished rank's final state, fetched from its worker; or, its worker gone, why the flow cannot have it.

    Dask keeps a task's result on its worker until a client fetches it. Fetched from a worker
    that has left, Dask runs the task again, and a rank's task may run on that worker alone
    (attempt._submit): the fetch waited for it forever (a worker killed as its rank returned
    hung the flow run: tests/test_gang.py). One fetch runs in a thread of its own, looked at every
    few seconds: a fetch given a timeout is cancelled at it and starts over, so a result slower
    to send than the timeout would never arrive.
    """
    fetched: concurrent.futures.Future[State] = concurrent.futures.Future()
    threading.Thread(target=_fetch, args=(future, fetched), name=f"rank-{ctx.rank}-result", daemon=True).start()
    while not concurrent.futures.wait([fetched], timeout=RESULT_FETCH_WAIT_S).done:
        if _departed(client, {future: ctx}):  # confirmed by a second read, as for a running rank
            return (f"Worker {ctx.worker_address} of rank {ctx.rank} left the cluster (killed, out of memory or "
                    "lost) after its rank finished, before the flow had its result")
        if deadline.passed():
            raise deadline.exceeded(f"rank {ctx.rank}'s result was still being fetched from {ctx.worker_address}")
    if (error := fetched.exception()) is not None:  # e.g. a result that cannot be sent: the same each attempt
        raise RuntimeError(f"Rank {ctx.rank} on {ctx.worker_address} finished, but the flow could not fetch its "
                           f"result: {error!r}") from error
    return fetched.result()


def _fetch(future: distributed.Future[Any], into: concurrent.futures.Future[State]) -> None:
    """`future`'s result into `into`. A fetch from a lost worker ends when the gang's stop cancels `future`."""
    try:
        into.set_result(future.result())
    except BaseException as exc:
        into.set_exception(exc)


def root_cause_first(failures: list[str]) -> str:
    """One message, the ranks that failed first-hand before those that only lost a peer."""
    ordered = sorted(failures, key=lambda message: bool(PEER_LOSS.search(message)))
    others = f" (then {len(ordered) - 1} more rank(s) failed: {'; '.join(ordered[1:])})" if len(ordered) > 1 else ""
    return ordered[0] + others


@contextmanager
def logged_failure(step: str) -> Iterator[None]:
    """Log, never raise, a failure of one step of stopping: the gang's own error matters more."""
    try:
        yield
    except Exception:
        run_logger().exception("Stopping the gang: %s failed", step)


def stop(
    client: distributed.Client, flag: StopFlag, futures: list[PrefectDaskFuture[Any]],
    contexts: list[RankContext], hung: bool = False, started: Collection[int] = (),
) -> set[UUID]:
    """Stop every rank, give each task run a final state, and restart stuck workers.
    `started`: the ranks that reported progress, whose task runs must be on their way to
    the server. Returns those of their task runs it has not recorded yet, to be crashed once
    it has (states.crash_when_recorded).

    Each step runs even when the one before it failed (the scheduler may be what failed),
    so the task runs get their final state whatever happened to Dask.
    """
    stuck: list[str] = []
    with logged_failure("asking the ranks to stop"):
        stuck = _ask_to_stop(client, flag, futures, contexts, hung)
    started_runs = {f.task_run_id for f, c in zip(futures, contexts) if c.rank in started}
    unrecorded = crash_unfinished_task_runs(futures, started=started_runs)
    if stuck:
        with logged_failure(f"restarting workers {stuck}"):
            _restart(client, stuck)
    return unrecorded


def _ask_to_stop(
    client: distributed.Client, flag: StopFlag, futures: list[PrefectDaskFuture[Any]], contexts: list[RankContext],
    hung: bool,
) -> list[str]:
    """Set the flag, give the ranks a grace period, cancel them all; the workers of those still running."""
    flag.set()
    dask_futures = [f.wrapped_future for f in futures]
    # Ranks of a gang whose last ranks were never submitted wait in the rendezvous, and
    # those of a hung gang wait on a frozen peer: no flag reaches them, and waiting for
    # them would only delay their restart. A rank whose worker left the cluster never
    # finishes at all: the grace is for the ranks on workers still there.
    waiting = hung or len(futures) < len(contexts)
    present = set(cluster_workers(client))
    stoppable = [f for f, c in zip(dask_futures, contexts) if c.worker_address in present]
    wait_for(client, stoppable, 0 if waiting else FAILURE_GRACE_S)
    unfinished = {f: c for f, c in zip(dask_futures, contexts) if not f.done()}
    # Only those: a finished future keeps its status, by which the task run is left to
    # record its own final state (states.settled_task_runs).
    client.cancel(list(unfinished), force=True)
    return [c.worker_address for c in unfinished.values()]


def _restart(client: distributed.Client, stuck: list[str]) -> None:
    # A rank thread blocked in a collective cannot be interrupted; restarting its worker
    # is the only way to free the process (and its process group) for the next gang.
    # Workers without a nanny cannot restart (logged); their ranks end at their own timeout.
    alive = [a for a in stuck if a in set(cluster_workers(client))]
    if alive:
        run_logger().warning("Restarting workers %s whose ranks did not stop.", alive)
        try:
            client.restart_workers(alive)
        finally:
            # A frozen worker without a nanny cannot restart: take it out of the cluster.
            if removed := client.run_on_scheduler(remove_unresponsive, alive):
                run_logger().warning("Removed workers %s from the cluster: they stopped answering (frozen).", removed)


def wait_for_workers(client: distributed.Client, n: int) -> None:
    """Give restarted workers (the nanny brings one back within seconds) time to return."""
    try:
        client.wait_for_workers(n, timeout=WORKER_RETURN_TIMEOUT_S)
    except (TimeoutError, distributed.TimeoutError):
        run_logger().warning("Only %d of %d workers came back; re-forming on those.", len(cluster_workers(client)), n)
