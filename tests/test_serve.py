"""The laptop path: `python -m prefect_ddp.deployments.serve` serves the flow; a run of it completes."""

from __future__ import annotations

import pytest
from prefect.deployments import run_deployment

from prefect_ddp.deployments.serve import serving
from prefect_ddp.tasks.results.run_folder import run_folder_name


@pytest.mark.slow
def test_the_served_deployment_runs_on_the_demo_images(prefect_api, tmp_path):
    with serving(prefect_api, tmp_path / "serve.log", "--per-class", "8", "--output", str(tmp_path / "out")):
        run = run_deployment(
            "transfer-learning/laptop", timeout=300,
            # The served defaults are the demo's; a smaller recipe keeps the test short.
            parameters={"training": {"epochs": 1, "batch_size": 8, "image_size": 32, "num_workers": 0}},
        )
    assert run.state.is_completed(), run.state.message
    assert run.parameters["data"]["block"] == "demo-images"
    assert (tmp_path / "out" / run_folder_name(run.name, str(run.id)) / "model.pt").exists()
