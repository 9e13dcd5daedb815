"""Give every rank's Prefect task run a final state, whatever happened to its worker.

A rank whose worker died, or was restarted because its rank would not stop, never
reports again: without this its task run stays RUNNING.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import TaskRun
from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterId
from prefect.states import Crashed
from prefect_dask.task_runners import PrefectDaskFuture

from prefect_ddp.tasks.reporting import run_logger

# The server records a task run from the events its worker sends, a moment after they
# happen: a rank stopped right after it started may not be recorded yet, and the final
# state of one that just ended may not have arrived.
RECORDING_WAIT_S = 5.0
# A rank that reported progress has started, and its worker sends its task run's events at once; the server may
# still record them much later: its recorder retries a write its database refused at its next
# flush, and a SQLite-backed server at times answers no write for 60 s under load
# (docs/architecture.md, "Facts: Prefect"). Not crashed for want of a record, such a task run
# stayed RUNNING after its worker was gone (seen in CI). So these are crashed once recorded, up to
# this long after their gang stopped; meanwhile the gang goes on (`crash_when_recorded`). A rank
# killed right after its first report may never have sent them: a run_gang that ends sooner than
# this after such a stop waits out the rest, and says so.
STARTED_RECORDING_WAIT_S = 120.0
CRASH_MESSAGE = ("Stopped by the gang supervisor: another rank or its worker failed, the deadline passed, "
                 "or the flow run was cancelled.")


def settled_task_runs(api: SyncPrefectClient, futures: list[PrefectDaskFuture[Any]],
                      wait_s: float = RECORDING_WAIT_S) -> list[TaskRun]:
    """The ranks' task runs once the server has recorded each, and the final state of each
    rank that ended by itself; or as they are after `wait_s`.

    Waiting for a finished rank's own final state keeps its story (Cancelled by the stop
    flag, Failed) instead of overwriting it with Crashed. A rank cancelled before it
    started never gets a task run, so fewer may come back.
    """
    ids = [f.task_run_id for f in futures]
    ended_by_themselves = {f.task_run_id for f in futures if f.wrapped_future.status == "finished"}
    deadline = time.monotonic() + wait_s
    while True:
        runs = api.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=ids)), limit=len(ids))
        settled = len(runs) >= len(ids) and all(r.state and r.state.is_final() for r in runs if r.id in ended_by_themselves)
        if settled or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


def crash_unfinished_task_runs(futures: list[PrefectDaskFuture[Any]], message: str = CRASH_MESSAGE,
                               started: Collection[UUID] = ()) -> set[UUID]:
    """Give every future's task run a final state (Crashed with `message` where it has none);
    never raise over the error that the caller is reporting. Decode-check uses it too, for
    chunks whose workers all died.

    Returns those of `started` (the task run ids of ranks that reported progress) that the
    server has not recorded yet: the caller crashes them once it has (`crash_when_recorded`).
    """
    if not futures:
        return set()
    try:
        with get_client(sync_client=True) as api:
            runs = settled_task_runs(api, futures)
            crash_unfinished(api, runs, message)
    except Exception:
        run_logger().exception("Could not read the task runs to give them a final state")
        return set()
    return set(started) - {r.id for r in runs}


def crash_when_recorded(late: dict[UUID, float], message: str = CRASH_MESSAGE, wait: bool = True) -> None:
    """Crash each of `late` (task run id: the monotonic time until which to wait for it) once the
    server has recorded it without a final state, waiting until its time (one look without `wait`);
    warn of those never recorded. Never raises: the gang's own outcome matters more."""
    if not late:
        return
    pending = dict(late)
    try:
        with get_client(sync_client=True) as api:
            while pending:
                filter_ = TaskRunFilter(id=TaskRunFilterId(any_=list(pending)))
                recorded = api.read_task_runs(task_run_filter=filter_, limit=len(pending))
                crash_unfinished(api, recorded, message)
                for task_run in recorded:
                    pending.pop(task_run.id, None)
                if not pending or not wait or time.monotonic() > max(pending.values()):
                    break
                time.sleep(0.5)
    except Exception:
        run_logger().exception("Could not give the task runs %s a final state", sorted(map(str, pending)))
        return
    if pending:
        run_logger().warning(
            "The Prefect server had not recorded the task runs %s of ranks that had started when their gang stopped, "
            "nor by the gang's end (waiting up to %.0f s after the stop): they cannot be marked Crashed, and may "
            "show Running though their ranks are gone.", sorted(map(str, pending)), STARTED_RECORDING_WAIT_S)


def crash_task_runs(task_run_ids: list[str], message: str) -> None:
    """Crash each of these task runs that has no final state; never raise (the caller goes on).

    For ranks whose own gang is gone, ended by a later gang (prefect_ddp.tasks.gang.stale):
    no future of theirs is left to settle."""
    if not task_run_ids:
        return
    try:
        with get_client(sync_client=True) as api:
            runs = api.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=task_run_ids)))
            crash_unfinished(api, runs, message)
    except Exception:
        run_logger().exception("Could not give the task runs %s a final state", task_run_ids)


def crash_unfinished(api: SyncPrefectClient, runs: list[TaskRun], message: str) -> None:
    """Crash each of `runs` that has no final state (`message` says why)."""
    for task_run in runs:
        if task_run.state is None or not task_run.state.is_final():
            _crash(api, task_run.id, message)


def _crash(api: Any, task_run_id: Any, message: str) -> None:
    try:
        api.set_task_run_state(task_run_id, Crashed(message=message), force=True)
    except Exception:
        run_logger().exception("Could not mark task run %s as crashed", task_run_id)
