"""Where the features cross: each entry point, on each kind of cluster, with tracking off, on and down.

Features each tested alone pass on their own path and break where they meet (issue 29: a
sweep on the warm cluster whose every trial failed on TLS ended Completed). Every pair of
values of these four factors meets in at least one cell below, an orthogonal array L9:

    flow      transfer-learning | hyperparameter-sweep | batch-predict
    launch    a Python call | a deployment run by `prefect-ddp worker` (a work pool's process worker)
    cluster   per-run local | warm (the launcher's own) | external (`dask scheduler` + `dask worker`)
    tracking  off | on (a real `mlflow server`) | down (a port where no server listens)

Each cell asserts the decision its run makes for the user: which images trained, which
model is kept, what the registry's `champion` names, which images were scored and with which
model, and which cluster ran it. The README's "Testing" section lists the cells; the sweep
under `prefect-ddp serve` is in tests/test_serve.py and a registry failure between register
and alias in tests/test_tracking.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from distributed import Client
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    DeploymentFilter,
    DeploymentFilterName,
)
from prefect.deployments import run_deployment

from prefect_ddp.blocks.cluster import DaskCluster
from prefect_ddp.blocks.tracking import MlflowTracking
from prefect_ddp.blocks.warm_cluster import (
    WARM_CLUSTER_ENV,
    read_ticket,
    wait_until_free,
    warm_cluster,
    worker_addresses,
)
from prefect_ddp.flows.batch_predict import batch_predict
from prefect_ddp.flows.sweep import hyperparameter_sweep
from prefect_ddp.flows.transfer_learning import transfer_learning
from prefect_ddp.tasks.config import ClusterConfig, DataConfig, ModelConfig, OutputConfig, TrackingConfig, TrainingConfig
from prefect_ddp.tasks.gang import free_port
from prefect_ddp.tasks.results.registry import ALIAS
from prefect_ddp.tasks.results.run_folder import run_folder_name
from prefect_ddp.tasks.sweeps.settings import SweepSettings
from tests.conftest import PER_CLASS
from tests.support.api_helpers import all_logs
from tests.support.deployed import check, prefect_cli
from tests.support.external_dask import TRAINING_ENV, dask_processes, owner_environment
from tests.support.flow_runs import TINY_TRAINING

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TRACKED, DOWN = "crossing-mlflow", "crossing-mlflow-down"
EXPERIMENT = "crossings"
DATA = {"block": "test-images", "val_fraction": 0.3, "seed": 5, "index_cache_minutes": 0}
MODEL = {"backbone": "mobilenet_v3_small"}
# The session's test-images (tests/conftest.py): PER_CLASS shapes per class, a truncated JPEG
# in square/ (never trained on, listed unreadable when scored), a README and an image
# directly under the prefix (in no class: never trained on, scored without a true class).
CLASS_IMAGES = {f"{shape}/{n:04d}.jpg" for shape in ("circle", "square", "triangle") for n in range(PER_CLASS)}
SCORABLE = CLASS_IMAGES | {"stray.jpg"}
TIMEOUT_S = 600


@dataclass
class Cell:
    flow: str
    launch: str
    cluster: str
    tracking: str

    def __str__(self) -> str:
        return f"{self.flow}-{self.launch}-{self.cluster}-tracking-{self.tracking}"


# -- the services the cells stand on ------------------------------------------------------

@pytest.fixture(scope="module")
def blocks(prefect_api, image_location, mlflow_uri) -> str:
    """test-images, and a tracking block for a real server and one for a port with no server."""
    image_location.save("test-images", overwrite=True)
    MlflowTracking(tracking_uri=mlflow_uri).save(TRACKED, overwrite=True)
    MlflowTracking(tracking_uri=f"http://127.0.0.1:{free_port()}").save(DOWN, overwrite=True)
    return mlflow_uri


@pytest.fixture(scope="module")
def external(tmp_path_factory, prefect_home: Path, prefect_api: str) -> Iterator[str]:
    """Two `dask worker`s of a `dask scheduler`, set up as docs/running.md tells a cluster's owner."""
    env = owner_environment(prefect_home, TRAINING_ENV | {"PREFECT_API_URL": prefect_api})
    with dask_processes(tmp_path_factory.mktemp("external"), 2, nanny=True, env=env) as address:
        yield address


