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
# A rank that reported progress has started, so its task run's events are on their way; the
# server may still record them much later: its recorder retries a write its database refused at
# its next flush, and a SQLite-backed server at times answers no write for 60 s under load
# (docs/architecture.md, "Facts: Prefect"). Not crashed for want of a record, such a task run
# stayed RUNNING after its worker was gone (seen in CI).
STARTED_RECORDING_WAIT_S = 120.0
CRASH_MESSAGE = ("Stopped by the gang supervisor: another rank or its worker failed, the deadline passed, "
                 "or the flow run was cancelled.")


def settled_task_runs(api: SyncPrefectClient, ids: list[UUID], ended_by_themselves: Collection[UUID],
                      started: Collection[UUID] = (), wait_s: float = RECORDING_WAIT_S,
                      started_wait_s: float = STARTED_RECORDING_WAIT_S) -> list[TaskRun]:
    """The task runs of `ids` once the server has recorded each, and the final state of each
    that ended by itself; or as they are after `wait_s`, or after `started_wait_s` while one
    of `started` (known to have run) is not recorded yet.

    Waiting for a finished rank's own final state keeps its story (Cancelled by the stop
    flag, Failed) instead of overwriting it with Crashed. A rank cancelled before it
    started never gets a task run, so fewer may come back.
    """
    began = time.monotonic()
    while True:
        runs = api.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=ids)), limit=len(ids))
        unrecorded = set(ids) - {r.id for r in runs}
        waited = time.monotonic() - began
        if not unrecorded and all(r.state and r.state.is_final() for r in runs if r.id in ended_by_themselves):
            return runs
        if waited > wait_s and not unrecorded & set(started):
            return runs
        if waited > started_wait_s:
            run_logger().warning(
                "The Prefect server has not recorded task runs %s within %.0f s, though their ranks started: "
                "they cannot be marked Crashed, and may show Running though their ranks are gone.",
                sorted(str(i) for i in unrecorded & set(started)), started_wait_s)
            return runs
        time.sleep(0.5)


def crash_unfinished_task_runs(futures: list[PrefectDaskFuture[Any]], message: str = CRASH_MESSAGE,
                               started: Collection[UUID] = ()) -> None:
    """Give every future's task run a final state (Crashed with `message` where it has none);
    never raise over the error that the caller is reporting. `started`: the task run ids of
    futures known to have run (their ranks reported progress), whose recording is waited for
    longer. Decode-check uses it too, for chunks whose workers all died."""
    if not futures:
        return
    ended_by_themselves = {f.task_run_id for f in futures if f.wrapped_future.status == "finished"}
    try:
        with get_client(sync_client=True) as api:
            for task_run in settled_task_runs(api, [f.task_run_id for f in futures], ended_by_themselves, started):
                if task_run.state is None or not task_run.state.is_final():
                    _crash(api, task_run.id, message)
    except Exception:
        run_logger().exception("Could not read the task runs to give them a final state")


def crash_task_runs(task_run_ids: list[str], message: str) -> None:
    """Crash each of these task runs that has no final state; never raise (the caller goes on).

    For ranks whose own gang is gone, ended by a later gang (prefect_ddp.tasks.gang.stale):
    no future of theirs is left to settle."""
    if not task_run_ids:
        return
    try:
        with get_client(sync_client=True) as api:
            runs = api.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=task_run_ids)))
            for task_run in runs:
                if task_run.state is None or not task_run.state.is_final():
                    _crash(api, task_run.id, message)
    except Exception:
        run_logger().exception("Could not give the task runs %s a final state", task_run_ids)


def _crash(api: Any, task_run_id: Any, message: str) -> None:
    try:
        api.set_task_run_state(task_run_id, Crashed(message=message), force=True)
    except Exception:
        run_logger().exception("Could not mark task run %s as crashed", task_run_id)
