"""Reading what a run left on the Prefect server, from tests."""

from __future__ import annotations

import time

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker


def rank_task_runs(flow_run_id, expected: int):
    """The flow run's rank task runs once `expected` of them are recorded in a final state.

    The server records task-run states from events, a moment after they happen (and, on a
    loaded machine, many seconds after; a run read that early may have no state yet).
    """
    deadline = time.monotonic() + 60
    while True:
        with get_client(sync_client=True) as api:
            runs = api.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        ranks = sorted((r for r in runs if r.name.startswith("rank-")), key=lambda r: r.name)
        if (len(ranks) >= expected and all(r.state is not None and r.state.is_final() for r in ranks)) or time.monotonic() > deadline:
            return ranks
        time.sleep(0.5)


def assert_no_task_run_left_running(flow_run_id, settle_s: float = 15) -> list:
    """Every task run of the flow run (ranks, decode checks, ...) ends in a final state.

    Waits up to `settle_s` for the server to record the last states (they arrive as events).
    Returns the task runs, for further checks.
    """
    deadline = time.monotonic() + settle_s
    while True:
        with get_client(sync_client=True) as api:
            runs = api.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        unfinished = [f"{r.name}: {r.state.type.value if r.state else None}" for r in runs
                      if r.state is None or not r.state.is_final()]
        if not unfinished:
            return runs
        if time.monotonic() > deadline:
            raise AssertionError(f"task runs left unfinished after the flow ended: {unfinished}")
        time.sleep(0.5)


def all_logs(api, flow_run_id, last_words: str) -> list:
    """The run's log lines, once the ranks' (shipped from the workers, a moment late) are in."""
    deadline = time.monotonic() + 30
    while True:
        logs = api.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        if any(last_words in log.message for log in logs) or time.monotonic() > deadline:
            return logs
        time.sleep(0.5)


def send_held_logs_and_events(timeout_s: float = 5) -> None:
    """Send the logs and events this process still holds to the Prefect API, before it goes.

    Prefect sends them from queues in the background. Left to the interpreter's exit, they are
    retried against a server already stopped: an xdist worker then outlived its session until
    xdist killed it, 10 s later. Prefect's own test harness drains them the same way.
    """
    APILogWorker.drain_all(timeout=timeout_s)
    EventsWorker.drain_all(timeout=timeout_s)