@pytest.fixture(scope="module")
def holder(prefect_api: str) -> Iterator[dict[str, str]]:
    """A warm 2-worker cluster held by this process, as `prefect-ddp serve` holds one; yields the
    environment the runs it serves would have (it is started in the repository's root, as they run)."""
    before = os.getcwd()
    os.chdir(REPO)
    try:
        with warm_cluster(DaskCluster(n_workers=2)) as ticket:
            yield dict(os.environ) | {"ticket": str(ticket)}
    finally:
        os.chdir(before)


@pytest.fixture
def launcher(request, monkeypatch: pytest.MonkeyPatch) -> Callable[[], dict[str, Any]]:
    """The cluster a Python-launched cell asks for, as a call its body makes first. For `warm`,
    the call makes the test's environment the holder's, as a run the holder starts has it (in the
    body: pytest changes PYTEST_CURRENT_TEST between a test's setup and its call)."""
    cell: Cell = request.param
    if cell.cluster == "warm":
        environment = request.getfixturevalue("holder")

        def like_the_holder() -> dict[str, Any]:
            wait_until_free(Path(environment["ticket"]))
            for key in set(os.environ) - set(environment):
                monkeypatch.delenv(key)
            for key, value in environment.items():
                if key != "ticket":
                    monkeypatch.setenv(key, value)
            return {"n_workers": 2}

        return like_the_holder
    monkeypatch.delenv(WARM_CLUSTER_ENV, raising=False)
    cluster = {"address": request.getfixturevalue("external")} if cell.cluster == "external" else {"n_workers": 1}
    return lambda: cluster


def tracking_block(cell: Cell) -> str | None:
    return {"off": None, "on": TRACKED, "down": DOWN}[cell.tracking]


# -- what a cell's run decided -------------------------------------------------------------

def logs_of(flow_run_id: Any, words: str) -> str:
    with get_client(sync_client=True) as api:
        return "\n".join(log.message for log in all_logs(api, flow_run_id, words))


def assert_cluster(cell: Cell, flow_run_id: Any) -> None:
    """The run used the kind of cluster the cell names, and its log says so."""
    logs = logs_of(flow_run_id, "Dask cluster up")
    assert ("Using the warm Dask cluster" in logs) == (cell.cluster == "warm"), logs[-3000:]
    if cell.cluster == "local" and cell.launch == "deployment":
        assert "Not using the warm Dask cluster" in logs and "workers" in logs, logs[-3000:]


def assert_trained_on_the_readable_class_images(run_folder: Path) -> None:
    split = json.loads((run_folder / "split.json").read_text())
    train, val = set(split["train_keys"]), set(split["val_keys"])
    assert not train & val and train | val == CLASS_IMAGES, sorted((train | val) ^ CLASS_IMAGES)


def kept(output: Path, name: str) -> dict[str, Any]:
    return json.loads((output / name / "latest.json").read_text())


def assert_kept(output: Path, name: str, run_folder: Path) -> dict[str, Any]:
    """`run_folder`'s model is the one kept under `name`: latest.json names it, and its copy is the run's."""
    pointer = kept(output, name)
    assert Path(pointer["version"]).name == run_folder.name, pointer  # versions/<the run's folder name>
    assert Path(pointer["version"], "model.pt").read_bytes() == (run_folder / "model.pt").read_bytes()
    return pointer


def assert_champion_is_kept(mlflow_uri: str, name: str, pointer: dict[str, Any], flow_run_id: str) -> None:
    """The registry's champion is the model latest.json names: its version, logged by that flow run."""
    client = MlflowClient(mlflow_uri)
    champion = client.get_model_version_by_alias(name, ALIAS)
    assert champion.version == pointer["registered"]["version"], (champion.version, pointer)
    assert client.get_run(champion.run_id).data.tags["prefect.flow_run_id"] == flow_run_id


