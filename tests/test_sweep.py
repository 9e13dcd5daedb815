"""Sweeps on the session's LocalCluster of 2 workers: trials side by side, pruning, resume."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
)
from prefect_dask import DaskTaskRunner

from prefect_ddp.deployments.local_services import (
    MOTO_CREDENTIALS,
    MOTO_REGION,
    create_bucket,
)
from prefect_ddp.flows.sweep import hyperparameter_sweep
from prefect_ddp.tasks.config import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    OutputConfig,
    TrainingConfig,
)
from prefect_ddp.tasks.sweeps.settings import SweepSettings
from prefect_ddp.tasks.sweeps.sweep import NoTrialTrained, sweep
from tests.support.api_helpers import rank_task_runs
from tests.support.gang_functions import report_every_epoch
from tests.support.image_folders import local_image_folder

pytestmark = pytest.mark.slow
GOOD, BAD = 0.001, 8.0  # lr 8 with SGD diverges: its val loss is the worst at epoch 1


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("sweep-images")
    # Enough images that a trial trains for several seconds, longer than the few seconds by
    # which the second trial of a pair reaches its gang after the first.
    local_image_folder(root, per_class=16)
    return str(root)


def run_sweep(images: str, dask_cluster, output: Path, settings: SweepSettings, kind: str = "choice",
              model_name: str | None = None, epochs: int = 4):
    return hyperparameter_sweep(
        space={"training.lr": {"kind": kind, "values": [GOOD, BAD]}},
        settings=settings,
        data=DataConfig(url=images, index_cache_minutes=0),
        model=ModelConfig(backbone="mobilenet_v3_small"),
        training=TrainingConfig(epochs=epochs, batch_size=4, image_size=32, num_workers=0, optimizer="sgd",
                                scheduler="none"),
        cluster=ClusterConfig(address=dask_cluster.scheduler_address, init_timeout_s=60),
        output=OutputConfig(url=str(output), model_name=model_name),
        return_state=True,
    )


def child_runs(flow_run_id) -> dict:
    with get_client(sync_client=True) as api:
        runs = api.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
    return {run.name.split()[0]: run for run in runs}


def test_trials_train_side_by_side_the_pruned_one_says_so_and_the_sweep_compares_them(images, dask_cluster, tmp_path,
                                                                                      capfd):
    # Two good trials first, so the median pruner has finished trials to judge the bad ones by.
    settings = SweepSettings(
        name="side-by-side", n_trials=4, concurrency=2, metric="val_loss", direction="minimize",
        sampler="random", pruner="median", startup_trials=1,
        first_trials=[{"training.lr": lr} for lr in (GOOD, GOOD, BAD, BAD)],
    )
    state = run_sweep(images, dask_cluster, tmp_path, settings)
    # The relays read their trials' reports without a timeout running out in the scheduler
    # (this session's, in this process), which logs each as an ERROR with its traceback.
    assert "Exception while handling op queue_get" not in capfd.readouterr().err
    record = state.result()
    trials = {row["trial"]: row for row in record["trials"]}
    assert sorted(trials) == [0, 1, 2, 3]
    assert trials[2]["state"] == "pruned at epoch 1" and trials[3]["state"] == "pruned at epoch 1"
    assert record["best"]["params"] == {"training.lr": GOOD} and Path(record["best"]["model_url"]).exists()
    # The best model file holds the weights of the epoch the sweep reports for it.
    card = json.loads((Path(record["best"]["model_url"]).parent / "model.json").read_text())
    assert (card["epoch"], card["selected_by"]) == (record["best"]["best_epoch"], "lowest val_loss")

    # Side by side: the sweep started the second trial before the first had finished. (Not
    # asserted on the child flow runs' times: the Prefect server took 2-8 s to create the
    # second run while the first trained, and a trial trains here in about as long.)
    study = optuna.load_study(study_name="side-by-side", storage=f"sqlite:///{tmp_path / 'side-by-side' / 'study.db'}")
    first_trial, second_trial = study.trials[0], study.trials[1]
    assert second_trial.datetime_start < first_trial.datetime_complete, (first_trial, second_trial)
    runs = child_runs(state.state_details.flow_run_id)
    first, second = runs["trial-0"], runs["trial-1"]
    windows = {name: (str(run.start_time), str(run.end_time)) for name, run in runs.items()}
    # Ranks that trained at the same time did so on workers of their own.
    (rank_0,), (rank_1,) = (rank_task_runs(run.id, expected=1) for run in (first, second))
    if rank_0.start_time < rank_1.end_time and rank_1.start_time < rank_0.end_time:
        assert trials[0]["workers"] != trials[1]["workers"], windows
    assert runs["trial-2"].state.name == "Pruned" and runs["trial-2"].state.message == "pruned at epoch 1"

    folder = tmp_path / "side-by-side"
    assert json.loads((folder / "sweep.json").read_text())["best"]["trial"] == record["best"]["trial"]
    assert (folder / "curves.png").stat().st_size > 10_000 and (folder / "study.db").exists()
    with get_client(sync_client=True) as api:
        artifacts = api.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    comparison = next(a for a in artifacts if a.key == "sweep-comparison").data
    assert "| trial | parameters | best epoch | val_loss | seconds | state | run |" in comparison
    assert "pruned at epoch 1" in comparison and "![val_loss per epoch and against wall time](data:image/png;base64," in comparison


def test_a_sweep_run_again_under_its_name_trains_only_the_trials_left(images, dask_cluster, tmp_path):
    # One epoch a trial: which trials train is decided per trial, not per epoch (no pruner here).
    settings = SweepSettings(name="resumed", n_trials=2, concurrency=2, sampler="grid", pruner="none",
                             metric="val_acc")
    first = run_sweep(images, dask_cluster, tmp_path, settings, kind="grid", epochs=1)
    assert len(first.result()["trials"]) == 2 and len(child_runs(first.state_details.flow_run_id)) == 2
    # The grid has two points: asking for 3 trials of it trains nothing more.
    again = run_sweep(images, dask_cluster, tmp_path, settings.model_copy(update={"n_trials": 3}), kind="grid",
                      epochs=1)
    assert len(again.result()["trials"]) == 2 and child_runs(again.state_details.flow_run_id) == {}
    more = run_sweep(images, dask_cluster, tmp_path,
                     settings.model_copy(update={"n_trials": 3, "sampler": "random"}), epochs=1)
    assert len(more.result()["trials"]) == 3 and list(child_runs(more.state_details.flow_run_id)) == ["trial-2"]


def test_trials_never_promote_and_the_sweep_promotes_its_best_trial_once_at_its_end(images, dask_cluster, tmp_path):
    """Trials share the sweep's model name (a deployment's, or output.model_name): before, each
    promoted on its own, all at once, into the one kept model."""
    settings = SweepSettings(name="promoting", n_trials=2, concurrency=2, sampler="grid", pruner="none",
                             metric="val_loss", direction="minimize", promote=True)
    # One epoch a trial: the promotion happens once, at the sweep's end, however many epochs trained.
    state = run_sweep(images, dask_cluster, tmp_path, settings, kind="grid", model_name="swept", epochs=1)
    record = state.result()
    for trial in record["trials"]:  # neither trial promoted, and each report says why
        report = (Path(trial["model_url"]).parent / "report.md").read_text()
        assert "Not promoted: a sweep's trials never promote on their own" in report
    best_run = Path(record["best"]["model_url"]).parent
    promotion = record["promotion"]
    assert promotion["promoted"] and promotion["kept_url"] == str(tmp_path / "swept" / "versions" / best_run.name)
    pointer = json.loads((tmp_path / "swept" / "latest.json").read_text())
    assert pointer["version"] == promotion["kept_url"] and pointer["run"]["name"] == record["best"]["run"]
    assert [p.name for p in (tmp_path / "swept" / "versions").iterdir()] == [best_run.name]  # one promotion
    assert (Path(pointer["version"]) / "model.pt").read_bytes() == (best_run / "model.pt").read_bytes()


def test_a_sweep_none_of_whose_trials_trained_fails_naming_their_errors(images, dask_cluster, tmp_path):
    """It ended Completed, its report the only sign that nothing trained (issue 29)."""
    state = hyperparameter_sweep(
        # Each names a folder with no images, which only a trial's listing finds (a value its parameter
        # refuses, such as batch_size=0, is refused before any trial: tests/test_backbones.py).
        space={"data.url": {"kind": "grid", "values": [str(tmp_path / "gone-a"), str(tmp_path / "gone-b")]}},
        settings=SweepSettings(name="none-trained", n_trials=2, concurrency=2, sampler="grid", pruner="none"),
        data=DataConfig(url=images, index_cache_minutes=0),
        cluster=ClusterConfig(address=dask_cluster.scheduler_address),
        output=OutputConfig(url=str(tmp_path)),
        return_state=True,
    )
    assert state.is_failed()
    with pytest.raises(NoTrialTrained, match=r"(?s)Sweep 'none-trained': none of its 2 trial\(s\) trained.*"
                       r"trial 0: .*gone-.* is empty or does not exist.*; trial 1: .*gone-.* is empty or does not exist"):
        state.result()
    assert (tmp_path / "none-trained" / "sweep.json").exists()  # the report, with each trial's error, came first
    assert len(child_runs(state.state_details.flow_run_id)) == 2


def test_a_sweep_whose_trials_all_failed_trains_them_when_run_again_after_the_fix(dask_cluster, tmp_path):
    """Run again after its function was fixed, it said "0 trial(s) to train" and ended Completed with
    `best: None` (issue 57): failed trials counted as finished."""
    settings = SweepSettings(name="fixed", n_trials=2, concurrency=2, metric="loss", direction="minimize",
                             sampler="random", pruner="none")
    broken = custom_sweep(dask_cluster.scheduler_address, str(tmp_path), settings, broken=True, return_state=True)
    with pytest.raises(NoTrialTrained, match=r"none of its 2 trial\(s\) trained.*'ellipsis'.*run it again under "
                       r"the same settings.name: it trains the failed trials again"):
        broken.result()
    record = custom_sweep(dask_cluster.scheduler_address, str(tmp_path), settings)
    trials = {row["trial"]: row for row in record["trials"]}
    assert sorted(trials) == [0, 1, 2, 3]
    for number in (0, 1):  # the failures stay in the study and the report, marked as queued again
        assert trials[number]["state"].startswith("failed: GangError") and "'ellipsis'" in trials[number]["state"]
        assert trials[number]["state"].endswith("(its parameters queued again by a later run)")
    assert [trials[n]["state"] for n in (2, 3)] == ["completed", "completed"]
    assert {trials[2]["params"]["lr"], trials[3]["params"]["lr"]} == {trials[0]["params"]["lr"], trials[1]["params"]["lr"]}
    assert record["best"]["trial"] in (2, 3)
    again = custom_sweep(dask_cluster.scheduler_address, str(tmp_path), settings)  # nothing left to train
    assert [row["trial"] for row in again["trials"]] == [row["trial"] for row in record["trials"]]


def test_promoting_needs_a_name_to_keep_the_model_under(images, dask_cluster, tmp_path):
    state = run_sweep(images, dask_cluster, tmp_path, SweepSettings(name="nameless", promote=True))
    with pytest.raises(ValueError, match=r"settings.promote=true keeps the best trial's model under "
                       r"output.model_name or the deployment's name.*Set output.model_name"):
        state.result()
    assert child_runs(state.state_details.flow_run_id) == {}  # refused before any trial


@flow(name="custom-sweep")
def custom_sweep(address: str, output: str, settings: SweepSettings, keep_losses: bool = True,
                 fail_first_attempt: bool = False, broken: bool = False) -> dict:
    with DaskTaskRunner(address=address) as runner:
        return sweep(report_every_epoch, {"lr": 1.0, "epochs": 4, "keep_losses": keep_losses,
                                          "fail_first_attempt": fail_first_attempt, "broken": broken},
                     {"lr": {"kind": "log_uniform", "low": 0.01, "high": 10.0}},
                     settings, task_runner=runner, output=output)


def test_a_sweep_to_an_s3_output_writes_its_report_there_and_keeps_its_study_on_this_host(
    dask_cluster, tmp_path, s3_endpoint, s3_fs, monkeypatch,
):
    """`sweep(output="s3://...")` once wrote a local folder ./s3:/... instead."""
    create_bucket(s3_endpoint, "sweeps")
    for name, value in {"AWS_ACCESS_KEY_ID": MOTO_CREDENTIALS["aws_access_key_id"], "AWS_ENDPOINT_URL": s3_endpoint,
                        "AWS_SECRET_ACCESS_KEY": MOTO_CREDENTIALS["aws_secret_access_key"],
                        "AWS_DEFAULT_REGION": MOTO_REGION, "PREFECT_DDP_STUDY_DIR": str(tmp_path / "studies")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    settings = SweepSettings(name="on-s3", n_trials=2, concurrency=1, metric="loss", direction="minimize",
                             sampler="random", pruner="none")
    record = custom_sweep(dask_cluster.scheduler_address, "s3://sweeps/runs", settings, keep_losses=False)
    assert [row["state"] for row in record["trials"]] == ["completed", "completed"]
    assert json.loads(s3_fs.cat_file("sweeps/runs/on-s3/sweep.json"))["best"]["trial"] == record["best"]["trial"]
    assert s3_fs.exists("sweeps/runs/on-s3/curves.png") and s3_fs.exists("sweeps/runs/on-s3/report.md")
    assert not (tmp_path / "s3:").exists()
    (study,) = (tmp_path / "studies").rglob("study.db")
    assert study.parent.name == "on-s3" and study.parent.stat().st_mode & 0o777 == 0o700


def test_a_trial_s_gang_is_formed_again_after_a_failure_as_the_flows_are(dask_cluster, tmp_path):
    # An elastic trial (min_ranks_per_trial) goes on on its survivors only if its gang may be formed again.
    settings = SweepSettings(name="again", n_trials=1, concurrency=1, ranks_per_trial=2, min_ranks_per_trial=1,
                             metric="loss", direction="minimize", sampler="random", pruner="none")
    record = custom_sweep(dask_cluster.scheduler_address, str(tmp_path), settings, fail_first_attempt=True)
    assert [row["state"] for row in record["trials"]] == ["completed"], record["trials"]


def test_any_trainable_sweeps_and_a_pruned_two_rank_trial_stops_on_both_ranks(dask_cluster, tmp_path):
    # Trial 1's lr is tiny, so its loss stays high: the median pruner stops it at epoch 1,
    # and both of its ranks must learn it or the next all-reduce would wait forever.
    settings = SweepSettings(name="custom", n_trials=2, concurrency=1, ranks_per_trial=2, metric="loss",
                             direction="minimize", sampler="random", pruner="median", startup_trials=1,
                             first_trials=[{"lr": 5.0}, {"lr": 0.01}])
    record = custom_sweep(dask_cluster.scheduler_address, str(tmp_path), settings)
    trials = {row["trial"]: row for row in record["trials"]}
    assert trials[0]["state"] == "completed" and [p["epoch"] for p in trials[0]["curve"]] == [1, 2, 3, 4]
    assert trials[1]["state"] == "pruned at epoch 1" and len(trials[1]["curve"]) == 1
    assert record["best"]["params"] == {"lr": 5.0}
    assert (tmp_path / "custom" / "sweep.json").exists()
    assert record["best"]["model_url"] == str(tmp_path / "custom" / "trial-0" / "losses.json")
