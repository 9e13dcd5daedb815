"""Give every rank's Prefect task run a final state, whatever happened to its worker.

A rank whose worker died never reports again: without this its task run stays RUNNING.
"""

from __future__ import annotations

import time
from typing import Any

from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound
from prefect.states import Crashed
from prefect_dask.task_runners import PrefectDaskFuture

from tasks.reporting import run_logger


def read_task_run(api: Any, task_run_id: Any, attempts: int = 10) -> Any:
    """The task run, or None; the server records task runs from events, a moment late."""
    for _ in range(attempts):
        try:
            return api.read_task_run(task_run_id)
        except ObjectNotFound:
            time.sleep(0.5)
    return None


def crash_unfinished_task_runs(futures: list[PrefectDaskFuture]) -> None:
    """Give every rank's task run a final state; never raise over the gang's own error."""
    with get_client(sync_client=True) as api:
        for future in futures:
            task_run = read_task_run(api, future.task_run_id)
            if task_run is None:  # cancelled before it started: no task run was created
                continue
            try:
                if task_run.state is None or not task_run.state.is_final():
                    api.set_task_run_state(
                        future.task_run_id,
                        Crashed(message="Stopped by the gang supervisor after another rank or its worker failed."),
                        force=True,
                    )
            except Exception:
                run_logger().exception("Could not mark task run %s as crashed", future.task_run_id)


