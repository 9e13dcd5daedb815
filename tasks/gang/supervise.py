"""The supervisor: watch a gang's ranks, stop them all at the first sign of trouble.

Facts it handles (DESIGN 4): when a rank raises, its peers fail milliseconds later on
the closed connection; when a worker dies, the nanny restarts it at a new address and its
rank's task sits in `no-worker` forever; a rank blocked in a collective cannot be
interrupted, only its worker restarted.
"""

from __future__ import annotations

import re
import time

import distributed
from prefect_dask.task_runners import PrefectDaskFuture

from tasks.gang.context import GangError, RankContext
from tasks.gang.states import crash_unfinished_task_runs
from tasks.reporting import run_logger

# Surviving gloo ranks fail within ~5 s of a peer's death (DESIGN 4); give them this long
# to record their own failure before they are cancelled.
FAILURE_GRACE_S = 15.0
# When one rank raises, its peers fail milliseconds later on the closed connection; wait
# this long for them so the report names the rank that failed first-hand.
PEER_FAILURE_WINDOW_S = 5.0
# What a rank reports when a peer, not itself, went wrong (gloo and NCCL wordings).
PEER_LOSS = re.compile(r"closed by peer|reset by peer|Broken pipe|remote process exited|Connection refused", re.I)
WORKER_RETURN_TIMEOUT_S = 60.0


def wait_for(
    client: distributed.Client, futures: list[distributed.Future], timeout_s: float,
    return_when: str = "ALL_COMPLETED",
) -> None:
    """distributed.wait on this client (not the process's default one), without raising at the timeout."""
    with client.as_current():
        try:
            distributed.wait(futures, timeout=timeout_s, return_when=return_when)
        except (TimeoutError, distributed.TimeoutError):
            pass


def supervise(
    client: distributed.Client, futures: list[PrefectDaskFuture],
    contexts: list[RankContext], deadline: float | None, poll_s: float = 1.0,
) -> None:
    """Return once every rank completed; raise GangError at the first sign of trouble."""
    pending = dict(zip((f.wrapped_future for f in futures), contexts))
    while pending:
        wait_for(client, list(pending), poll_s, return_when="FIRST_COMPLETED")
        failures = _collect_failures(pending)
        if failures:
            wait_for(client, list(pending), PEER_FAILURE_WINDOW_S)
            raise GangError(root_cause_first(failures + _collect_failures(pending)))
        if not pending:
            return
        alive = set(client.scheduler_info()["workers"])
        gone = [c for c in pending.values() if c.worker_address not in alive]
        if gone:
            raise GangError(
                f"Worker {gone[0].worker_address} of rank {gone[0].rank} left the cluster "
                "(killed, out of memory or lost) while training."
            )
        if deadline is not None and time.monotonic() > deadline:
            raise GangError(f"The gang did not finish within its timeout; ranks {sorted(c.rank for c in pending.values())} were still running.")


def _collect_failures(pending: dict[distributed.Future, RankContext]) -> list[str]:
    """Take the finished ranks out of `pending`; returns why each one that did not complete failed."""
    failures = []
    for dask_future in [f for f in pending if f.done()]:
        ctx = pending.pop(dask_future)
        if dask_future.status == "error":
            failures.append(f"Rank {ctx.rank} on {ctx.worker_address} failed in Dask: {dask_future.exception()!r}")
            continue
        state = dask_future.result()
        if not state.is_completed():
            failures.append(f"Rank {ctx.rank} on {ctx.worker_address} ended {state.type.value}: {state.message}")
    return failures


def root_cause_first(failures: list[str]) -> str:
    """One message, the ranks that failed first-hand before those that only lost a peer."""
    ordered = sorted(failures, key=lambda message: bool(PEER_LOSS.search(message)))
    others = f" (then {len(ordered) - 1} more rank(s) failed: {'; '.join(ordered[1:])})" if len(ordered) > 1 else ""
    return ordered[0] + others


def stop(client: distributed.Client, futures: list[PrefectDaskFuture], contexts: list[RankContext]) -> None:
    """Stop every rank, give each task run a final state, and restart stuck workers."""
    dask_futures = [f.wrapped_future for f in futures]
    wait_for(client, dask_futures, FAILURE_GRACE_S)
    stuck = [c.worker_address for f, c in zip(dask_futures, contexts) if not f.done()]
    client.cancel(dask_futures, force=True)
    crash_unfinished_task_runs(futures)
    alive = set(client.scheduler_info()["workers"])
    # A rank thread blocked in a collective cannot be interrupted; restarting its worker
    # is the only way to free the process (and its process group) for the next gang.
    stuck_alive = [a for a in stuck if a in alive]
    if stuck_alive:
        run_logger().warning("Restarting workers %s whose ranks did not stop.", stuck_alive)
        try:
            client.restart_workers(stuck_alive)
        except Exception:  # workers without a nanny cannot restart; they time out alone
            run_logger().exception("Could not restart workers %s", stuck_alive)


def wait_for_workers(client: distributed.Client, n: int) -> None:
    """Give restarted workers (the nanny brings one back within seconds) time to return."""
    try:
        client.wait_for_workers(n, timeout=WORKER_RETURN_TIMEOUT_S)
    except (TimeoutError, distributed.TimeoutError):
        run_logger().warning("Only %d of %d workers came back; re-forming on those.", len(client.scheduler_info()["workers"]), n)
