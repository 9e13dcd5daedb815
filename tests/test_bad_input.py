"""Bad parameters and run folders: each run stops early with the cause and the fix, and
nothing earlier runs wrote is lost or overwritten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.results.run_folder import OutputNotWritable
from tests.support.api_helpers import assert_no_task_run_left_running
from tests.support.flow_runs import assert_failed_cleanly, run_tiny_flow, snapshot


@pytest.fixture(scope="module")
def earlier_run(image_location: DataLocation, dask_cluster, tmp_path_factory):
    """An output prefix where one run already finished, and a snapshot of its files."""
    image_location.save("test-images", overwrite=True)
    output = tmp_path_factory.mktemp("outputs")
    state = run_tiny_flow(output, {"address": dask_cluster.scheduler_address}, flow_run_name="same-name")
    summary = state.result()
    return output, Path(summary["files"]["model.pt"]).parent, snapshot(output)


def test_two_runs_of_one_name_get_their_own_folders_and_both_train(earlier_run, dask_cluster):
    output, first_dir, before = earlier_run
    state = run_tiny_flow(output, {"address": dask_cluster.scheduler_address}, flow_run_name="same-name")
    second_dir = Path(state.result()["files"]["model.pt"]).parent
    assert second_dir != first_dir and second_dir.name.startswith("same-name-")
    attempts = json.loads((second_dir / "checkpoints" / "attempts.json").read_text())
    assert [{key: a[key] for key in ("attempt", "world_size", "resumed_after_epoch", "at_sample")} for a in attempts] == [
        {"attempt": 1, "world_size": 1, "resumed_after_epoch": 0, "at_sample": 0}]  # trained, not "resumed"
    assert state.result()["history"][0]["train_samples"] > 0
    assert {k: v for k, v in snapshot(output).items() if k in before} == before
    run_record = json.loads((second_dir / "run.json").read_text())
    assert run_record["flow_run_id"] == str(state.state_details.flow_run_id)


def test_an_output_that_cannot_be_written_fails_before_any_data_is_checked(image_location, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    state = run_tiny_flow(blocker / "outputs", {"address": "tcp://127.0.0.1:1"})
    assert_failed_cleanly(state, OutputNotWritable, r"Cannot write to the output location .*a-file/outputs/.*"
                                                    r"NotADirectoryError.*Check output.url")


def test_an_unreachable_cluster_address_is_named_at_once(earlier_run):
    output, _, before = earlier_run
    state = run_tiny_flow(output, {"address": "tcp://127.0.0.1:1"})
    assert_failed_cleanly(state, ConnectionError, r"Cannot reach the Dask scheduler at tcp://127.0.0.1:1 .*"
                                                  r"Check cluster.address")
    assert {k: v for k, v in snapshot(output).items() if k in before} == before


def test_an_unknown_cluster_block_names_itself(earlier_run):
    output, _, before = earlier_run
    state = run_tiny_flow(output, {"block": "no-such-cluster"})
    assert_failed_cleanly(state, ValueError, "No dask-cluster block named 'no-such-cluster'.*DaskCluster")


def test_missing_starting_weights_fail_before_any_data_is_checked(earlier_run, tmp_path):
    output, _, before = earlier_run
    state = run_tiny_flow(output, {"address": "tcp://127.0.0.1:1"}, model={"weights": str(tmp_path / "gone.pt")})
    assert_failed_cleanly(state, FileNotFoundError, r"model.weights points at .*gone.pt, which does not exist")


def test_weights_of_another_backbone_are_refused_before_training(earlier_run, tmp_path):
    output, _, before = earlier_run
    weights = tmp_path / "resnet18.pt"
    torch.save(torchvision.models.resnet18().state_dict(), weights)
    state = run_tiny_flow(output, {"address": "tcp://127.0.0.1:1"}, model={"weights": str(weights)})
    assert_failed_cleanly(state, ValueError, r"does not fit this backbone: .* missing keys")
    assert {k: v for k, v in snapshot(output).items() if k in before} == before


def test_an_unknown_torchvision_weights_name_lists_the_allowed_ones(earlier_run):
    output, _, _ = earlier_run
    state = run_tiny_flow(output, {"address": "tcp://127.0.0.1:1"}, model={"weights": "IMAGENET9K"})
    assert_failed_cleanly(state, ValueError, r"Unknown weights 'IMAGENET9K' for mobilenet_v3_small: use one of")


def test_an_image_side_the_backbone_cannot_take_fails_before_the_cluster_is_reached(earlier_run):
    output, _, before = earlier_run
    state = run_tiny_flow(output, {"address": "tcp://127.0.0.1:1"}, model={"backbone": "maxvit_t"})
    assert_failed_cleanly(state, ValueError, r"model.backbone='maxvit_t' cannot take training.image_size=\d+ "
                                             r"\(ValueError: Input size .* it takes 224, 448: set training.image_size")
    assert {k: v for k, v in snapshot(output).items() if k in before} == before


def test_a_batch_larger_than_the_training_set_still_trains(earlier_run, dask_cluster):
    output, _, _ = earlier_run
    state = run_tiny_flow(output, {"address": dask_cluster.scheduler_address}, training={"batch_size": 256})
    summary = state.result()
    assert summary["history"][0]["train_samples"] == summary["train_size"]  # one batch of all of them
    assert_no_task_run_left_running(state.state_details.flow_run_id)


def test_a_world_size_above_the_workers_fails_before_any_image_is_decoded(earlier_run, dask_cluster):
    output, _, before = earlier_run
    state = run_tiny_flow(output, {"address": dask_cluster.scheduler_address, "world_size": 3})
    assert_failed_cleanly(state, ValueError, r"cluster.world_size=3 needs 3 Dask workers .* the cluster has 2")
    with get_client(sync_client=True) as api:
        names = {t.name for t in api.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))}
    assert not any(name.startswith(("decode-check", "rank-")) for name in names), names
    assert {k: v for k, v in snapshot(output).items() if k in before} == before


def test_a_single_class_is_refused_before_training(earlier_run, s3_fs, image_location):
    output, _, _ = earlier_run
    s3_fs.pipe({f"{image_location.url[5:]}-one-class/circle/{i}.jpg": s3_fs.cat_file(f"{image_location.url[5:]}/circle/000{i}.jpg")
                for i in range(3)})
    state = run_tiny_flow(output, {"address": "tcp://127.0.0.1:1"}, data={"url": f"{image_location.url}-one-class"})
    assert_failed_cleanly(state, ValueError, r"only one class \('circle'\).*needs at least 2 class folders")


def test_too_few_training_images_for_the_ranks_are_refused(earlier_run, s3_fs, image_location, dask_cluster):
    output, _, _ = earlier_run
    tiny = f"{image_location.url}-tiny"
    s3_fs.pipe({f"{tiny[5:]}/{cls}/0.jpg": s3_fs.cat_file(f"{image_location.url[5:]}/{cls}/0000.jpg") for cls in ("circle", "square")}
               | {f"{tiny[5:]}/{cls}/1.jpg": s3_fs.cat_file(f"{image_location.url[5:]}/{cls}/0001.jpg") for cls in ("circle", "square")})
    state = run_tiny_flow(output, {"address": dask_cluster.scheduler_address, "world_size": 2}, data={"url": tiny})
    assert_failed_cleanly(state, ValueError, r"Only 2 training images for 2 ranks: each rank needs at least 2")
