"""Training functions written where users write them: scripts, notebooks, closures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prefect import flow

from prefect_ddp.tasks.gang import GangError, run_gang
from prefect_ddp.tasks.gang.sending import check_sendable

REPO = Path(__file__).resolve().parent.parent


def test_a_function_in_a_script_that_reads_dataset_classes_trains(dask_cluster, prefect_api):
    script = subprocess.run(
        [sys.executable, str(REPO / "tests" / "support" / "main_script_train.py"), dask_cluster.scheduler_address],
        cwd=REPO, env=dict(os.environ, PREFECT_API_URL=prefect_api), capture_output=True, text=True, timeout=180,
    )
    assert script.returncode == 0, script.stderr[-3000:]
    results = json.loads(script.stdout.strip().splitlines()[-1])
    assert results == [{"rank": 0, "outputs": 3}, {"rank": 1, "outputs": 3}]


def test_a_function_that_cannot_be_sent_fails_before_any_rank_starts(dask_cluster, prefect_api):
    lock = threading.Lock()

    def train_holding_a_lock(ctx, config):
        with lock:
            return ctx.rank

    @flow(name="unsendable")
    def unsendable():
        from prefect_dask import DaskTaskRunner

        with DaskTaskRunner(address=dask_cluster.scheduler_address) as runner:
            return run_gang(train_holding_a_lock, {}, task_runner=runner)

    with pytest.raises(GangError, match=r"The training function '.*train_holding_a_lock' cannot be sent to the "
                                        r"Dask workers: TypeError\(\"cannot pickle '_thread.lock' object\"\)\. Move it"):
        unsendable()


@pytest.mark.unit
def test_torch_module_like_objects_are_sent_by_name():
    import cloudpickle
    import torch

    check_sendable(lambda ctx, config: None, {})
    assert cloudpickle.loads(cloudpickle.dumps(torch.classes)) is torch.classes
    assert cloudpickle.loads(cloudpickle.dumps(torch.backends.cudnn)) is torch.backends.cudnn