def scored_keys(output_folder: Path) -> set[str]:
    table = pq.read_table(output_folder / "predictions")
    return {key.rsplit("shapes/", 1)[-1] for key in table.column("key").to_pylist()}


def assert_scored_with(summary: dict[str, Any], version: str) -> None:
    """Every readable image scored once, with the model of `version`, the truncated one listed."""
    folder = Path(summary["files"]["summary.json"]).parent
    assert scored_keys(folder) == SCORABLE and summary["rows"] == len(SCORABLE)
    assert [Path(u).name for u in summary["unreadable"]] == ["broken.jpg"], summary["unreadable"]
    copy = Path(summary["files"]["model"])
    assert (copy / "model.pt").read_bytes() == Path(version, "model.pt").read_bytes()


def deployment_run(name: str, parameters: dict[str, Any]) -> Any:
    """A run of `name` on the session's `prefect-ddp worker`, to its end."""
    run = run_deployment(name, parameters=parameters, timeout=TIMEOUT_S, poll_interval=1)
    assert run.state.is_completed(), f"{name}: {run.state.type.value}: {run.state.message}"
    return run


def run_folder_of(output: Path, flow_run_id: Any) -> Path:
    (folder,) = [p for p in output.iterdir() if p.name.endswith(str(flow_run_id)[:8])]
    return folder


# -- transfer-learning ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def kept_plain(blocks, tmp_path_factory) -> tuple[Path, str]:
    """Cell transfer-learning-python-local-tracking-off: a run kept under `plain` (scored below)."""
    output = tmp_path_factory.mktemp("plain")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(WARM_CLUSTER_ENV, raising=False)  # whichever test asked first, no warm cluster is on offer
        state = transfer_learning(
            data=DataConfig(**DATA), model=ModelConfig(**MODEL), training=TrainingConfig(**TINY_TRAINING),
            cluster=ClusterConfig(n_workers=1, init_timeout_s=60, max_restarts=0),
            output=OutputConfig(url=str(output), model_name="plain"), return_state=True)
    assert state.is_completed(), state.message
    return output, str(state.state_details.flow_run_id)


def test_transfer_learning_python_local_tracking_off(kept_plain):
    output, flow_run_id = kept_plain
    assert_cluster(Cell("transfer-learning", "python", "local", "off"), flow_run_id)
    folder = run_folder_of(output, flow_run_id)
    assert_trained_on_the_readable_class_images(folder)
    assert_kept(output, "plain", folder)


@pytest.fixture(scope="module")
def kept_tracked(blocks, deployments, tmp_path_factory) -> tuple[Path, Any]:
    """Cell transfer-learning-deployment-warm-tracking-on: `prefect deployment run
    transfer-learning/on-demand` from the CLI, as docs/deployments.md walks it (nested parameters and a
    shortcut), on the worker's warm cluster, kept and registered under the deployment's name
    (and scored below from the registry)."""
    output = tmp_path_factory.mktemp("tracked")
    training = {key: value for key, value in TINY_TRAINING.items() if key != "epochs"}
    result = check(prefect_cli(
        deployments, "deployment", "run", "transfer-learning/on-demand",
        "--param", f"data={json.dumps(DATA)}", "--param", f"model={json.dumps(MODEL)}",
        "--param", "epochs=1", "--param", f"training={json.dumps(training)}",
        "--param", 'cluster={"n_workers": 2, "init_timeout_s": 60}',
        "--param", f"output={json.dumps({'url': str(output)})}",
        "--param", f"tracking={json.dumps({'block': TRACKED, 'experiment': EXPERIMENT})}",
        "--watch", timeout=TIMEOUT_S,
    ))
    assert "Flow run finished successfully in 'Completed'" in result.stdout
    with get_client(sync_client=True) as api:
        runs = api.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["on-demand"])))
    (run,) = [r for r in runs if r.parameters.get("output", {}).get("url") == str(output)]
    return output, run


