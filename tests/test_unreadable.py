"""Images unreadable at training time: left out of their batch, counted against the limit, reported.

decode-check leaves out what it finds (tests/test_bad_data.py); these are the images it did
not check (data.validate_sample) or that changed since: missing, or bytes that do not
decode, met by a training or validation loader. Unit tests use local folders and the real
loaders and loop; the end-to-end runs use the session's moto S3, Prefect server and
LocalCluster at world size 2 with gloo.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image
from prefect import flow
from torch import nn
from torch.utils.data import DataLoader

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.config import ClusterConfig
from prefect_ddp.tasks.data.dataset import S3ImageFolder, eval_transform
from prefect_ddp.tasks.data.device_batches import ToDevice, encoded_collate
from prefect_ddp.tasks.data.indexing import index_images
from prefect_ddp.tasks.data.loaders import rank_data
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.positioned_sampler import PositionedSampler
from prefect_ddp.tasks.data.shard_reader import ShardDataset, ShardLoader
from prefect_ddp.tasks.data.shard_writer import ShardFormat, write_shards
from prefect_ddp.tasks.data.storage import load_torch
from prefect_ddp.tasks.results.aggregation import check_stopped
from prefect_ddp.tasks.results.report import unreadable_text
from prefect_ddp.tasks.training.job import TrainJob
from prefect_ddp.tasks.training.passes import evaluate, train_one_epoch
from prefect_ddp.tasks.training.recipe import train_classifier
from prefect_ddp.tasks.training.unreadable import UnreadableLimit
from tests.support.api_helpers import assert_no_task_run_left_running, rank_task_runs
from tests.conftest import BUCKET, truncated_jpeg
from tests.support.flow_runs import run_tiny_flow
from tests.support.image_folders import local_image_folder
from tests.test_bad_data import encoded
from tests.test_training import CTX, local_job

CPU = torch.device("cpu")


def spoil(root: Path, manifest: Manifest, missing: int, undecodable: int) -> None:
    """Delete the image at position `missing` and make the one at `undecodable` a truncated JPEG."""
    (root / manifest.paths[missing]).unlink()
    (root / manifest.paths[undecodable]).write_bytes(truncated_jpeg())


@pytest.fixture
def spoilt(tmp_path: Path) -> Manifest:
    """6 images in 3 classes (labels 0 0 1 1 2 2); position 1 is gone and position 4 does not decode."""
    manifest = local_image_folder(tmp_path / "images", per_class=2)
    spoil(tmp_path / "images", manifest, missing=1, undecodable=4)
    return manifest


def folder_dataset(manifest: Manifest, transform) -> S3ImageFolder:
    return S3ImageFolder(manifest.root, manifest.paths, manifest.labels, {}, transform)


# --- the datasets -------------------------------------------------------------------------


@pytest.mark.unit
def test_a_missing_and_an_undecodable_image_come_back_as_stand_ins_labelled_with_their_position(spoilt):
    batch = folder_dataset(spoilt, eval_transform(32)).__getitems__(range(6))
    assert [label for _, label in batch] == [0, -2, 1, 1, -5, 2]  # -(1 + position)
    readable = [image for image, label in batch if label >= 0]
    for image, label in batch:
        assert image.shape == (3, 32, 32)
        if label < 0:  # a copy of a readable image of the same batch, for BatchNorm's batch statistics
            assert any(torch.equal(image, other) for other in readable)


@pytest.mark.unit
def test_a_batch_with_no_readable_image_keeps_its_size_with_blank_stand_ins(spoilt):
    batch = folder_dataset(spoilt, eval_transform(32)).__getitems__([1, 4])
    assert [label for _, label in batch] == [-2, -5]
    assert all(image.shape == (3, 32, 32) and torch.isfinite(image).all() for image, _ in batch)


@pytest.mark.unit
def test_decoding_on_the_device_leaves_them_out_there(spoilt):
    loader = DataLoader(folder_dataset(spoilt, None), batch_size=6, collate_fn=encoded_collate)
    encoded, labels = next(iter(loader))
    images, labels = ToDevice(CPU, transform=eval_transform(32))(encoded, labels)
    assert labels.tolist() == [0, -2, 1, 1, -5, 2]
    assert images.shape == (6, 3, 32, 32)
    assert torch.equal(images[1], images[0]) and torch.isfinite(images).all()


def shard_dataset(output: Path, manifest: Manifest, batch: int) -> ShardDataset:
    """Every image of `manifest` packed 4 to a shard below `output`, read by one rank without loader workers."""
    index, _ = write_shards(manifest, range(len(manifest)), {}, str(output), {}, ShardFormat(images_per_shard=4),
                            "split-digest")
    folder = next(output.rglob("index.json")).parent
    return ShardDataset(str(folder), index, {}, eval_transform(32), batch, 0, 1, 0)


def epoch_batches(loader) -> list[list[int]]:
    loader.sampler.set_epoch(0)
    return [labels.tolist() for _, labels in loader]


@pytest.mark.unit
def test_an_undecodable_image_inside_a_shard_is_left_out_and_named(tmp_path):
    # The shards hold the image's bytes as they were stored: decode-check sampled other images.
    manifest = local_image_folder(tmp_path / "images", per_class=3)
    (tmp_path / "images" / manifest.paths[4]).write_bytes(truncated_jpeg())
    shards = shard_dataset(tmp_path / "out", manifest, batch=3)
    batches = epoch_batches(ShardLoader(shards))
    assert [len(b) for b in batches] == [3, 3, 3]  # the same steps and batch sizes as with no bad image
    left_out = [label for b in batches for label in b if label < 0]
    assert [shards.keys[-1 - label] for label in left_out] == [manifest.paths[4]]


@pytest.mark.unit
def test_an_image_deleted_before_the_shards_were_written_is_met_in_training_and_named(tmp_path):
    manifest = local_image_folder(tmp_path / "images", per_class=3)
    (tmp_path / "images" / manifest.paths[7]).unlink()
    shards = shard_dataset(tmp_path / "out", manifest, batch=3)
    left_out = [label for b in epoch_batches(ShardLoader(shards)) for label in b if label < 0]
    assert [shards.keys[-1 - label] for label in left_out] == [manifest.paths[7]]


# --- the loop -----------------------------------------------------------------------------


def linear_model() -> nn.Module:
    """No BatchNorm: a stand-in cannot change a readable image's logits, so the sums are exact."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 3))


