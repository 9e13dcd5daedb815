"""prefect.yaml through the CLI, as the README walks it: pool, deploy, worker, deployment run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    DeploymentFilter,
    DeploymentFilterId,
    DeploymentFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)

from prefect_ddp.tasks.results.run_folder import run_folder_name
from tests.support.api_helpers import all_logs
from tests.support.deployed import REPO, check, prefect_cli

TINY_TRAINING = '{"batch_size": 4, "image_size": 32, "num_workers": 0}'


def on_demand_runs() -> list:
    with get_client(sync_client=True) as api:
        return api.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["on-demand"])))


@pytest.mark.slow
def test_the_on_demand_deployment_runs_from_the_cli_with_nested_parameters(deployments, tmp_path):
    result = check(prefect_cli(
        deployments, "deployment", "run", "transfer-learning/on-demand",
        # Listed afresh, so this run leaves its own image-index artifact.
        "--param", 'data={"block": "test-images", "index_cache_minutes": 0}',
        "--param", "epochs=1",
        "--param", f"training={TINY_TRAINING}",
        "--param", 'cluster={"n_workers": 2, "init_timeout_s": 60}',
        "--param", f'output={{"url": "{tmp_path}"}}',
        "--watch", timeout=400,
    ))
    assert "Flow run finished successfully in 'Completed'" in result.stdout
    (run,) = [r for r in on_demand_runs() if r.parameters.get("output", {}).get("url") == str(tmp_path)]
    # `prefect-ddp worker` kept a cluster warm, and this run, asking for the same 2 workers, used it.
    with get_client(sync_client=True) as api:
        logs = all_logs(api, run.id, "Using the warm Dask cluster")
    assert any("Using the warm Dask cluster" in log.message for log in logs), [log.message for log in logs][:20]
    # The shortcut set epochs; the nested object set the rest of training.
    assert run.parameters["epochs"] == 1 and run.parameters["training"]["batch_size"] == 4
    with get_client(sync_client=True) as api:
        artifacts = api.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    assert {"image-index", "dataset-validation", "training-progress", "training-report"} <= {a.key for a in artifacts}
    report = next(a for a in artifacts if a.key == "training-report").data
    assert "![loss and accuracy per epoch](data:image/png;base64," in report
    # A run of the deployment keeps its model under the deployment's name.
    kept = json.loads((tmp_path / "on-demand" / "latest.json").read_text())
    assert kept["run"]["name"] == run.name and "**Promoted**: " in report
    assert kept["version"] == str(tmp_path / "on-demand" / "versions" / run_folder_name(run.name, str(run.id)))
    assert (tmp_path / run_folder_name(run.name, str(run.id)) / "model.pt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("param, message", [
    ("lr=0", "Validation failed for field 'lr'. Failure reason: 0 is less than or equal to the minimum of 0"),
    ('training={"lr": -1}', "Validation failed for field 'training.lr'"),
    ("backbone=vgg11", "Validation failed for field 'backbone'. Failure reason: 'vgg11' is not one of"),
    ('training={"epoch": 2}', "Additional properties are not allowed ('epoch' was unexpected)"),
    ("epoch=2", "parameters were specified but not found on the deployment: 'epoch'"),
])
def test_invalid_parameters_are_refused_before_a_run_exists(deployments, param, message):
    before = len(on_demand_runs())
    result = prefect_cli(deployments, "deployment", "run", "transfer-learning/on-demand",
                         "--param", "data_block=test-images", "--param", param)
    assert result.returncode != 0
    assert message in " ".join((result.stdout + result.stderr).split())
    assert len(on_demand_runs()) == before  # refused by the server: no run, no cluster


def scheduled_runs(deployment_id, timeout_s: float) -> list:
    """The deployment's runs the server's scheduler created, once there are any."""
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as api:
        while True:
            runs = api.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["SCHEDULED"]))),
            )
            if runs or time.monotonic() > deadline:
                return runs
            time.sleep(1)


@pytest.mark.slow
def test_the_nightly_schedule_creates_runs_at_two_in_the_morning(deployments):
    with get_client(sync_client=True) as api:
        nightly = api.read_deployment_by_name("transfer-learning/nightly")
    assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
    assert nightly.parameters["data"]["block"] == "images-nightly"
    assert nightly.parameters["model"]["warm_start"] is True
    assert Path(nightly.pull_steps[0]["prefect.deployments.steps.set_working_directory"]["directory"]) == REPO
    # With SQLAlchemy 2.1 prefect 3.8.8's scheduler failed here and no run was ever created.
    runs = scheduled_runs(nightly.id, timeout_s=60)
    assert runs and all((r.expected_start_time.hour, r.expected_start_time.minute) == (2, 0) for r in runs)


@pytest.mark.slow
def test_the_nightly_score_deployment_scores_with_the_nightly_champion_after_it_trains(deployments):
    with get_client(sync_client=True) as api:
        score = api.read_deployment_by_name("batch-predict/nightly-score")
        nightly = api.read_deployment_by_name("transfer-learning/nightly")
    assert [s.schedule.cron for s in score.schedules] == ["0 5 * * *"]
    assert score.schedules[0].schedule.timezone == nightly.schedules[0].schedule.timezone == "UTC"
    assert score.parameters["model"] == f"{nightly.parameters['output']['url']}/nightly/latest"


def test_the_ui_sweep_deployment_takes_a_search_space(deployments):
    with get_client(sync_client=True) as api:
        sweep = api.read_deployment_by_name("hyperparameter-sweep/ui-sweep")
    space = sweep.parameter_openapi_schema["properties"]["space"]
    assert space["additionalProperties"] == {"$ref": "#/definitions/Dimension"}
    assert set(sweep.parameter_openapi_schema["definitions"]["Dimension"]["properties"]) == {"kind", "values", "low", "high"}
    assert sweep.parameters["space"]["training.lr"]["kind"] == "log_uniform"
