"""MLflow tracking and the registry, against a real `mlflow server`, real gloo ranks and Prefect.

A tracked run (params, epochs, files, model; registered and named `champion`); then, on
its kept name, a worse candidate and two candidates promoting at once, each with a real
logged model of a second MLflow run (their metrics set, so which one is better is known);
a run that warm-starts from `models:/NAME@champion`. The tracked run goes through a front that
demands the password (tests/support/mlflow_auth_front.py), which can also refuse the alias move.
A run whose tracking server is down, and batch-predict reading the champion from the registry,
are cells of tests/test_crossings.py.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import multiprocessing
import re
from pathlib import Path

import pytest
import requests
from mlflow import MlflowClient

from prefect_ddp.blocks.tracking import MlflowTracking
from prefect_ddp.flows.batch_predict import batch_predict
from prefect_ddp.flows.sweep import hyperparameter_sweep
from prefect_ddp.flows.transfer_learning import require_registry, transfer_learning
from prefect_ddp.tasks.config import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    OutputConfig,
    TrackingConfig,
    TrainingConfig,
)
from prefect_ddp.tasks.gang import free_port
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.results.promotion import Promotion, kept_location, promote, read_pointer
from prefect_ddp.tasks.results.records import TrainingSummary
from prefect_ddp.tasks.prediction.model_source import check_champion
from prefect_ddp.tasks.results.registry import ALIAS, POINTER_TAG, ChampionCheck, Registration, why_unchecked
from prefect_ddp.tasks.results.tracking_run import RUN_FILES, log_model, preprocessing, start_run
from prefect_ddp.tasks.sweeps.settings import SweepSettings
from prefect_ddp.tasks.tracking import Tracking, epoch_metrics, mlflow_session, same_server, sign
from tests.support.image_folders import local_image_folder
from tests.support.mlflow_auth_front import mlflow_auth_front

NAME = "tracked-shapes"
EXPERIMENT = "test-tracking"
SECRET = "mlflow-secret-never-shown"


def train(dask_cluster, output: Path, name: str, tracking_block: str, **changes):
    recipe = {"epochs": 2, "batch_size": 4, "image_size": 32, "num_workers": 0, "lr": 0.01} | changes.pop("training", {})
    state = transfer_learning(
        data=DataConfig(block="test-images", val_fraction=0.3, seed=5, index_cache_minutes=0),
        model=ModelConfig(backbone="resnet18", **changes.pop("model", {})),
        training=TrainingConfig(**recipe),
        cluster=ClusterConfig(address=dask_cluster.scheduler_address, init_timeout_s=60),
        output=OutputConfig(url=str(output), model_name=name),
        tracking=TrackingConfig(block=tracking_block, experiment=EXPERIMENT),
        return_state=True,
    )
    return state.result(), str(state.state_details.flow_run_id)


@pytest.fixture(scope="module")
def tracked(guarded, mlflow_uri):
    """One tracked run, kept and registered under NAME (through the front: `guarded`), and a client
    that reads the server directly."""
    output, result, _ = guarded
    return MlflowClient(mlflow_uri), output, result


@pytest.fixture(scope="module")
def candidate(tracked, mlflow_uri):
    """A second MLflow run with a real logged model (the tracked run's weights), to promote by hand."""
    _, _, (summary, _) = tracked
    folder = Location(url=str(Path(summary["files"]["model.pt"]).parent))
    run = start_run(Tracking(tracking_uri=mlflow_uri, experiment=EXPERIMENT), "candidate", {}, {})
    return summary, folder, log_model(run, folder)


def promote_as(name: str, candidate_folder: Location, tmp_path: Path, summary: dict, metric: float, logged,
               kept: Location):
    """Promote a copy of the candidate's run folder, named `name`, with `metric` as its val accuracy."""
    folder = tmp_path / name
    shutil.copytree(candidate_folder.url, folder)
    registry = Registration(tracking=logged.tracking, name=kept.url.rsplit("/", 1)[-1], model=logged)
    candidate = TrainingSummary.model_validate(summary | {"best_val_acc": metric})
    return promote.fn(candidate, Location(url=str(folder)), kept, {"name": name, "flow_run_id": name}, registry)


def run_of(client: MlflowClient, flow_run_id: str):
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    assert len(runs) == 1, f"expected one MLflow run for flow run {flow_run_id}, found {len(runs)}"
    return runs[0]


def test_a_tracked_run_holds_its_params_epochs_files_and_model(tracked, mlflow_uri):
    client, _, (summary, flow_run_id) = tracked
    run = run_of(client, flow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["training.epochs"] == "2" and run.data.params["model.backbone"] == "resnet18"
    assert run.data.params["data.block"] == "test-images"
    assert run.data.tags["prefect.flow_run_url"].endswith(flow_run_id)
    for metric in ("val_acc", "train_loss", "images_per_s", "share_data"):
        history = client.get_metric_history(run.info.run_id, metric)
        assert sorted(m.step for m in history) == [1, 2], metric
    val_acc = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_acc")}
    assert val_acc == {h["epoch"]: pytest.approx(h["val_acc"]) for h in summary["history"]}
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= set(RUN_FILES)
    assert summary["promotion"]["promoted"] and summary["promotion"]["registered"]["version"] == "1"
    champion = client.get_model_version_by_alias(NAME, ALIAS)
    assert champion.version == "1" and champion.run_id == run.info.run_id
    assert run.data.tags["promoted"] == "true" and run.data.tags["registered_version"] == "1"
    # The logged model documents the preprocessing its card records, which validation used.
    card = json.loads((Path(summary["files"]["model.pt"]).parent / "model.json").read_text())
    with mlflow_session(Tracking(tracking_uri=mlflow_uri, experiment=EXPERIMENT)):
        import mlflow

        assert mlflow.models.get_model_info(f"models:/{NAME}/1").metadata["preprocessing"] == preprocessing(card)


def test_a_worse_candidate_leaves_the_champion_where_it_was(tracked, candidate, tmp_path):
    client, output, (summary, _) = tracked
    _, folder, logged = candidate
    kept = kept_location(Location(url=str(output)), NAME)
    promotion = promote_as("worse", folder, tmp_path, summary, summary["best_val_acc"] - 0.1, logged, kept)
    assert not promotion.promoted and promotion.registered is None
    assert client.get_model_version_by_alias(NAME, ALIAS).version == "1"
    assert [v.version for v in client.search_model_versions(f"name = '{NAME}'")] == ["1"]


def promote_in_process(results, barrier, who: str, *args) -> None:
    """One of two processes promoting at the same moment (a forked process's target)."""
    barrier.wait()
    results.put((who, promote_as(*args).model_dump()))


@pytest.mark.parametrize("rounds", [3])
def test_candidates_promoting_at_once_leave_the_champion_on_the_better_one(tracked, candidate, tmp_path, rounds):
    """Separate processes, as two flow runs would be: nothing in-process serialises them."""
    client, output, _ = tracked
    summary, folder, logged = candidate
    context = multiprocessing.get_context("fork")
    for round_ in range(rounds):
        name = f"race-{round_}"
        kept = kept_location(Location(url=str(output)), name)
        queue, barrier = context.Queue(), context.Barrier(2)
        processes = [context.Process(target=promote_in_process, args=(
            queue, barrier, who, f"{who}-{round_}", folder, tmp_path, summary, metric, logged, kept))
            for who, metric in (("better", 0.95), ("worse", 0.60))]
        for process in processes:
            process.start()
        results = {who: Promotion.model_validate(promotion) for who, promotion in (queue.get(timeout=120),
                                                                                    queue.get(timeout=120))}
        for process in processes:
            process.join(30)
        pointer = read_pointer(kept)
        assert pointer["run"]["name"] == f"better-{round_}"
        champion = client.get_model_version_by_alias(name, ALIAS)
        assert champion.version == pointer["registered"]["version"] == results["better"].registered["version"]
        # The worse one either was kept first and then beaten (its version stays, as its folder
        # does, as history) or lost the swap (its version deleted: nothing pointed at it).
        worse = results["worse"]
        versions = {v.version for v in client.search_model_versions(f"name = '{name}'")}
        assert versions == {champion.version} | ({worse.registered["version"]} if worse.promoted else set())
        assert worse.promoted or worse.registered is None


def test_warm_start_from_the_champion_reads_its_weights_through_the_registry(tracked, dask_cluster):
    _, output, (good, _) = tracked
    summary, _ = train(dask_cluster, output, "warm-from-registry", "test-mlflow",
                       model={"warm_start": f"models:/{NAME}@{ALIAS}"}, training={"epochs": 1, "lr": 1e-7})
    run_folder = Path(summary["files"]["model.pt"]).parent
    copied = (run_folder / "warm-start" / "model.pt").read_bytes()
    kept = Path(good["files"]["model.pt"]).read_bytes()
    assert hashlib.sha256(copied).digest() == hashlib.sha256(kept).digest()
    assert f"registered model `models:/{NAME}@{ALIAS}`" in (run_folder / "report.md").read_text()


def test_the_password_is_in_no_param_tag_or_artifact(tracked):
    client, _, (_, flow_run_id) = tracked
    run = run_of(client, flow_run_id)
    assert SECRET not in repr(run.data.params) + repr(run.data.tags)
    for artifact in client.list_artifacts(run.info.run_id):
        if not artifact.is_dir:
            assert SECRET not in Path(client.download_artifacts(run.info.run_id, artifact.path)).read_text(
                errors="replace")


def test_a_tracked_sweep_is_a_parent_run_with_a_child_run_per_trial_the_pruned_one_marked_its_best_champion(
        mlflow_uri, dask_cluster, tmp_path):
    MlflowTracking(tracking_uri=mlflow_uri).save("test-mlflow-sweep", overwrite=True)
    images = tmp_path / "images"
    local_image_folder(images, per_class=6)
    good, bad = 0.001, 8.0  # lr 8 with SGD diverges: the median pruner stops it at epoch 1
    state = hyperparameter_sweep(
        space={"training.lr": {"kind": "choice", "values": [good, bad]}},
        settings=SweepSettings(name="tracked-sweep", n_trials=2, concurrency=1, metric="val_loss",
                               direction="minimize", sampler="random", pruner="median", startup_trials=1,
                               first_trials=[{"training.lr": lr} for lr in (good, bad)], promote=True),
        data=DataConfig(url=str(images), index_cache_minutes=0),
        model=ModelConfig(backbone="mobilenet_v3_small"),
        training=TrainingConfig(epochs=2, batch_size=4, image_size=32, num_workers=0, scheduler="none"),
        cluster=ClusterConfig(address=dask_cluster.scheduler_address, init_timeout_s=60),
        output=OutputConfig(url=str(tmp_path / "out"), model_name="swept"),
        tracking=TrackingConfig(block="test-mlflow-sweep", experiment="test-tracked-sweep"),
        return_state=True,
    )
    record = state.result()
    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("test-tracked-sweep").experiment_id
    (parent,) = client.search_runs([experiment], "tags.best_trial != ''")
    assert parent.data.tags["best_trial"] == str(record["best"]["trial"]) == "0"
    assert parent.data.params["space.training.lr.kind"] == "choice"
    assert "sweep.json" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    by_lr = {run.data.params["training.lr"]: run for run in children}
    assert sorted(by_lr) == [str(good), str(bad)]
    assert by_lr[str(bad)].data.tags.get("pruned") == "1" and "pruned" not in by_lr[str(good)].data.tags
    assert all(run.info.status == "FINISHED" for run in children)
    # The sweep promoted its best trial, and the registry agrees: champion is that trial's model.
    champion = client.get_model_version_by_alias("swept", ALIAS)
    assert record["promotion"]["promoted"] and champion.version == record["promotion"]["registered"]["version"]
    assert champion.run_id == by_lr[str(good)].info.run_id


@pytest.mark.unit
def test_epoch_metrics_are_the_numbers_and_the_time_shares():
    record = {"epoch": 3, "val_acc": 0.5, "train_samples": 10, "lr": 0.01, "unreadable": ["a.jpg"],
              "time": {"images_per_s": 80.0, "shares": {"data": 0.6, "sync": 0.1}, "verdict": "input-bound"}}
    assert epoch_metrics(record) == {"val_acc": 0.5, "train_samples": 10.0, "lr": 0.01, "images_per_s": 80.0,
                                     "share_data": 0.6, "share_sync": 0.1}


@pytest.mark.unit
def test_warm_start_takes_true_false_or_a_registered_model_and_that_needs_a_tracking_block():
    assert ModelConfig.model_validate({"warm_start": "true"}).warm_start is True  # as the CLI sends it
    assert ModelConfig(warm_start="models:/cats/3").warm_start_uri() == "models:/cats/3"
    with pytest.raises(ValueError, match=r"model.warm_start='s3://b/m.pt' is neither true/false nor a registered "
                                         r"model's URI; use models:/NAME@ALIAS"):
        ModelConfig(warm_start="s3://b/m.pt")
    with pytest.raises(ValueError, match=r"names a registered model, but tracking.block is empty.*Set tracking.block"):
        require_registry(ModelConfig(warm_start="models:/cats@champion"), None)
    require_registry(ModelConfig(warm_start=True), None)


def test_a_retried_promote_finds_the_version_it_registered_rather_than_registering_another(tracked, candidate,
                                                                                          tmp_path):
    client, output, _ = tracked
    summary, folder, logged = candidate
    kept = kept_location(Location(url=str(output)), "retried")
    run_folder = tmp_path / "retried-run"
    shutil.copytree(folder.url, run_folder)
    registry = Registration(tracking=logged.tracking, name="retried", model=logged)
    args = (TrainingSummary.model_validate(summary), Location(url=str(run_folder)), kept,
            {"name": "retried-run", "flow_run_id": "retried-run"}, registry)
    lock = Path(kept.url) / "latest.json.lock"
    lock.mkdir(parents=True)  # the pointer's lock cannot be opened: the attempt fails after registering
    with pytest.raises(IsADirectoryError):
        promote.fn(*args)
    lock.rmdir()
    promotion = promote.fn(*args)  # what Prefect's retry of the task runs
    assert [v.version for v in client.search_model_versions("name = 'retried'")] == ["1"]
    assert promotion.promoted and promotion.registered["version"] == promotion.champion == "1"


@pytest.fixture(scope="module")
def front(mlflow_uri):
    """The session's mlflow server behind a front that demands user `trainer`'s password."""
    with mlflow_auth_front(mlflow_uri, "trainer", SECRET) as front:
        MlflowTracking(tracking_uri=front.uri, username="trainer", password=SECRET).save(
            "test-mlflow", overwrite=True)
        yield front


def test_a_session_signs_each_request_and_a_child_started_meanwhile_inherits_no_password(front):
    with mlflow_session(Tracking(tracking_uri=front.uri, username="trainer", password=SECRET)) as client:
        client.search_experiments()
        child = subprocess.run([sys.executable, "-c", "import os; print(dict(os.environ))"],
                               capture_output=True, text=True, check=True)
    assert SECRET not in child.stdout
    assert front.seen and front.unauthorized == []


@pytest.fixture(scope="module")
def guarded(front, image_location, dask_cluster, tmp_path_factory):
    """The tracked run (kept and registered under NAME) through the front (every call must carry the
    password), while a thread records whether this process's environment ever held the password."""
    image_location.save("test-images", overwrite=True)
    held, done = [], threading.Event()

    def watch() -> None:
        while not done.wait(0.002):
            if any(SECRET in value for value in list(os.environ.values())):
                held.append(True)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    output = tmp_path_factory.mktemp("tracked")
    try:
        result = train(dask_cluster, output, NAME, "test-mlflow")
    finally:
        done.set()
        watcher.join(10)
    return output, result, held


def test_a_run_tracked_on_a_server_that_demands_a_password_sends_it_with_every_request_never_through_the_environment(
        guarded, front, mlflow_uri):
    _, (summary, flow_run_id), held = guarded
    assert front.unauthorized == [] and held == []
    client = MlflowClient(mlflow_uri)
    run = run_of(client, flow_run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_acc")] == [1, 2]  # rank 0, on a worker
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= set(RUN_FILES)
    assert summary["promotion"]["champion"] == summary["promotion"]["registered"]["version"] == "1"
    assert client.get_model_version_by_alias(NAME, ALIAS).run_id == run.info.run_id


def promote_through(front_tracking: Tracking, logged, candidate_folder: Location, tmp_path: Path, summary: dict,
                    metric: float, kept: Location, name: str) -> Promotion:
    """promote_as, with the registry reached through the front as `front_tracking`."""
    return promote_as(name, candidate_folder, tmp_path, summary, metric,
                      logged.model_copy(update={"tracking": front_tracking}), kept)


def kept_and_front(guarded, front) -> tuple[Location, Tracking]:
    """The tracked run's kept model, and the registry reached through the front as `trainer`."""
    output, _, _ = guarded
    return kept_location(Location(url=str(output)), NAME), Tracking(tracking_uri=front.uri, username="trainer",
                                                                     password=SECRET)


def test_an_alias_move_refused_after_registering_is_reported_then_repaired_by_the_next_promotion(
        guarded, candidate, front, tmp_path, mlflow_uri, caplog):
    summary, folder, logged = candidate
    kept, through = kept_and_front(guarded, front)
    client = MlflowClient(mlflow_uri)
    before = client.get_model_version_by_alias(NAME, ALIAS).version
    front.deny("POST", "/registered-models/alias")  # this user registers, but may not move aliases
    try:
        with caplog.at_level(logging.WARNING):
            better = promote_through(through, logged, folder, tmp_path, summary, 0.99, kept, "better-denied")
    finally:
        front.allow_all()
    new = better.registered["version"]
    assert front.denied and better.promoted and new != before
    assert better.champion == before == client.get_model_version_by_alias(NAME, ALIAS).version
    assert re.search(rf"alias 'champion' of '{NAME}' names version {before}, but latest.json names version "
                     rf"{new} \(RestException: PERMISSION_DENIED", better.registry_disagrees)
    assert "MLflow registry: the registry's alias 'champion'" in caplog.text
    worse = promote_through(through, logged, folder, tmp_path, summary, 0.10, kept, "worse-after")
    assert not worse.promoted and worse.champion == new and worse.registry_disagrees is None
    assert client.get_model_version_by_alias(NAME, ALIAS).version == read_pointer(kept)["registered"]["version"]


def test_batch_predict_refuses_a_champion_it_cannot_move_to_the_kept_model_and_moves_it_when_it_can(
        guarded, candidate, front, tmp_path, mlflow_uri, dask_cluster):
    summary, folder, logged = candidate
    kept, through = kept_and_front(guarded, front)
    spec = f"models:/{NAME}@{ALIAS}"
    front.deny("POST", "/registered-models/alias")
    try:
        best = promote_through(through, logged, folder, tmp_path, summary, 1.0, kept, "best-denied")
        assert best.registry_disagrees and best.champion != best.registered["version"]
        with pytest.raises(ValueError, match=r"names version \d+, but latest.json names version \d+.*Give "
                                             rf"model=.*{NAME}/latest \(the kept model itself\)"):
            batch_predict(model=spec, data_block="test-images", output_url=str(tmp_path / "refused"),
                          cluster=ClusterConfig(address=dask_cluster.scheduler_address),
                          tracking_block="test-mlflow")
    finally:
        front.allow_all()
    result = batch_predict(model=spec, data_block="test-images", output_url=str(tmp_path / "scored"),
                           cluster=ClusterConfig(address=dask_cluster.scheduler_address),
                           tracking_block="test-mlflow")
    copy = Path(result["files"]["model"])
    source = json.loads((copy / "source.json").read_text())
    assert source["registry"]["was"] == best.champion and source["registry"]["now"] == best.registered["version"]
    assert MlflowClient(mlflow_uri).get_model_version_by_alias(NAME, ALIAS).version == best.registered["version"]
    assert (copy / "model.pt").read_bytes() == (Path(read_pointer(kept)["version"]) / "model.pt").read_bytes()
    assert front.unauthorized == []


@pytest.mark.unit
@pytest.mark.parametrize("uri", ["https://trainer:hunter2-secret@mlflow.internal", "https://hunter2-secret@mlflow.internal:5000/x"])
@pytest.mark.parametrize("model", [Tracking, MlflowTracking])
def test_credentials_in_the_tracking_uri_are_refused_naming_the_fields_they_belong_in(uri, model):
    with pytest.raises(ValueError, match=r"holds credentials.*username and password fields.*token field") as refused:
        model(tracking_uri=uri)
    assert "hunter2-secret" not in str(refused.value) and "***@mlflow.internal" in str(refused.value)
    assert model(tracking_uri="https://mlflow.internal", username="trainer", password="hunter2-secret")


def test_a_reader_that_spells_the_server_otherwise_or_cannot_read_the_pointer_never_removes_the_champion(
        tracked, front, mlflow_uri, tmp_path):
    """batch-predict checks the alias against latest.json; it removed `champion` for everyone where it
    read the server's URI spelled otherwise, or could not read latest.json (scoring away from the output)."""
    client, output, _ = tracked
    store, spec = Location(url=str(output)), f"models:/{NAME}@{ALIAS}"
    champion = client.get_model_version_by_alias(NAME, ALIAS).version
    spelled = "HTTP" + front.uri.removeprefix("http") + "/"  # the server the run registered on, spelled otherwise
    check = check_champion(spec, store, Tracking(tracking_uri=spelled, username="trainer", password=SECRET))
    assert check["agrees"] and check["now"] == champion  # one server, however spelled
    pointer = client.get_registered_model(NAME).tags[POINTER_TAG]
    client.set_registered_model_tag(NAME, POINTER_TAG, str(tmp_path / "training-host" / NAME / "latest.json"))
    try:
        check = check_champion(spec, store, Tracking(tracking_uri=mlflow_uri))
    finally:
        client.set_registered_model_tag(NAME, POINTER_TAG, pointer)
    assert not check["agrees"] and "no latest.json here" in check["unchecked"]
    assert check["now"] == champion == client.get_model_version_by_alias(NAME, ALIAS).version  # read, and left


@pytest.mark.unit
def test_a_session_signs_requests_to_its_server_however_its_uri_is_spelled_and_to_no_other():
    tracking = Tracking(tracking_uri="HTTP://LocalHost:5000/", username="trainer", password=SECRET)
    assert tracking.serves("http://localhost:5000/api/2.0/mlflow/runs/get")  # as requests sends it
    assert not tracking.serves("http://localhost:50001/api") and not tracking.serves("http://otherhost:5000/api")
    assert Tracking(tracking_uri="https://mlflow.example").serves("https://MLflow.example:443/api")
    assert same_server("http://127.0.0.1:5000", "HTTP://127.0.0.1:5000/") and not same_server("http://a:5000", "http://a:5001")


@pytest.mark.unit
def test_a_users_own_mlflow_auth_provider_still_signs_every_request_inside_a_session(monkeypatch):
    from mlflow.tracking.request_auth.abstract_request_auth_provider import RequestAuthProvider
    from mlflow.tracking.request_auth.registry import _request_auth_provider_registry as registry

    class SingleSignOn(RequestAuthProvider):
        def get_name(self) -> str:
            return "test-single-sign-on"

        def get_auth(self):
            def add(request):
                request.headers["X-Sso"] = "signed"
                return request
            return add

    registry.register(SingleSignOn)
    monkeypatch.setenv("MLFLOW_TRACKING_AUTH", "test-single-sign-on")
    with mlflow_session(Tracking(tracking_uri="http://127.0.0.1:9", username="trainer", password=SECRET)):
        ours = sign(requests.Request("GET", "http://127.0.0.1:9/api/2.0/mlflow/experiments/search").prepare())
        other = sign(requests.Request("GET", "http://elsewhere:5000/api/2.0/mlflow/runs/get").prepare())
    assert ours.headers["X-Sso"] == "signed" and ours.headers["Authorization"].startswith("Basic ")
    assert other.headers["X-Sso"] == "signed" and "Authorization" not in other.headers
    assert os.environ["MLFLOW_TRACKING_AUTH"] == "test-single-sign-on"


@pytest.mark.unit
@pytest.mark.parametrize("provider", ["a-plugin-not-installed", "test-basic-pair"])
def test_an_auth_provider_mlflow_cannot_call_is_left_out_as_mlflow_leaves_it_out(provider, monkeypatch):
    """A leftover or mistyped MLFLOW_TRACKING_AUTH (MLflow warns and sends the request anyway), or a
    provider whose auth is a (user, password) pair, failed every request of a session."""
    from mlflow.tracking.request_auth.abstract_request_auth_provider import RequestAuthProvider
    from mlflow.tracking.request_auth.registry import _request_auth_provider_registry as registry

    class BasicPair(RequestAuthProvider):
        def get_name(self) -> str:
            return "test-basic-pair"

        def get_auth(self):
            return ("sso-user", "sso-pass")

    registry.register(BasicPair)
    monkeypatch.setenv("MLFLOW_TRACKING_AUTH", provider)
    with mlflow_session(Tracking(tracking_uri="http://127.0.0.1:9")):
        signed = sign(requests.Request("GET", "http://127.0.0.1:9/api/2.0/mlflow/experiments/search").prepare())
    pair = "Basic " + base64.b64encode(b"sso-user:sso-pass").decode()
    assert signed.headers.get("Authorization") == (pair if provider == "test-basic-pair" else None)


@pytest.mark.unit
def test_a_reader_told_the_kept_model_has_no_registered_version_is_not_told_to_run_again():
    check = ChampionCheck(name="cats", pointer_version=None, was="3", now="3", kept_unregistered=True,
                          error="the kept model has no registered version")
    assert "latest.json's model has no registered version of 'cats', while the registry's alias 'champion' names " \
           "version 3" in check.disagreement() and "batch-predict run" not in check.disagreement()
    assert why_unchecked(None, Tracking(tracking_uri="http://m:5000")) == "there is no latest.json here to check it against"
    elsewhere = {"registered": {"tracking_uri": "http://other:5000", "version": "2"}}
    assert "registered on http://other:5000" in why_unchecked(elsewhere, Tracking(tracking_uri="http://m:5000"))