def readable_only(manifest: Manifest, model: nn.Module) -> tuple[float, int, int]:
    """(summed loss, correct, count) over the readable images alone (`spoilt`'s positions 0, 2, 3, 5)."""
    dataset = folder_dataset(manifest, eval_transform(32))
    keep = [0, 2, 3, 5]
    images = torch.stack([dataset[p][0] for p in keep])
    labels = torch.tensor([manifest.labels[p] for p in keep])
    with torch.no_grad():
        logits = model(images)
    loss = nn.functional.cross_entropy(logits, labels, reduction="sum").item()
    return loss, int((logits.argmax(1) == labels).sum()), len(keep)


@pytest.mark.unit
def test_evaluation_counts_only_the_images_it_read(spoilt):
    model = linear_model()
    sums = evaluate(model, DataLoader(folder_dataset(spoilt, eval_transform(32)), batch_size=3), ToDevice(CPU))
    loss, correct, count = readable_only(spoilt, model)
    assert (sums.loss_sum, sums.correct, sums.count) == (pytest.approx(loss, rel=1e-5), correct, count)
    assert sorted(sums.unreadable) == [spoilt.paths[1], spoilt.paths[4]]


@pytest.mark.unit
def test_training_masks_them_out_of_the_loss_and_still_steps_on_a_batch_with_none_readable(spoilt):
    model = linear_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay: the sums are comparable
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    # Batches [0 1] [2 3] [4 5] and then [1 4]: nothing readable in the last.
    loader = DataLoader(folder_dataset(spoilt, eval_transform(32)), batch_size=2, sampler=[0, 1, 2, 3, 4, 5, 1, 4])
    steps = []
    sums = train_one_epoch(model, loader, optimizer, scaler, ToDevice(CPU), None,
                           on_step=lambda done, total: steps.append(done))
    loss, correct, count = readable_only(spoilt, model)
    assert (sums.loss_sum, sums.correct, sums.count) == (pytest.approx(loss, rel=1e-5), correct, count)
    assert steps == [1, 2, 3, 4]
    # The last step ran backward (a zero gradient, not none): under DDP its all-reduce happened.
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def spoilt_job(tmp_path: Path, epochs: int, missing: str, undecodable: str) -> TrainJob:
    """local_job's 12 images (9 train, 3 val) at batch size 3, which drops no image, with one
    image of `missing`'s split deleted and one of `undecodable`'s spoilt ("train" or "val")."""
    job = local_job(tmp_path, epochs)
    job = job.model_copy(update={"training": job.training.model_copy(update={"batch_size": 3})})
    spoil(Path(job.manifest.root), job.manifest, getattr(job.split, missing)[0], getattr(job.split, undecodable)[1])
    return job


