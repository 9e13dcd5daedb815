"""Faults outside the training loop's own code: S3 stalling mid-training."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from prefect_ddp.blocks.data_location import DataLocation
from tests.support.api_helpers import assert_no_task_run_left_running
from tests.support.faulty_s3 import faulty_s3
from tests.support.flow_runs import block_copy, run_tiny_flow

FETCH_TIMEOUT_S = 5


def stall_training_for_a_while(front, seen: dict) -> None:
    """Once training fetches (an image's second GET: decode-check made the first), hold every
    GET that arrives before the ranks' fetch timeout can end the attempt.

    A held batch fails its rank FETCH_TIMEOUT_S after it was sent, and a rank sends nothing
    else while it waits, so every GET from the first attempt's last batches arrives inside
    the window and the re-formed gang's, which cannot start before the timeout, after it.
    (Counting the GETs to hold instead raced with a batch half sent when the rule began.)
    """
    deadline = time.monotonic() + 300
    while not any(n > 1 for key, n in list(front.gets.items()) if key.endswith(".jpg")):
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)
    window_ends = time.monotonic() + FETCH_TIMEOUT_S - 0.5
    front.stall_gets("*", seconds=120)
    seen["stalled"] = front.wait_stalled(timeout=FETCH_TIMEOUT_S - 1)
    time.sleep(max(0.0, window_ends - time.monotonic()))
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
