"""The Prefect server restarts in the middle of training: the run completes, and once the
server is back its final state and artifacts are there, with no task run left Running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    TaskRunFilter,
    TaskRunFilterName,
)
from prefect.settings import PREFECT_API_URL, temporary_settings

from prefect_ddp.deployments.local_services import free_port, prefect_server
from tests.support.api_helpers import assert_no_task_run_left_running
from tests.support.image_folders import local_image_folder

pytestmark = pytest.mark.slow


def wait_for_running_ranks(api_url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as api:
        while time.monotonic() < deadline:
            ranks = api.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="rank-")))
            if len(ranks) == 2 and all(r.state and r.state.is_running() for r in ranks):
                return
            time.sleep(0.5)
    raise AssertionError("the ranks never started")


def test_a_run_outlives_a_prefect_server_restart_during_training(tmp_path: Path):
    images = tmp_path / "images"
    local_image_folder(images, per_class=30)
    port, database = free_port(), tmp_path / "prefect.db"
    (tmp_path / "before").mkdir()
    (tmp_path / "after").mkdir()
    with prefect_server(tmp_path / "before", database=database, port=port) as api_url:
        run = subprocess.Popen(
            [sys.executable, "-m", "tests.support.long_run_script", str(images), str(tmp_path / "outputs"), "30"],
            env=dict(os.environ, PREFECT_API_URL=api_url), stdout=subprocess.PIPE, text=True,
        )
        wait_for_running_ranks(api_url)
    down_at = time.monotonic()
    time.sleep(3)  # the server is away, not just restarting
    with prefect_server(tmp_path / "after", database=database, port=port) as api_url:
        back_at = time.monotonic()
        stdout, _ = run.communicate(timeout=400)
        assert run.returncode == 0, stdout
        outcome = json.loads(stdout.strip().splitlines()[-1])
        assert outcome["state"] == "COMPLETED", outcome
        flow_run_id = outcome["flow_run_id"]
        with temporary_settings({PREFECT_API_URL: api_url}):
            with get_client(sync_client=True) as api:
                assert api.read_flow_run(flow_run_id).state.is_completed()
                artifacts = api.read_artifacts(artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
            task_runs = assert_no_task_run_left_running(flow_run_id, settle_s=30)
    assert {"training-report", "training-epochs"} <= {a.key for a in artifacts}
    ranks = [t for t in task_runs if t.name.startswith("rank-")]
    assert len(ranks) == 2 and all(r.state.is_completed() for r in ranks)
    print(f"server away {back_at - down_at:.0f} s")