@pytest.mark.unit
def test_leaving_images_out_changes_no_rank_s_steps_or_batch_sizes(tmp_path):
    # 9 training images on 2 ranks, 5 each (the sampler pads one, as DistributedSampler does), at batch size 3.
    job = spoilt_job(tmp_path, epochs=1, missing="train", undecodable="train")
    sizes, left_out = [], []
    for rank in (0, 1):
        train_loader = rank_data(replace(CTX, rank=rank, world_size=2), job.source, job.output, job.manifest,
                                 job.split, job.training, job.preprocessing).train
        assert isinstance(train_loader.sampler, PositionedSampler)
        batches = [labels.tolist() for _, labels in train_loader]
        sizes.append([len(labels) for labels in batches])
        left_out += [label for labels in batches for label in labels if label < 0]
    assert sizes == [[3, 2], [3, 2]]
    assert len(left_out) >= 2  # both met (one twice, if the sampler's padding repeated it)


# --- a rank: left out, counted, stopped at the limit ---------------------------------------


# Not `unit` (it starts nothing): the whole recipe across a resume, 10-25 s on 2 busy cores.
def test_a_rank_trains_on_the_rest_names_what_it_left_out_and_counts_each_once_across_a_resume(tmp_path):
    job = spoilt_job(tmp_path, epochs=1, missing="train", undecodable="val")
    job = job.model_copy(update={"unreadable": UnreadableLimit(limit=0.2)})  # 2 of 12 is more than the default 0.1
    bad = sorted([job.manifest.paths[job.split.train[0]], job.manifest.paths[job.split.val[1]]])
    first = train_classifier(CTX, job)
    assert first.unreadable == {"decode_check": 0, "in_training": 2, "keys": bad} and first.stopped is None
    (epoch,) = first.history
    assert epoch["unreadable"] == bad
    assert (epoch["train_samples"], epoch["val_samples"]) == (len(job.split.train) - 1, len(job.split.val) - 1)
    resumed = train_classifier(CTX, job.model_copy(update={"training": job.training.model_copy(update={"epochs": 2})}))
    assert [h["unreadable"] for h in resumed.history] == [bad, []]  # met again in epoch 2, counted once
    assert resumed.unreadable == first.unreadable


# Not `unit` (it starts nothing): the whole recipe, 5-10 s on 2 busy cores.
def test_past_the_limit_every_rank_stops_and_returns_the_reason_without_raising(tmp_path):
    job = spoilt_job(tmp_path, epochs=3, missing="train", undecodable="train")
    job = job.model_copy(update={"unreadable": UnreadableLimit(excluded=1, limit=0.2)})
    result = train_classifier(CTX, job)
    stopped = result.stopped
    # 12 images listed in the manifest, plus the one decode-check left out: 3 of 13.
    assert stopped.startswith("3 of the 13 images under ")
    assert "(23.1%) could not be read, more than data.max_unreadable_fraction=0.2 allows" in stopped
    assert "1 left out by decode-check and 2 missing or undecodable when training read them (by epoch 1)" in stopped
    assert ", ".join(sorted(job.manifest.paths[p] for p in job.split.train[:2])) + "." in stopped
    assert "raise data.max_unreadable_fraction" in stopped and "data.validate_sample" in stopped
    assert result.history == [] and not (tmp_path / "run" / "model.pt").exists()
    with pytest.raises(ValueError, match=r"3 of the 13 images under .* could not be read"):
        check_stopped([result])
    # The stop is the run's end, checkpointed: a retry stops with it and trains nothing (issue 56).
    assert load_torch(str(tmp_path / "run" / "checkpoints" / "checkpoint.pt"), {})["stopped"]["kind"] == "unreadable"
    again = train_classifier(CTX, job)
    assert again.stopped == stopped and again.history == [] and again.local_train_samples == []


@pytest.mark.unit
def test_the_report_names_what_training_left_out_beside_decode_check():
    text = unreadable_text({"decode_check": 3, "in_training": 2, "keys": ["a/1.jpg", "b/2.jpg"]})
    assert text == ("Unreadable images left out: 3 by decode-check, 2 more during training (missing or not "
                    "decodable when read): `a/1.jpg`, `b/2.jpg`.")
    assert unreadable_text({"decode_check": 0, "in_training": 0, "keys": []}) == ""


# --- end to end: world size 2, moto S3, the session's cluster -------------------------------

PER_CLASS = 12


