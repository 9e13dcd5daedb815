"""The laptop path: `python -m prefect_ddp.deployments.serve` serves the flows on its warm cluster;
a run of each completes, and the sweep's trials train (a crossing cell of tests/test_crossings.py:
hyperparameter-sweep, a deployment, the warm cluster of `prefect-ddp serve`, tracking off)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment

from prefect_ddp.deployments.serve import serving
from prefect_ddp.tasks.results.run_folder import run_folder_name
from tests.support.api_helpers import all_logs

pytestmark = pytest.mark.slow
# The served defaults are the demo's; a smaller recipe keeps the runs short.
TINY = {"epochs": 1, "batch_size": 8, "image_size": 32, "num_workers": 0}


@pytest.fixture(scope="module")
def output(prefect_api, tmp_path_factory) -> Iterator[Path]:
    """The folder the served flows write to, while `serve` runs."""
    folder = tmp_path_factory.mktemp("served")
    with serving(prefect_api, folder / "serve.log", "--per-class", "8", "--output", str(folder / "out")):
        yield folder / "out"


def test_the_served_deployment_runs_on_the_demo_images(output):
    run = run_deployment("transfer-learning/laptop", timeout=300, poll_interval=1, parameters={"training": TINY})
    assert run.state.is_completed(), run.state.message
    assert run.parameters["data"]["block"] == "demo-images"
    assert (output / run_folder_name(run.name, str(run.id)) / "model.pt").exists()


def test_the_served_sweep_trains_every_trial_on_the_warm_cluster(output):
    run = run_deployment("hyperparameter-sweep/laptop-sweep", timeout=400, poll_interval=1, parameters={
        "space": {"training.lr": {"kind": "grid", "values": [0.01, 0.001]}},
        "settings": {"name": "laptop-sweep", "n_trials": 2, "concurrency": 2, "sampler": "grid"},
        "training": TINY})
    assert run.state.is_completed(), run.state.message
    with get_client(sync_client=True) as api:
        logs = "\n".join(log.message for log in all_logs(api, run.id, "Using the warm Dask cluster"))
    assert "Using the warm Dask cluster" in logs, logs[-2000:]
    record = json.loads((output / "laptop-sweep" / "sweep.json").read_text())
    assert [row["state"] for row in record["trials"]] == ["completed", "completed"], record["trials"]
    assert all(Path(row["model_url"]).exists() for row in record["trials"])
