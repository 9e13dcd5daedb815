"""Reading what a run left on the Prefect server, from tests."""

from __future__ import annotations

import time

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId


def rank_task_runs(flow_run_id, expected: int):
    """The flow run's rank task runs once `expected` of them are recorded in a final state.

    The server records task-run states from events, a moment after they happen.
    """
    deadline = time.monotonic() + 15
    while True:
        with get_client(sync_client=True) as api:
            runs = api.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        ranks = sorted((r for r in runs if r.name.startswith("rank-")), key=lambda r: r.name)
        if (len(ranks) >= expected and all(r.state.is_final() for r in ranks)) or time.monotonic() > deadline:
            return ranks
        time.sleep(0.5)