def test_transfer_learning_deployment_warm_tracking_on(kept_tracked, blocks):
    output, run = kept_tracked
    assert_cluster(Cell("transfer-learning", "deployment", "warm", "on"), run.id)
    # The shortcut set epochs; the nested object set the rest of training.
    assert run.parameters["epochs"] == 1 and run.parameters["training"]["batch_size"] == 4
    folder = output / run_folder_name(run.name, str(run.id))
    assert_trained_on_the_readable_class_images(folder)
    # A run of the deployment keeps its model under the deployment's name; the registry agrees.
    assert_champion_is_kept(blocks, "on-demand", assert_kept(output, "on-demand", folder), str(run.id))
    with get_client(sync_client=True) as api:
        artifacts = api.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    assert {"image-index", "dataset-validation", "training-progress", "training-report"} <= {a.key for a in artifacts}
    report = next(a for a in artifacts if a.key == "training-report").data
    assert "![loss and accuracy per epoch](data:image/png;base64," in report and "**Promoted**: " in report


@pytest.mark.parametrize("launcher", [Cell("transfer-learning", "python", "external", "down")], indirect=True,
                         ids=str)
def test_transfer_learning_python_external_tracking_down(launcher, blocks, tmp_path, caplog):
    state = transfer_learning(
        data=DataConfig(**DATA), model=ModelConfig(**MODEL), training=TrainingConfig(**TINY_TRAINING),
        cluster=ClusterConfig(**launcher(), init_timeout_s=60, max_restarts=0),
        output=OutputConfig(url=str(tmp_path), model_name="untracked"),
        tracking=TrackingConfig(block=DOWN, experiment=EXPERIMENT), return_state=True)
    assert state.is_completed(), state.message
    flow_run_id = state.state_details.flow_run_id
    assert_cluster(Cell("transfer-learning", "python", "external", "down"), flow_run_id)
    folder = run_folder_of(tmp_path, flow_run_id)
    assert_trained_on_the_readable_class_images(folder)
    pointer = assert_kept(tmp_path, "untracked", folder)
    assert pointer.get("registered") is None  # nothing claims a registry version it never got
    assert "MLflow tracking: could not" in logs_of(flow_run_id, "MLflow tracking: could not")


# -- hyperparameter-sweep ------------------------------------------------------------------

SPACE = {"training.lr": {"kind": "grid", "values": [0.01, 0.001]}}


def sweep_settings(name: str) -> dict[str, Any]:
    return {"name": name, "n_trials": 2, "concurrency": 2, "ranks_per_trial": 1, "sampler": "grid", "promote": True}


def assert_every_trial_trained_and_the_best_kept(record: dict[str, Any], output: Path, name: str) -> dict[str, Any]:
    """Both trials trained on the readable images; the best one's model is the one kept under `name`."""
    assert sorted(row["state"] for row in record["trials"]) == ["completed", "completed"], record["trials"]
    for row in record["trials"]:
        assert_trained_on_the_readable_class_images(Path(row["model_url"]).parent)
    return assert_kept(output, name, Path(record["best"]["model_url"]).parent)


def run_sweep(cell: Cell, cluster: dict[str, Any], output: Path, name: str) -> Any:
    state = hyperparameter_sweep(
        space=SPACE, settings=SweepSettings(**sweep_settings(name)), data=DataConfig(**DATA),
        model=ModelConfig(**MODEL), training=TrainingConfig(**TINY_TRAINING),
        cluster=ClusterConfig(**cluster, init_timeout_s=60),
        output=OutputConfig(url=str(output), model_name=name),
        tracking=TrackingConfig(block=tracking_block(cell), experiment=EXPERIMENT), return_state=True)
    assert state.is_completed(), state.message
    return state


