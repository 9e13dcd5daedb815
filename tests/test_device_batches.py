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
from torchvision.transforms import v2

from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data.dataset import (
    S3ImageFolder,
    encoded_tensor,
    eval_transform,
    prepare,
    train_transform,
    unreadable_label,
)
from prefect_ddp.tasks.data import device_batches
from prefect_ddp.tasks.data.decoding import open_rgb
from prefect_ddp.tasks.data.preprocessing import Preprocessing
from prefect_ddp.tasks.data.device_batches import (
    EncodedBatch,
    ToDevice,
    decode_on,
    encoded_collate,
    jpeg_orientation,
)
from prefect_ddp.tasks.training.rank_setup import autocast_dtype, batch_inputs
from prefect_ddp.tasks.training.recipe import train_classifier
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


def photo_bytes(width: int, height: int, seed: int, orientation: int = 1, noise: int = 55) -> bytes:
    """A JPEG of `width` x `height`: a ramp (crops of it differ) under `noise`, red top left, tagged with `orientation`."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 200, width)[None, :, None] * np.linspace(0.3, 1, height)[:, None, None]
    pixels = (ramp + rng.integers(0, noise + 1, (height, width, 3))).astype(np.uint8)
    pixels[: height // 4, : width // 4] = (255, 0, 0)  # red top left, as stored
    image, buffer = Image.fromarray(pixels), io.BytesIO()
    exif = image.getexif()
    exif[0x0112] = orientation
    image.save(buffer, "JPEG", quality=90, exif=exif)
    return buffer.getvalue()


def encoded(images: list[bytes]) -> tuple[EncodedBatch, torch.Tensor]:
    """`images` as encoded_collate hands them over, at positions 0, 1, ..., labelled 10, 11, ..."""
    data = [encoded_tensor(image) for image in images]
    return EncodedBatch(data, torch.arange(len(images))), torch.arange(len(images)) + 10


# Sizes and aspect ratios that make RandomResizedCrop draw crops of all shapes, some by its fallback.
PHOTO_SIZES = [(64, 48), (48, 64), (40, 40), (96, 30), (31, 57), (70, 52), (52, 70), (45, 45)]


def train_transform_with_knobs(side: int) -> v2.Compose:
    """The train transform with the image knobs on (random_erasing often enough to erase some of 8 images)."""
    return train_transform(side, trivial_augment=True, random_erasing=0.5)


@pytest.mark.unit
@pytest.mark.parametrize("make_transform", [train_transform, eval_transform, train_transform_with_knobs])
def test_a_batch_makes_the_tensors_the_transform_makes_image_by_image(make_transform):
    transform = make_transform(24)
    photos = [photo_bytes(w, h, seed, orientation=1 + seed % 8) for seed, (w, h) in enumerate(PHOTO_SIZES)]
    images, labels = encoded(photos)
    torch.manual_seed(7)
    expected = torch.stack([transform(image) for image in decode_on(torch.device("cpu"), images.data)])
    torch.manual_seed(7)
    batch, batch_labels = ToDevice(torch.device("cpu"), channels_last=True, transform=transform)(images, labels)
    # Exactly equal, no tolerance: the same decoded tensors, the same draws of torch's CPU generator in
    # the same order (crop, then flip, then the knobs' steps, image by image), the same uint8 kernels on
    # the CPU, and the same elementwise conversion and normalisation, once on the batch instead of per image.
    assert torch.equal(batch, expected) and torch.equal(batch_labels, labels)
    assert batch.is_contiguous(memory_format=torch.channels_last)
    torch.manual_seed(8)  # another seed draws other crops: the batch follows torch's generator
    other, _ = ToDevice(torch.device("cpu"), transform=transform)(images, labels)
    assert torch.equal(other, expected) == (make_transform is eval_transform)


@pytest.mark.unit
def test_a_batch_decoded_in_chunks_makes_the_same_tensors(monkeypatch):
    transform = train_transform(24)
    photos = [photo_bytes(w, h, seed) for seed, (w, h) in enumerate(PHOTO_SIZES)]
    images, labels = encoded(photos + [b"\xff\xd8\xff broken"])
    torch.manual_seed(5)
    whole, whole_labels = ToDevice(torch.device("cpu"), transform=transform)(images, labels)
    monkeypatch.setattr(device_batches, "DECODE_PIXELS", 64 * 48)  # about one image a chunk
    # Each image holds over half the budget, so one a chunk; the broken one (no header: no pixels) joins the last.
    assert [len(chunk) for chunk in device_batches.pixel_chunks(images.data)] == [1] * 7 + [2]
    torch.manual_seed(5)
    chunked, chunked_labels = ToDevice(torch.device("cpu"), transform=transform)(images, labels)
    assert torch.equal(chunked, whole) and torch.equal(chunked_labels, whole_labels)


@pytest.mark.unit
def test_a_mixed_batch_turns_jpegs_upright_decodes_pngs_and_stands_in_for_corrupt_ones():
    corrupt = b"\xff\xd8\xff" + b"not a JPEG body" * 4
    sideways = photo_bytes(48, 64, seed=1, orientation=6, noise=0)  # stored turned: upright, 64 wide and 48 high
    photos = [corrupt, sideways, image_bytes("RGB", "PNG"), corrupt, photo_bytes(40, 40, seed=2, noise=0)]
    images, labels = encoded(photos)
    transform = eval_transform(16)
    batch, batch_labels = ToDevice(torch.device("cpu"), transform=transform)(images, labels)
    assert batch_labels.tolist() == [unreadable_label(0), 11, 12, unreadable_label(3), 14]
    assert torch.equal(batch[0], batch[1]) and torch.equal(batch[3], batch[1])  # the first readable one
    for position in (1, 2, 4):  # as the loader decodes (PIL) and transforms it
        expected, _ = prepare(photos[position], 0, position, transform)
        # On average within 0.02 normalised units (about a level of 255): two libjpeg builds' decodes differ
        # most along the red corner's sharp edge (up to 0.26 there). Turned wrong, the sideways one is 0.8 off.
        assert (batch[position] - expected).abs().mean() < 0.02


@pytest.mark.unit
def test_a_batch_with_no_readable_image_gets_blank_stand_ins():
    images, labels = encoded([b"\xff\xd8\xff" + b"not a JPEG body" * 4, b""])
    batch, batch_labels = ToDevice(torch.device("cpu"), transform=train_transform(16))(images, labels)
    blank = eval_transform(16)(Image.new("RGB", (8, 8)))
    assert batch_labels.tolist() == [unreadable_label(0), unreadable_label(1)]
    assert batch.shape == (2, 3, 16, 16) and torch.equal(batch[0], blank) and torch.equal(batch[1], blank)


@pytest.mark.unit
def test_the_device_path_turns_jpegs_by_the_tag_pil_reads_in_exif_or_xmp():
    plain = Image.fromarray(np.zeros((30, 40, 3), dtype=np.uint8))
    with_xmp = io.BytesIO()
    plain.save(with_xmp, "JPEG", xmp=b'<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>')
    jpegs = [image_bytes("RGB", "JPEG"), photo_bytes(40, 30, seed=0, orientation=3), with_xmp.getvalue()]
    assert [jpeg_orientation(encoded_tensor(jpeg)) for jpeg in jpegs] == [1, 3, 6]


@pytest.mark.unit
def test_the_transform_runs_per_image_only_to_size_the_images(monkeypatch):
    transform = train_transform(16)
    calls = {type(step).__name__: 0 for step in transform.transforms}

    def counted(step):
        def forward(*inputs):
            calls[type(step).__name__] += 1
            return type(step).forward(step, *inputs)
        return forward

    for step in transform.transforms:
        monkeypatch.setattr(step, "forward", counted(step))
    images, labels = encoded([photo_bytes(w, h, seed) for seed, (w, h) in enumerate(PHOTO_SIZES)])
    ToDevice(torch.device("cpu"), transform=transform)(images, labels)
    # Converted and normalised once for the batch of 8; cropped per image (its own draws), not through
    # the steps' calls, which check their inputs each time; the flips drawn per image, applied at once.
    assert calls == {"PILToTensor": 0, "RandomResizedCrop": 0, "RandomHorizontalFlip": 0, "ToDtype": 1, "Normalize": 1}


@pytest.mark.unit
def test_a_transform_with_a_step_the_device_does_not_batch_is_refused():
    jitter = v2.Compose([v2.PILToTensor(), v2.Resize(16), v2.ColorJitter(0.2), v2.ToDtype(torch.float32, scale=True)])
    with pytest.raises(TypeError, match="ColorJitter.*decode_on='loader'"):
        ToDevice(torch.device("cpu"), transform=jitter)
    flipped_first = v2.Compose([v2.RandomHorizontalFlip(), v2.RandomResizedCrop(16)])
    with pytest.raises(TypeError, match=r"another order: \['RandomHorizontalFlip', 'RandomResizedCrop'\]"):
        ToDevice(torch.device("cpu"), transform=flipped_first)


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
    train, val = batch_inputs(TrainingConfig(channels_last=True, decode_on="device", image_size=32), Preprocessing(),
                              torch.device("cpu"))
    assert train.memory_format == val.memory_format == torch.contiguous_format
    assert train.transform is not None and val.transform is not None
    train, _ = batch_inputs(TrainingConfig(channels_last=True, image_size=16), Preprocessing(), torch.device("cpu"))
    uint8_batch = torch.zeros(2, 3, 16, 16, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    images, _ = train(uint8_batch, torch.tensor([0, 1]))  # a loader's batch: finished on the rank, laid out for the CPU
    assert images.dtype == torch.float32 and images.is_contiguous() and images.min() < 0


@pytest.mark.unit
@pytest.mark.gpu
def test_gpu_ranks_decode_with_nvjpeg_in_bfloat16_channels_last():
    device = torch.device("cuda:0")
    log = logging.getLogger("test")
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert autocast_dtype(TrainingConfig(), device, log) == expected
    assert autocast_dtype(TrainingConfig(amp_dtype="float16"), device, log) == torch.float16
    jpeg = torch.frombuffer(bytearray(image_bytes("RGB", "JPEG")), dtype=torch.uint8)
    train, _ = batch_inputs(TrainingConfig(decode_on="device", image_size=16), Preprocessing(), device)
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
