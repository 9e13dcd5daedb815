"""Storage faults on the data path, through the fault-injecting S3 front (tests/support/faulty_s3.py).

Throttling and dropped connections are retried and never mistaken for corrupt images; a
stalled endpoint fails a batch within the fetch limit; a worker killed mid decode-check
leaves no task run behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import fsspec
import pytest
import s3fs
from distributed import Client
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.states import State

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.data.dataset import FETCH_ATTEMPTS as DATASET_ATTEMPTS
from prefect_ddp.tasks.data.dataset import FetchTimeout, S3ImageFolder, eval_transform
from prefect_ddp.tasks.data.object_reads import fetch_objects
from prefect_ddp.tasks.data.validation import FETCH_ATTEMPTS, decode_chunk
from tests.support.api_helpers import assert_no_task_run_left_running
from tests.support.faulty_s3 import FaultyS3
from tests.support.flow_runs import block_copy

KEYS = ["circle/0000.jpg", "circle/0001.jpg", "square/0000.jpg"]


@pytest.fixture
def via_front(image_location: DataLocation, front: FaultyS3) -> DataLocation:
    """The test images through the front; botocore makes one attempt, so the counts are ours."""
    return block_copy(image_location, endpoint_url=front.endpoint, max_attempts=1)


def object_key(location: DataLocation, key: str) -> str:
    """`key` as the front sees it: bucket/prefix/key."""
    return f"{location.url.removeprefix('s3://')}/{key}"


@pytest.mark.unit
def test_fetch_objects_takes_paths_literally_and_retries_only_what_may_pass():
    fs = fsspec.filesystem("memory")
    fs.pipe({"/d/x[1].jpg": b"bracket", "/d/x1.jpg": b"other", "/d/y*.jpg": b"star"})
    got = fetch_objects(fs, ["/d/x[1].jpg", "/d/y*.jpg", "/d/x[1].jpg", "/d/gone.jpg"], batch_size=2, attempts=3)
    assert got["/d/x[1].jpg"] == b"bracket" and got["/d/y*.jpg"] == b"star"
    assert isinstance(got["/d/gone.jpg"], FileNotFoundError)
    with pytest.raises(ValueError, match="attempts=0 and batch_size=4; both must be at least 1"):
        fetch_objects(fs, ["/d/x1.jpg"], batch_size=4, attempts=0)


@pytest.mark.parametrize("how", ["503", "reset"])
def test_decode_check_retries_a_throttled_or_dropped_fetch_instead_of_excluding_it(via_front, front, how):
    # More failures than s3fs's own retries absorb: decode-check's retry has to step in.
    times = s3fs.S3FileSystem.retries + 1
    front.fail_gets(object_key(via_front, KEYS[1]), times=times, how=how)
    results = decode_chunk.fn(via_front, KEYS, [0, 1, 2])
    assert [r.error for r in results] == [None, None, None]
    assert results[1].width == 32
    assert front.gets[object_key(via_front, KEYS[1])] == times + 1


def test_a_fetch_that_keeps_failing_raises_for_prefect_to_retry_and_is_not_reported_corrupt(via_front, front):
    front.fail_gets(object_key(via_front, KEYS[2]), times=10_000, how="reset")
    with pytest.raises(ConnectionError, match=rf"Could not fetch 1 of 3 image\(s\) under 's3://test-images/shapes' "
                                              rf"after {FETCH_ATTEMPTS} attempts, e.g. .*square/0000.jpg.*not known to be corrupt"):
        decode_chunk.fn(via_front, KEYS, [0, 1, 2])


def test_a_missing_image_is_excluded_without_retries(via_front, front):
    results = decode_chunk.fn(via_front, [KEYS[0], "circle/gone.jpg"], [0, 1])
    assert results[0].error is None
    assert results[1].error.startswith("FileNotFoundError")
    assert front.gets[object_key(via_front, "circle/gone.jpg")] == 1


def test_prefect_retries_the_chunk_when_the_task_s_own_retries_are_used_up(via_front, front, prefect_api):
    # Exactly one task run's worth of failures: s3fs's retries times decode-check's attempts.
    front.fail_gets(object_key(via_front, KEYS[0]), times=s3fs.S3FileSystem.retries * FETCH_ATTEMPTS)

    @flow
    def check_one_chunk():
        return decode_chunk.with_options(retry_delay_seconds=0)(via_front, KEYS, [0, 1, 2], return_state=True)

    state = check_one_chunk()
    assert state.is_completed() and all(r.error is None for r in state.result())
    with get_client(sync_client=True) as api:
        assert api.read_task_run(state.state_details.task_run_id).run_count == 2


def dataset_through(location: DataLocation, fetch_timeout_s: float) -> S3ImageFolder:
    return S3ImageFolder(location.url, KEYS, [0, 0, 1], location.storage_options(), eval_transform(32),
                         fetch_timeout_s=fetch_timeout_s)


def test_a_stalled_endpoint_fails_the_batch_within_the_fetch_limit_naming_the_images(via_front, front):
    front.stall_gets("test-images/shapes/*", seconds=30)
    dataset = dataset_through(via_front, fetch_timeout_s=2)
    started = time.monotonic()
    with pytest.raises(FetchTimeout, match=r"Could not fetch 3 image\(s\) within fetch_timeout_s=2 s, e.g. "
                                           r".*circle/0000.jpg.*raise training.fetch_timeout_s"):
        dataset.__getitems__([0, 1, 2])
    assert time.monotonic() - started < 15  # the 2 s limit, not the 30 s stall, on a loaded machine too


def test_a_stall_shorter_than_the_limit_only_slows_the_batch(via_front, front):
    front.stall_gets("test-images/shapes/*", seconds=1)
    dataset = dataset_through(via_front, fetch_timeout_s=4)
    started = time.monotonic()
    batch = dataset.__getitems__([0, 1, 2])
    assert [label for _, label in batch] == [0, 0, 1]
    assert time.monotonic() - started >= 1  # it did wait out the stall (and the 4 s limit did not fail it)
    assert all(front.gets[object_key(via_front, key)] == 1 for key in KEYS)


def test_the_dataset_leaves_out_a_missing_image_without_retrying_it(via_front, front):
    dataset = S3ImageFolder(via_front.url, ["circle/gone.jpg"], [0], via_front.storage_options(), eval_transform(32))
    assert dataset[0][1] == -1  # a stand-in, labelled unreadable (prefect_ddp.tasks.data.dataset.unreadable_label)
    assert front.gets[object_key(via_front, "circle/gone.jpg")] == 1


def test_a_fetch_that_keeps_failing_fails_the_batch_naming_the_image(via_front, front):
    front.fail_gets(object_key(via_front, KEYS[1]), times=10_000, how="reset")
    dataset = dataset_through(via_front, fetch_timeout_s=60)
    with pytest.raises(OSError, match=rf"Could not fetch 1 image\(s\) after {DATASET_ATTEMPTS} attempts, e.g. "
                                      r".*circle/0001.jpg"):
        dataset.__getitems__([0, 1, 2])


def kill_the_worker_running_decode_check(scheduler_address: str, front: FaultyS3, killed: list) -> None:
    """Once decode-check is stuck in its GETs, SIGKILL the worker process running it."""
    try:
        assert front.wait_stalled(timeout=120), "decode-check never fetched through the front"
        with Client(scheduler_address, timeout=30) as client:
            busy = [worker for worker, keys in client.processing().items()
                    if any(str(key).startswith("decode_chunk") for key in keys)]
            pid = client.run(os.getpid, workers=busy[:1])[busy[0]]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    finally:
        front.clear()  # a rerun goes through at once


def run_while_killing_decode_check(location: DataLocation, front: FaultyS3, dask_cluster, output) -> State:
    """The flow on `location`, its decode-check's worker killed mid-fetch; returns its final state."""
    from prefect_ddp.flows.transfer_learning import transfer_learning
    from prefect_ddp.tasks.config import (
        ClusterConfig,
        DataConfig,
        ModelConfig,
        OutputConfig,
        TrainingConfig,
    )

    location.save("faults-front", overwrite=True)
    front.stall_gets("test-images/shapes/*", seconds=60)
    killed: list[int] = []
    killer = threading.Thread(target=kill_the_worker_running_decode_check,
                              args=(dask_cluster.scheduler_address, front, killed))
    killer.start()
    try:
        return transfer_learning(
            data=DataConfig(block="faults-front", index_cache_minutes=0),
            model=ModelConfig(backbone="mobilenet_v3_small"),
            training=TrainingConfig(epochs=1, batch_size=4, image_size=32, num_workers=0),
            cluster=ClusterConfig(address=dask_cluster.scheduler_address, world_size=1, init_timeout_s=60),
            output=OutputConfig(url=str(output)),
            return_state=True,
        )
    finally:
        killer.join()
        assert len(killed) == 1, "no decode-check worker was killed"


