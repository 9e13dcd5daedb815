"""training.decode_on="auto": what each rank measures, the feed it takes from that, and that
measuring leaves the run as it was (prefect_ddp.tasks.training.feed_choice)."""

from __future__ import annotations

import io
import logging
from dataclasses import replace

import pytest
import torch
from PIL import Image
from torch import nn

from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data import device_batches
from prefect_ddp.tasks.data.dataset import train_transform
from prefect_ddp.tasks.data.decoding import stored_resized
from prefect_ddp.tasks.data.device_batches import EncodedBatch, ToDevice, decode_on
from prefect_ddp.tasks.data.loaders import rank_data
from prefect_ddp.tasks.training.feed_choice import (
    DEVICE_MARGIN,
    TIMED_STEPS,
    FeedMeasures,
    choose_feed,
    device_decode_seconds,
    measure_feed,
    model_step_seconds,
)
from prefect_ddp.tasks.training.rank_setup import as_the_loaders_read, set_up_rank
from tests.test_device_batches import PHOTO_SIZES, photo_bytes
from tests.test_training import CTX, local_job
from tests.test_uint8_batches import IMAGES

# An H200 with ResNet-50 (bench/RESULTS.md, "GPU"): 0.23 ms of compute per image, 2.5 ms of a core to
# decode a 500x375 photo, 15 loader processes: they feed 6,000 images a second, the model takes 4,300.
H200 = FeedMeasures(step_s=0.00023, loader_s=0.0025, device_s=0.00003, loader_processes=15)


@pytest.mark.unit
def test_loaders_that_keep_the_model_busy_are_kept():
    assert choose_feed(H200).decode_on == "loader"
    why = choose_feed(H200).why
    assert "15 loader process(es) decode and augment about 6,000 images a second" in why
    assert "the model trains 4,348 a second" in why and "not more than the loaders' 4,348" in why


@pytest.mark.unit
def test_loaders_that_cannot_keep_up_give_way_to_a_device_that_decodes_faster():
    photos = FeedMeasures(step_s=0.00023, loader_s=0.025, device_s=0.00003, loader_processes=15)  # 12-MP photos
    chosen = choose_feed(photos)
    assert chosen.decode_on == "device"
    assert "about 600 images a second" in chosen.why
    assert "would train about 3,846, more than the loaders' 600" in chosen.why


@pytest.mark.unit
def test_a_device_whose_decode_costs_more_than_the_loaders_lose_is_not_taken():
    # The loaders are short of the model, but decoding on the device slows the model more than that
    # (PNGs, which the device path decodes on the rank's own thread, or a slow GPU decoder).
    short = FeedMeasures(step_s=0.00023, loader_s=0.0040, device_s=0.0004, loader_processes=15)
    assert 15 / short.loader_s < 1 / short.step_s and choose_feed(short).decode_on == "loader"
    # Within the margin: the loaders' exact pixels are kept for a gain of less than DEVICE_MARGIN.
    loader_rate = 15 / 0.0040
    device_s = 1 / (loader_rate * (DEVICE_MARGIN - 0.02)) - 0.00023
    assert choose_feed(FeedMeasures(0.00023, 0.0040, device_s, 15)).decode_on == "loader"
    device_s = 1 / (loader_rate * (DEVICE_MARGIN + 0.02)) - 0.00023
    assert choose_feed(FeedMeasures(0.00023, 0.0040, device_s, 15)).decode_on == "device"


@pytest.mark.unit
def test_a_rank_without_loader_processes_pays_the_decode_between_steps():
    # The rank's own thread decodes between steps: 1 / (step + decode), however fast the model.
    alone = FeedMeasures(step_s=0.001, loader_s=0.0025, device_s=0.0002, loader_processes=0)
    chosen = choose_feed(alone)
    assert chosen.decode_on == "device" and "the rank itself decodes and augments about 400" in chosen.why
    assert "more than the loaders' 286" in chosen.why


@pytest.mark.unit
def test_a_device_that_cannot_decode_leaves_the_loaders_whatever_they_cost():
    chosen = choose_feed(FeedMeasures(step_s=0.00023, loader_s=0.025, device_s=None, loader_processes=1))
    assert chosen.decode_on == "loader" and "cannot decode its JPEGs on its device" in chosen.why


@pytest.mark.unit
def test_a_jpeg_the_device_refuses_decodes_on_the_cpu_as_the_loader_decodes_it():
    # Cut short and padded: torchvision's decoder refuses it, PIL (the loader, decode-check) decodes it.
    padded = torch.frombuffer(bytearray(IMAGES["padded"]), dtype=torch.uint8)
    assert decode_on(torch.device("cpu"), [padded], fall_back=False) == [None]
    image = decode_on(torch.device("cpu"), [padded])[0]
    assert image is not None and image.shape == (3, 90, 120)


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(4, 3)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.norm(self.conv(images)).mean((2, 3))))


