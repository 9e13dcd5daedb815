"""The examples run as a user runs them, at tiny sizes, on the session's 2-worker cluster."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import s3fs
import torch
import torchvision
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.logging import disable_run_logger

from examples.name_generator import name_generator_sweep
from examples.tutorial_transfer_learning import (
    list_image_folder,
    tutorial_transfer_learning,
)
from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.deployments.sample_data import shapes_dataset

pytestmark = pytest.mark.slow
PER_CLASS = 8


@pytest.fixture(scope="module")
def clean_images(image_location: DataLocation, s3_fs: s3fs.S3FileSystem) -> DataLocation:
    """A tiny S3 image folder with a README and a stray image, but no broken one: the
    tutorial's loop, like the original, trusts every listed image to decode."""
    location = image_location.with_url(f"{image_location.url}-clean")
    files = shapes_dataset(PER_CLASS, size=32, seed=2)
    files["README.txt"] = b"not an image"
    files["stray.jpg"] = files["circle/0000.jpg"]
    prefix = location.url.removeprefix("s3://")
    s3_fs.pipe({f"{prefix}/{key}": data for key, data in files.items()})
    return location


def finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


def test_the_name_generator_sweep_compares_its_trials_and_generates_names(dask_cluster, tmp_path):
    state = name_generator_sweep(n_trials=4, epochs=2, concurrency=2, output=str(tmp_path),
                                 address=dask_cluster.scheduler_address, return_state=True)
    record = state.result()

    trials = record["trials"]
    assert sorted(row["trial"] for row in trials) == [0, 1, 2, 3]
    assert {tuple(sorted(row["params"])) for row in trials} == {("batch_size", "lr")}
    assert len({tuple(sorted(row["params"].items())) for row in trials}) == 4  # the whole grid
    for row in trials:
        assert row["state"] == "completed" or row["state"].startswith("pruned at epoch"), row
        assert finite([point["value"] for point in row["curve"]])
    completed = [row for row in trials if row["state"] == "completed"]
    assert all([p["epoch"] for p in row["curve"]] == [1, 2] for row in completed)

    best = record["best"]
    assert best["state"] == "completed" and best["value"] == min(row["value"] for row in completed)
    assert Path(best["model_url"]).exists()
    assert len(record["generated"]) == 10 and all(name.isalpha() for name in record["generated"])

    folder = tmp_path / "name-generator"
    assert json.loads((folder / "sweep.json").read_text())["best"]["trial"] == best["trial"]
    assert (folder / "curves.png").stat().st_size > 0
    with get_client(sync_client=True) as api:
        artifacts = api.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    assert "sweep-comparison" in {artifact.key for artifact in artifacts}


def test_the_listing_skips_what_is_no_class_image(clean_images):
    with disable_run_logger():
        listing = list_image_folder(clean_images.url, clean_images.storage_options())
    assert listing["classes"] == ["circle", "square", "triangle"]
    assert len(listing["keys"]) == 3 * PER_CLASS and "README.txt" not in listing["keys"]
    assert all("/" in key for key in listing["keys"])  # stray.jpg lies outside every class
    assert listing["labels"] == [listing["classes"].index(key.split("/")[0]) for key in listing["keys"]]


def test_the_tutorial_fine_tunes_on_two_workers_from_s3_and_rank_0_saves_the_model(
    dask_cluster, clean_images, tmp_path
):
    model_url = tmp_path / "tutorial" / "model.pt"
    results = tutorial_transfer_learning(
        clean_images, epochs=2, batch_size=4,
        image_size=32, world_size=2, model_url=str(model_url), address=dask_cluster.scheduler_address,
    )

    assert [r["rank"] for r in results] == [0, 1]
    workers = {r["worker"] for r in results}
    assert len(workers) == 2 and workers <= set(dask_cluster.scheduler_info["workers"])
    assert finite(results[0]["losses"]) and len(results[0]["losses"]) == 2
    assert results[0]["losses"] == results[1]["losses"]  # the gang's mean, the same on every rank
    assert results[0]["model_url"] == str(model_url) and "model_url" not in results[1]

    state_dict = torch.load(model_url, weights_only=True, map_location="cpu")
    model = torchvision.models.resnet18(num_classes=3)
    model.load_state_dict(state_dict)  # every key, with the shapes of a 3-class resnet18