def validation_report(flow_run_id) -> str:
    with get_client(sync_client=True) as api:
        artifacts = api.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return next(a.data for a in artifacts if a.key == "dataset-validation")


@pytest.mark.slow
def test_decode_check_is_rerun_when_its_worker_is_killed(via_front, front, dask_cluster, tmp_path):
    state = run_while_killing_decode_check(via_front, front, dask_cluster, tmp_path)
    assert state.is_completed(), state
    flow_run_id = state.state_details.flow_run_id
    runs = assert_no_task_run_left_running(flow_run_id)
    assert [r.state.type.value for r in runs if r.name.startswith("decode-check")] == ["COMPLETED"]
    assert "Checked 31 of 31 images: 30 decoded, **1 excluded**" in validation_report(flow_run_id)


@pytest.mark.slow
def test_a_chunk_whose_workers_all_die_fails_the_run_and_is_marked_crashed(via_front, front, dask_cluster, tmp_path):
    # Dask's own limit (distributed.scheduler.allowed-failures, 3 by default) set to 0, so
    # that one death is one too many: as when a poison file kills every worker it meets.
    dask_cluster.scheduler.allowed_failures = 0
    try:
        state = run_while_killing_decode_check(via_front, front, dask_cluster, tmp_path)
    finally:
        dask_cluster.scheduler.allowed_failures = 3
    assert state.is_failed(), state
    with pytest.raises(RuntimeError, match=r"Decode-check of 31 image\(s\) from 'circle/0000.jpg' did not finish "
                                           r"on the Dask cluster \(KilledWorker: .*check the worker logs"):
        state.result()
    runs = assert_no_task_run_left_running(state.state_details.flow_run_id)
    assert [r.state.name for r in runs if r.name.startswith("decode-check")] == ["Crashed"]
