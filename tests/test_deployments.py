"""prefect.yaml through the CLI, as docs/deployments.md walks it: pool, deploy, worker, deployment run (a run of
`transfer-learning/on-demand` from the CLI is a cell of tests/test_crossings.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    DeploymentFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)

from tests.support.deployed import REPO, prefect_cli

def on_demand_runs() -> list:
    with get_client(sync_client=True) as api:
        return api.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["on-demand"])))


@pytest.mark.slow
@pytest.mark.parametrize("param, message", [
    ("lr=0", "Validation failed for field 'lr'. Failure reason: 0 is less than or equal to the minimum of 0"),
    ('training={"lr": -1}', "Validation failed for field 'training.lr'"),
    ("batch_size=0", "Validation failed for field 'batch_size'. Failure reason: 0 is less than the minimum of 1"),
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