def shapes_folder(s3_fs, prefix: str, undecodable: list[str]) -> str:
    """Classes a and b, PER_CLASS images each, `undecodable` keys truncated; returns the folder URL."""
    colours = {"a": (200, 40, 40), "b": (40, 40, 200)}
    files = {f"{cls}/{i:02d}.jpg": encoded(Image.new("RGB", (32, 32), colour), "JPEG")
             for cls, colour in colours.items() for i in range(PER_CLASS)}
    files |= {key: truncated_jpeg() for key in undecodable}
    s3_fs.pipe({f"{BUCKET}/{prefix}/{key}": data for key, data in files.items()})
    return f"s3://{BUCKET}/{prefix}"


@flow
def list_folder_once(location: DataLocation) -> Manifest:
    """The `index` task's cached listing, as an earlier run within data.index_cache_minutes leaves it."""
    return index_images(location)


def sampled_run(output: Path, dask_cluster, url: str, images_per_shard: int | None = None):
    """World size 2, the default max_restarts, decode-check sampling 1 image per class (a/00, b/00)."""
    cluster = {"address": dask_cluster.scheduler_address, "world_size": 2,
               "max_restarts": ClusterConfig.model_fields["max_restarts"].default}
    return run_tiny_flow(output, cluster, data={"url": url, "validate_sample": 1, "index_cache_minutes": 60},
                         training={"images_per_shard": images_per_shard})


@pytest.mark.slow
@pytest.mark.parametrize("images_per_shard", [None, 4], ids=["by-image", "shards"])
def test_a_run_leaves_out_an_unchecked_undecodable_and_a_deleted_image_and_reports_them(
    image_location, s3_fs, dask_cluster, tmp_path, images_per_shard,
):
    # With shards, the deleted image is packed empty and training meets it as one that does not decode.
    image_location.save("test-images", overwrite=True)
    prefix = f"unreadable/few-{'shards' if images_per_shard else 'by-image'}"
    url = shapes_folder(s3_fs, prefix, undecodable=["a/07.jpg"])
    list_folder_once(image_location.with_url(url))
    s3_fs.rm(f"{BUCKET}/{prefix}/b/05.jpg")  # gone since the listing the run reuses
    state = sampled_run(tmp_path, dask_cluster, url, images_per_shard)
    summary = state.result()
    assert summary["unreadable"] == {"decode_check": 0, "in_training": 2, "keys": ["a/07.jpg", "b/05.jpg"]}
    assert [a["ended"] for a in summary["attempts"]] == ["completed"]
    (epoch,) = summary["history"]
    assert epoch["unreadable"] == ["a/07.jpg", "b/05.jpg"]  # both met in the one epoch, by one rank or the other
    metrics = json.loads(Path(summary["files"]["metrics.json"]).read_text())
    assert metrics["unreadable"]["keys"] == ["a/07.jpg", "b/05.jpg"]
    report = Path(summary["files"]["report.md"]).read_text()
    assert "2 more during training (missing or not decodable when read): `a/07.jpg`, `b/05.jpg`" in report
    assert "Trained in one gang attempt" in report
    assert_no_task_run_left_running(state.state_details.flow_run_id)


@pytest.mark.slow
def test_too_many_unreadable_images_met_in_training_fail_the_run_without_re_forming_the_gang(
    image_location, s3_fs, dask_cluster, tmp_path,
):
    image_location.save("test-images", overwrite=True)
    bad = ["a/03.jpg", "a/08.jpg", "b/04.jpg"]
    url = shapes_folder(s3_fs, "unreadable/many", undecodable=bad)
    (tmp_path / "earlier-run").mkdir()
    (tmp_path / "earlier-run" / "model.pt").write_bytes(b"an earlier run's model")
    state = sampled_run(tmp_path, dask_cluster, url)
    assert state.is_failed(), state
    with pytest.raises(ValueError, match=r"3 of the 24 images under 's3://test-images/unreadable/many' \(12.5%\) "
                                         r"could not be read, more than data.max_unreadable_fraction=0.1 allows: "
                                         r"0 left out by decode-check and 3 missing or undecodable when training "
                                         r"read them \(by epoch 1\), e.g. a/03.jpg, a/08.jpg, b/04.jpg\."):
        state.result()
    flow_run_id = state.state_details.flow_run_id
    assert_no_task_run_left_running(flow_run_id)
    ranks = rank_task_runs(flow_run_id, expected=2)
    assert [r.state.type.value for r in ranks] == ["COMPLETED", "COMPLETED"]  # one attempt, not re-formed
    assert (tmp_path / "earlier-run" / "model.pt").read_bytes() == b"an earlier run's model"
    assert not list(tmp_path.rglob("metrics.json"))