@pytest.mark.unit
def test_measuring_leaves_the_model_and_the_random_draws_as_they_were():
    model = TinyNet().eval()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    generator = torch.get_rng_state()
    transform = train_transform(16)
    photos = [photo_bytes(w, h, seed) for seed, (w, h) in enumerate(PHOTO_SIZES)]
    measured = measure_feed(model, ToDevice(torch.device("cpu"), transform=transform), transform, photos,
                            batch_size=4, image_size=16, amp_dtype=None, loader_processes=2)
    assert measured is not None and measured.loader_processes == 2
    assert measured.step_s > 0 and measured.loader_s > 0 and measured.device_s is not None and measured.device_s > 0
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)  # weights and BatchNorm statistics
    assert all(param.grad is None for param in model.parameters()) and not model.training
    assert torch.equal(torch.get_rng_state(), generator)  # the run's crops and dropout draw as without it


@pytest.mark.unit
def test_measuring_keeps_the_gradients_a_model_holds():
    model = TinyNet()
    model(torch.zeros(2, 3, 8, 8)).sum().backward()
    held = {name: param.grad.clone() for name, param in model.named_parameters()}
    model_step_seconds(model, ToDevice(torch.device("cpu")), batch_size=2, image_size=8, amp_dtype=None)
    assert all(torch.equal(param.grad, held[name]) for name, param in model.named_parameters())


@pytest.mark.unit
def test_the_device_is_timed_on_the_images_it_decodes_not_one_by_one_behind_a_refused_one(monkeypatch):
    calls: list[int] = []
    real = device_batches.decode_jpegs

    def counted(device, jpegs):
        calls.append(len(jpegs))
        return real(device, jpegs)

    monkeypatch.setattr(device_batches, "decode_jpegs", counted)
    photos = [photo_bytes(w, h, seed) for seed, (w, h) in enumerate(PHOTO_SIZES[:7])] + [b"\xff\xd8\xff broken"]
    inputs = ToDevice(torch.device("cpu"), transform=train_transform(16))
    assert device_decode_seconds(inputs, photos, batch_size=32) is not None
    # The first look decodes the 8 and finds the broken one (its batched call fails, then one by one);
    # the timed batches hold the 7 others only, so every one of them decodes in one call.
    assert calls.count(32) == 1 + TIMED_STEPS and sum(1 for count in calls if count == 1) <= len(photos)
    assert device_decode_seconds(inputs, [b"\xff\xd8\xff broken"], batch_size=4) is None


@pytest.mark.unit
def test_shards_stored_resized_are_timed_as_the_loaders_read_them():
    photo = photo_bytes(160, 120, seed=3)
    cfg = TrainingConfig(image_size=16, images_per_shard=10, shard_side=40, shard_quality=70)
    read = as_the_loaders_read(cfg, [photo])[0]
    assert read == stored_resized(photo, 40, 70).data and Image.open(io.BytesIO(read)).size == (53, 40)
    assert as_the_loaders_read(TrainingConfig(image_size=16), [photo]) == [photo]  # no shards: as stored
    assert as_the_loaders_read(cfg.model_copy(update={"shard_side": 0}), [photo]) == [photo]  # stored as they were


@pytest.mark.unit
def test_nothing_decodable_measures_nothing():
    transform = train_transform(16)
    assert measure_feed(TinyNet(), ToDevice(torch.device("cpu"), transform=transform), transform,
                        [b"\xff\xd8\xff not a JPEG"], batch_size=2, image_size=16, amp_dtype=None,
                        loader_processes=1) is None


def test_a_cpu_rank_decodes_in_its_loaders_and_says_why(tmp_path, caplog):
    job = local_job(tmp_path, epochs=1)
    assert job.training.decode_on == "auto"  # the default
    with caplog.at_level(logging.INFO):
        rank = set_up_rank(CTX, job, logging.getLogger("test_feed_choice"))
    assert rank.data.decodes_originals  # the loaders decode: nothing was handed over encoded
    said = [record.getMessage() for record in caplog.records if "decode_on='auto'" in record.getMessage()]
    assert said == ["Rank 0 decodes its training images in the loader processes (training.decode_on='auto'): it "
                    "runs on cpu, where decoding on the device would take the rank's own core instead of its loaders'."]


def test_a_feed_chosen_as_device_hands_the_loaders_batches_over_encoded(tmp_path):
    job = local_job(tmp_path, epochs=1)
    args = (CTX, job.source, job.output, job.manifest, job.split, job.training, job.preprocessing)
    assert job.training.decode_on == "auto"
    loader_batch, _ = next(iter(rank_data(*args).train))  # "auto" before the choice: the loaders decode
    assert loader_batch.dtype == torch.uint8
    device_batch, _ = next(iter(rank_data(*args, decode_on="device").train))
    assert isinstance(device_batch, EncodedBatch) and len(device_batch.data) == job.training.batch_size
    assert not rank_data(*args, decode_on="device").decodes_originals


@pytest.mark.gpu
def test_a_cuda_rank_measures_its_feed_and_trains_with_it(tmp_path, caplog):
    job = local_job(tmp_path, epochs=1)
    ctx = replace(CTX, device="cuda:0")
    with caplog.at_level(logging.INFO):
        rank = set_up_rank(ctx, job, logging.getLogger("test_feed_choice"))
    said = [record.getMessage() for record in caplog.records if "decode_on='auto'" in record.getMessage()]
    assert len(said) == 1 and "the model trains" in said[0]
    batch, _ = next(iter(rank.data.train))
    assert isinstance(batch, EncodedBatch) == ("on the rank's device" in said[0])
