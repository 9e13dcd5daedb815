"""A frozen rank is found by its lack of progress, in the hang limit, not the collective's timeout;
a rank that is only slow, validating or waiting for data, is not taken for hung.

Real processes: the session's LocalCluster of nanny workers, a 2-rank gloo gang, a worker
process frozen with SIGSTOP (alive and silent, as a hung host or a swap storm leaves it), and
the recipe itself reading images through the S3 front that holds their GETs.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.deployments.sample_data import shapes_dataset
from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.indexing import build_manifest
from prefect_ddp.tasks.data.splitting import Split
from prefect_ddp.tasks.training.job import TrainJob
from tests.support.api_helpers import assert_no_task_run_left_running, rank_task_runs
from tests.support.faulty_s3 import FaultyS3
from tests.support.flow_runs import block_copy
from tests.support.gang_functions import gang_flow

HANG_S = 10
# Far below any fetch timeout: the floor it sets must not delay finding a frozen worker.
FETCH_TIMEOUT_S = 120


def test_a_frozen_worker_is_found_within_the_hang_limit_and_the_gang_re_formed_without_it(dask_cluster, tmp_path):
    before = set(dask_cluster.scheduler_info["workers"])
    started = time.monotonic()
    state = gang_flow(dask_cluster.scheduler_address, "freeze", {"steps": 60, "freeze_at": 10, "marks": str(tmp_path)},
                      max_restarts=1, hang_timeout_s=HANG_S, hang_floor_s=FETCH_TIMEOUT_S, return_state=True)
    results = state.result()
    first, second = results.attempts
    frozen = json.loads((tmp_path / "frozen").read_text())
    # Named: the rank, its worker, how long it was silent, its last progress, and why.
    found = re.search(r"Rank 1 on (\S+) made no progress for (\d+) s after step (\d+) of epoch 1 \(phase: step\): "
                      r"its worker has not answered the scheduler for \d+ s \(frozen\)", first.ended)
    assert found, first.ended
    assert found[1] == first.workers[1] and 1 <= int(found[3]) <= 10  # its last report (at most one a second)
    assert HANG_S <= int(found[2]) <= HANG_S + 30  # the hang limit and a poll (+ load), not gloo's 300 s
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


# The recipe's validation, many times the hang limit: a rank reports each validation batch.
SHORT_HANG_S = 1.5
VAL_GET_S = 2.0  # each validation GET held this long; 3 batches in flight: 8 rounds, 16 s a rank


def slow_validation_job(image_location: DataLocation, s3_fs, front: FaultyS3, output: str) -> dict:
    """A one-epoch job of 4 training images (one step a rank) and 89 validation images (22 or 23
    batches a rank) whose GETs the front holds for VAL_GET_S each."""
    files = {f"{key.split('/')[0]}/{'t' if n < 4 else 'v'}-{key.split('/')[1]}": data
             for n, (key, data) in enumerate(sorted(shapes_dataset(31, size=32, seed=2).items()))}
    url = f"{image_location.url}-slow-validation"
    s3_fs.pipe({f"{url.removeprefix('s3://')}/{key}": data for key, data in files.items()})
    manifest = build_manifest(url, {key: len(data) for key, data in files.items()})
    train = [i for i, path in enumerate(manifest.paths) if "/t-" in path]
    split = Split(train=train, val=[i for i in range(len(manifest)) if i not in train], seed=0, val_fraction=0.94)
    front.stall_gets("*/v-*", seconds=VAL_GET_S)
    return TrainJob(
        source=block_copy(image_location, url=url, endpoint_url=front.endpoint), output=DataLocation(url=output),
        manifest=manifest, split=split, model=ModelConfig(backbone="mobilenet_v3_small"),
        training=TrainingConfig(epochs=1, batch_size=2, image_size=32, num_workers=0, optimizer="adamw", lr=1e-3),
    ).model_dump()


def test_a_validation_ten_times_the_hang_limit_completes_in_one_attempt(
        dask_cluster, image_location, s3_fs, front, tmp_path):
    job = slow_validation_job(image_location, s3_fs, front, str(tmp_path / "run"))
    state = gang_flow(dask_cluster.scheduler_address, "train", job, hang_timeout_s=SHORT_HANG_S, return_state=True)
    results = state.result()
    assert [a.ended for a in results.attempts] == ["completed"]
    (epoch,) = results[0].history
    assert epoch["val_samples"] == len(job["split"]["val"]) == 89
    assert min(r["validation"] for r in epoch["time"]["per_rank"]) >= 10 * SHORT_HANG_S, epoch["time"]["per_rank"]
