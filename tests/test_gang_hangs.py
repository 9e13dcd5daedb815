"""A frozen rank is found by its lack of progress, in the hang limit, not the collective's timeout.

Real processes: the session's LocalCluster of nanny workers, a 2-rank gloo gang, and a worker
process frozen with SIGSTOP (alive and silent, as a hung host or a swap storm leaves it).
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from tests.support.api_helpers import assert_no_task_run_left_running, rank_task_runs
from tests.support.gang_functions import gang_flow

HANG_S = 10


def test_a_frozen_worker_is_found_within_the_hang_limit_and_the_gang_re_formed_without_it(dask_cluster, tmp_path):
    before = set(dask_cluster.scheduler_info["workers"])
    started = time.monotonic()
    state = gang_flow(dask_cluster.scheduler_address, "freeze", {"steps": 60, "freeze_at": 10, "marks": str(tmp_path)},
                      max_restarts=1, hang_timeout_s=HANG_S, return_state=True)
    results = state.result()
    first, second = results.attempts
    frozen = json.loads((tmp_path / "frozen").read_text())
    # Named: the rank, its worker, how long it was silent, its last progress, and why.
    found = re.search(r"Rank 1 on (\S+) made no progress for (\d+) s after step (\d+) of epoch 1 \(phase: step\): "
                      r"its worker has not answered the scheduler for \d+ s \(frozen\)", first.ended)
    assert found, first.ended
    assert found[1] == first.workers[1] and 1 <= int(found[3]) <= 10  # its last report (at most one a second)
    assert HANG_S <= int(found[2]) <= HANG_S + 6  # the hang limit and a poll, not gloo's 300 s
    assert second.ended == "completed" and [r["ctx"].attempt for r in results] == [1, 1]
    assert first.workers[1] not in second.workers  # re-formed without the frozen process
    with pytest.raises(ProcessLookupError):
        os.kill(frozen["pid"], 0)  # gone, not waiting to come back into a later attempt
    assert first.workers[1] not in set(dask_cluster.scheduler_info["workers"]) and before
    runs = rank_task_runs(state.state_details.flow_run_id, 4)
    assert len(runs) == 4 and sum(r.state.is_completed() for r in runs) == 2
    assert_no_task_run_left_running(state.state_details.flow_run_id)
    assert time.monotonic() - started < 90


def test_a_slow_first_step_and_a_slow_checkpoint_are_not_taken_for_a_hang(dask_cluster):
    # Each silence is longer than the hang limit, but in a phase allowed to be slow, with live workers.
    state = gang_flow(dask_cluster.scheduler_address, "slow", {"slow_s": 5}, hang_timeout_s=2, return_state=True)
    results = state.result()
    assert [r["rank_sum"] for r in results] == [1.0, 1.0]
    assert [a.ended for a in results.attempts] == ["completed"]


def test_a_function_that_reports_no_progress_is_left_alone_while_its_worker_answers(dask_cluster):
    state = gang_flow(dask_cluster.scheduler_address, "sleep", {"seconds": 5}, hang_timeout_s=2, return_state=True)
    assert [a.ended for a in state.result().attempts] == ["completed"]