@pytest.mark.parametrize("launcher", [Cell("hyperparameter-sweep", "python", "warm", "down")], indirect=True, ids=str)
def test_hyperparameter_sweep_python_warm_tracking_down(launcher, holder, blocks, tmp_path):
    """Its trials were handed the warm cluster's TLS address without the certificate: each failed
    at once ("TLS expects a ssl_context argument") and the sweep ended Completed (issue 29)."""
    cell = Cell("hyperparameter-sweep", "python", "warm", "down")
    cluster = launcher()
    ticket = read_ticket(Path(holder["ticket"]))
    with Client(ticket.address, security=ticket.security(), timeout=30) as client:
        warm_workers = set(client.run_on_scheduler(worker_addresses))
    state = run_sweep(cell, cluster, tmp_path, "swept-warm")
    assert_cluster(cell, state.state_details.flow_run_id)
    record = state.result()
    pointer = assert_every_trial_trained_and_the_best_kept(record, tmp_path, "swept-warm")
    assert pointer.get("registered") is None
    for trial in record["trials"]:  # the warm cluster's workers, not a cluster of the sweep's own
        assert set(trial["workers"]) <= warm_workers, (trial["workers"], warm_workers)


@pytest.mark.parametrize("launcher", [Cell("hyperparameter-sweep", "python", "local", "on")], indirect=True, ids=str)
def test_hyperparameter_sweep_python_local_tracking_on(launcher, blocks, tmp_path):
    cell = Cell("hyperparameter-sweep", "python", "local", "on")
    state = run_sweep(cell, launcher() | {"n_workers": 2}, tmp_path, "swept-local")
    assert_cluster(cell, state.state_details.flow_run_id)
    record = state.result()
    pointer = assert_every_trial_trained_and_the_best_kept(record, tmp_path, "swept-local")
    assert_champion_is_kept(blocks, "swept-local", pointer, record["best"]["flow_run_id"])


def test_hyperparameter_sweep_deployment_external_tracking_off(blocks, deployments, external, tmp_path):
    run = deployment_run("hyperparameter-sweep/ui-sweep", {
        "space": SPACE, "settings": sweep_settings("swept-external"), "data": DATA, "model": MODEL,
        "training": TINY_TRAINING, "cluster": {"address": external, "init_timeout_s": 60},
        "output": {"url": str(tmp_path), "model_name": "swept-external"}})
    assert_cluster(Cell("hyperparameter-sweep", "deployment", "external", "off"), run.id)
    record = json.loads((tmp_path / "swept-external" / "sweep.json").read_text())
    assert_every_trial_trained_and_the_best_kept(record, tmp_path, "swept-external")


# -- batch-predict --------------------------------------------------------------------------

@pytest.mark.parametrize("launcher", [Cell("batch-predict", "python", "external", "on")], indirect=True, ids=str)
def test_batch_predict_python_external_tracking_on(launcher, kept_tracked, tmp_path):
    output, _ = kept_tracked
    summary = batch_predict(model=f"models:/on-demand@{ALIAS}", data_block="test-images", output_url=str(tmp_path),
                            cluster=ClusterConfig(**launcher()), tracking_block=TRACKED, chunk_size=8)
    # The registry's champion and OUTPUT/on-demand/latest name one model, and it is what scored.
    assert_scored_with(summary, kept(output, "on-demand")["version"])


@pytest.mark.parametrize("launcher", [Cell("batch-predict", "python", "warm", "off")], indirect=True, ids=str)
def test_batch_predict_python_warm_tracking_off(launcher, kept_plain, tmp_path):
    output, _ = kept_plain
    state = batch_predict(model=f"{output}/plain/latest", data_block="test-images", output_url=str(tmp_path),
                          cluster=ClusterConfig(**launcher()), chunk_size=8, return_state=True)
    assert_cluster(Cell("batch-predict", "python", "warm", "off"), state.state_details.flow_run_id)
    assert_scored_with(state.result(), kept(output, "plain")["version"])


def test_batch_predict_deployment_local_tracking_down(kept_plain, deployments, blocks, tmp_path):
    output, _ = kept_plain
    run = deployment_run("batch-predict/nightly-score", {
        "model": f"{output}/plain/latest", "data_block": "test-images", "output_url": str(tmp_path),
        "cluster": {"n_workers": 1}, "tracking_block": DOWN, "chunk_size": 8})
    assert_cluster(Cell("batch-predict", "deployment", "local", "down"), run.id)
    (summary_file,) = tmp_path.glob("*/summary.json")
    assert_scored_with(json.loads(summary_file.read_text()), kept(output, "plain")["version"])
