"""Batches onto the rank's device: decoded there (decode_on="device"), channels-last, and the autocast type.

On this machine the device is the CPU, where the same calls run that a GPU rank makes
with device="cuda" (the GPU-marked test runs them there).
"""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data.dataset import S3ImageFolder, eval_transform
from prefect_ddp.tasks.data.decoding import open_rgb
from prefect_ddp.tasks.data.device_batches import (
    EncodedBatch,
    ToDevice,
    decode_on,
    encoded_collate,
)
from prefect_ddp.tasks.training.recipe import (
    autocast_dtype,
    batch_inputs,
    train_classifier,
)
from tests.support.image_folders import local_image_folder
from tests.test_training import CTX, local_job


def image_bytes(mode: str, fmt: str) -> bytes:
    """A smooth 24x20 image: 8-bit RGB or grayscale, or 16-bit grayscale ("I;16")."""
    dtype = np.uint16 if mode == "I;16" else np.uint8
    ramp = np.linspace(0, np.iinfo(dtype).max, 24 * 20).reshape(24, 20).astype(dtype)
    pixels = np.stack([ramp, ramp[::-1], ramp.T.reshape(24, 20)], axis=-1) if mode == "RGB" else ramp
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt)
    return buffer.getvalue()


@pytest.mark.unit
def test_jpegs_and_other_formats_decode_as_the_loader_would():
    images = [image_bytes("RGB", "JPEG"), image_bytes("L", "PNG"), image_bytes("I;16", "PNG")]
    decoded = decode_on(torch.device("cpu"), [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in images])
    for data, tensor in zip(images, decoded):
        expected = torch.from_numpy(np.array(open_rgb(data))).permute(2, 0, 1)
        assert tensor.shape == expected.shape == (3, 24, 20) and tensor.dtype == torch.uint8
        # The same libjpeg family on both sides; allow rounding differences of the IDCT.
        assert (tensor.int() - expected.int()).abs().max() <= 2


@pytest.mark.unit
def test_encoded_batches_become_the_same_tensors_the_loader_makes(tmp_path):
    manifest = local_image_folder(tmp_path, per_class=2)
    positions = range(len(manifest.paths))

    def loader(transform, **options) -> DataLoader:
        dataset = S3ImageFolder(manifest.root, [manifest.paths[i] for i in positions],
                                [manifest.labels[i] for i in positions], {}, transform)
        return DataLoader(dataset, batch_size=4, **options)

    (decoded, labels), = [next(iter(loader(eval_transform(32))))]
    (encoded, encoded_labels), = [next(iter(loader(None, collate_fn=encoded_collate)))]
    assert all(item.dtype == torch.uint8 and item.dim() == 1 for item in encoded.data)
    assert encoded.positions.tolist() == [0, 1, 2, 3]
    on_device, on_device_labels = ToDevice(torch.device("cpu"), channels_last=True,
                                           transform=eval_transform(32))(encoded, encoded_labels)
    assert torch.equal(labels, encoded_labels) and torch.equal(labels, on_device_labels)
    assert on_device.shape == decoded.shape == (4, 3, 32, 32)
    assert on_device.is_contiguous(memory_format=torch.channels_last)
    assert (on_device - decoded).abs().max() < 0.05  # normalised units: within the IDCT's rounding


@pytest.mark.unit
def test_decoded_batches_are_only_moved():
    batch, labels = torch.rand(2, 3, 8, 8), torch.tensor([0, 1])
    moved, moved_labels = ToDevice(torch.device("cpu"))(batch, labels)
    assert torch.equal(moved, batch) and torch.equal(moved_labels, labels)
    moved, _ = ToDevice(torch.device("cpu"), channels_last=True)(batch, labels)
    assert moved.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.unit
def test_cpu_ranks_train_in_full_precision_and_keep_the_default_layout():
    log = logging.getLogger("test")
    assert autocast_dtype(TrainingConfig(amp=True), torch.device("cpu"), log) is None
    train, val = batch_inputs(TrainingConfig(channels_last=True, decode_on="device", image_size=32), torch.device("cpu"))
    assert train.memory_format == val.memory_format == torch.contiguous_format
    assert train.transform is not None and val.transform is not None
    train, _ = batch_inputs(TrainingConfig(), torch.device("cpu"))
    assert train.transform is None


@pytest.mark.unit
@pytest.mark.gpu
def test_gpu_ranks_decode_with_nvjpeg_in_bfloat16_channels_last():
    device = torch.device("cuda:0")
    log = logging.getLogger("test")
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert autocast_dtype(TrainingConfig(), device, log) == expected
    assert autocast_dtype(TrainingConfig(amp_dtype="float16"), device, log) == torch.float16
    jpeg = torch.frombuffer(bytearray(image_bytes("RGB", "JPEG")), dtype=torch.uint8)
    train, _ = batch_inputs(TrainingConfig(decode_on="device", image_size=16), device)
    # JPEG's magic and then no JPEG: the decoder refuses it, so it is left out and a copy of the first stands in.
    corrupt = torch.frombuffer(bytearray(b"\xff\xd8\xff" + b"not a JPEG body" * 4), dtype=torch.uint8)
    batch, labels = train(EncodedBatch([jpeg, jpeg, corrupt], torch.tensor([0, 1, 2])), torch.tensor([2, 0, 1]))
    assert batch.device.type == "cuda" and batch.shape == (3, 3, 16, 16)
    assert batch.is_contiguous(memory_format=torch.channels_last)
    assert labels.tolist() == [2, 0, -3] and torch.equal(batch[2], batch[0])


def test_the_recipe_trains_with_images_decoded_on_the_rank(tmp_path):
    job = local_job(tmp_path, epochs=1)
    job.training = job.training.model_copy(update={"decode_on": "device", "num_workers": 1})
    result = train_classifier(CTX, job)
    (epoch,) = result.history
    assert epoch["train_samples"] == 8 and epoch["val_samples"] == 3  # every image, decoded on the rank
    assert np.isfinite(epoch["train_loss"]) and np.isfinite(epoch["val_loss"])
