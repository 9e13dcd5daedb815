"""Faults outside the training loop's own code: S3 stalling mid-training."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from blocks.data_location import DataLocation
from tests.api_helpers import assert_no_task_run_left_running
from tests.faulty_s3 import faulty_s3
from tests.flow_runs import block_copy, run_tiny_flow

FETCH_TIMEOUT_S = 5
STALL_WINDOW_S = FETCH_TIMEOUT_S + 1
BATCH = 4  # tests.flow_runs.TINY_TRAINING's batch_size


def stall_training_for_a_while(front, seen: dict) -> None:
    """Once training fetches (an image's second GET: decode-check made the first), hold the
    next batch of GETs of both ranks, longer than their fetch timeout, so both fail."""
    deadline = time.monotonic() + 300
    while not any(n > 1 for key, n in list(front.gets.items()) if key.endswith(".jpg")):
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)
    # Exactly the GETs of the batches both ranks fetch next (batch 4): the re-formed gang's
    # GETs pass, however soon it starts.
    front.stall_gets("*", seconds=120, times=2 * BATCH)
    seen["stalled"] = front.wait_stalled(timeout=STALL_WINDOW_S)
    time.sleep(STALL_WINDOW_S)
    front.clear()


@pytest.mark.slow
def test_a_stalled_s3_endpoint_is_detected_by_the_fetch_timeout_and_the_gang_retried(
    image_location: DataLocation, dask_cluster, s3_endpoint, tmp_path,
):
    with faulty_s3(s3_endpoint) as front:
        block_copy(image_location, endpoint_url=front.endpoint).save("stalling-images", overwrite=True)
        seen: dict = {}
        watcher = threading.Thread(target=stall_training_for_a_while, args=(front, seen), daemon=True)
        watcher.start()
        state = run_tiny_flow(
            tmp_path, {"address": dask_cluster.scheduler_address, "world_size": 2, "max_restarts": 1,
                       "init_timeout_s": 300},
            data={"block": "stalling-images"}, training={"epochs": 2, "fetch_timeout_s": FETCH_TIMEOUT_S},
        )
        watcher.join()
    summary = state.result()
    assert seen["stalled"], "no GET was ever held"
    first, second = summary["attempts"]
    assert "FetchTimeout" in first["ended"] and "within fetch_timeout_s=5 s" in first["ended"], first
    # Found by the fetch timeout, far inside the 300 s the process group would have waited
    # (the attempt's time includes starting the ranks, and stopping them: up to 15 s grace).
    assert first["seconds"] < 60, first
    assert second["ended"] == "completed" and second["resumed_after_epoch"] is not None
    assert [h["epoch"] for h in summary["history"]] == [1, 2]
    report = Path(summary["files"]["report.md"]).read_text()
    assert "The gang was re-formed: 2 attempts" in report and "FetchTimeout" in report
    assert_no_task_run_left_running(state.state_details.flow_run_id)
