"""Getting a batch onto the rank's device: the copy, the memory format, and optionally the decode.

By default the DataLoader's processes decode and augment every image on the CPU and the
rank copies finished tensors to its device. A GPU can outrun the CPUs that feed it (one
ResNet-50 step on an H100 takes a few ms; decoding 256 photo-sized JPEGs on one core takes
about a second), so `training.decode_on="device"` moves the decode there instead: the
loader hands over each image's encoded bytes and the rank decodes the batch's JPEGs in one
call to torchvision's nvjpeg decoder (`torchvision.io.decode_jpeg(..., device="cuda")`),
then augments on the GPU with the same torchvision transforms. Images that are not JPEGs
(PNG, 16-bit, CMYK) are still decoded on the CPU by `prefect_ddp.tasks.data.decoding.open_rgb`.
nvjpeg ignores EXIF orientation, so each JPEG's tag is read on the CPU (from its header) and
applied to the decoded tensor (`upright`), as `open_rgb` applies it on the CPU path.

An image whose decode fails there (or that is gone: its bytes arrive empty) is left out as
the loader leaves out those it decodes itself (prefect_ddp.tasks.data.dataset): a stand-in takes its place,
labelled with its position, which the encoded batch carries for that. What a decoder
accepts without an error is trained on as it decodes.

The same code runs on a CPU device (decoding in the rank's process), which is how the
tests here exercise it; it only pays off on a GPU.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from PIL import Image
from torch.utils.data import default_collate
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from prefect_ddp.tasks.data.dataset import (
    EncodedImage,
    blank_image,
    decoded,
    unreadable_label,
    with_stand_ins,
)
from prefect_ddp.tasks.data.decoding import orientation

JPEG_MAGIC = b"\xff\xd8\xff"


class EncodedBatch(NamedTuple):
    """A batch of encoded images (their lengths differ, so they stay a list) and their positions."""

    data: list[torch.Tensor]
    positions: torch.Tensor


def encoded_collate(batch: Sequence[tuple[torch.Tensor | EncodedImage, int]]) -> tuple[EncodedBatch, torch.Tensor]:
    """Keep the encoded images as a list, with their dataset positions beside them.

    The batch of a dataset with no transform (`EncodedImage`s); datasets are typed for either.
    """
    encoded = [image for image, _ in batch if isinstance(image, EncodedImage)]
    if len(encoded) != len(batch):
        raise TypeError(f"encoded_collate got {len(batch) - len(encoded)} decoded image(s) in a batch of {len(batch)}; "
                        "it collates encoded images only: give the dataset no transform (decode_on='device').")
    images = EncodedBatch([image.data for image in encoded], torch.tensor([image.position for image in encoded]))
    return images, default_collate([label for _, label in batch])


def decode_jpegs(device: torch.device, jpegs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """JPEGs decoded in one batched call on `device`; None for each that does not decode."""
    if not jpegs:
        return []
    try:
        images: list[torch.Tensor | None] = decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device)
        return images
    except RuntimeError:  # torchvision's error for a truncated or corrupt JPEG fails the call: find which
        if len(jpegs) == 1:
            return [None]
        return [image for jpeg in jpegs for image in decode_jpegs(device, [jpeg])]


def decode_on(device: torch.device, images: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Upright uint8 CHW RGB tensors on `device`: JPEGs in one batched decode there, the rest on
    the CPU; None for an image that does not decode."""
    is_jpeg = [bytes(data[:3].tolist()) == JPEG_MAGIC for data in images]
    jpegs = iter(decode_jpegs(device, [data for data, jpeg in zip(images, is_jpeg) if jpeg]))
    return [upright(next(jpegs), jpeg_orientation(data)) if jpeg else decode_other(device, data)
            for data, jpeg in zip(images, is_jpeg)]


def jpeg_orientation(data: torch.Tensor) -> int:
    """The EXIF orientation tag of an encoded JPEG (1 when it has none or its header does not parse)."""
    try:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
            return orientation(image)
    except Exception:  # a header the decoder did not mind but PIL cannot read: leave the image as decoded
        return 1


# EXIF orientation -> the turns that make the stored image upright, as PIL's exif_transpose
# does: (quarter turns counter-clockwise, then mirror left-right).
UPRIGHT_TURNS = {1: (0, False), 2: (0, True), 3: (2, False), 4: (2, True),
                 5: (3, True), 6: (3, False), 7: (1, True), 8: (1, False)}


def upright(image: torch.Tensor | None, tag: int) -> torch.Tensor | None:
    """A decoded CHW image turned as its EXIF orientation `tag` says (`open_rgb` does the same on the CPU)."""
    if image is None:
        return None
    turns, mirror = UPRIGHT_TURNS.get(tag, (0, False))
    image = torch.rot90(image, turns, dims=(-2, -1)) if turns else image
    return image.flip(-1) if mirror else image


def decode_other(device: torch.device, data: torch.Tensor) -> torch.Tensor | None:
    """An image that is not a JPEG, decoded on the CPU (`prefect_ddp.tasks.data.dataset.decoded`) and moved to `device`."""
    image = decoded(data.numpy().tobytes(), None)
    return None if image is None else v2.functional.pil_to_tensor(image).to(device)


class ToDevice:
    """Moves (and, for encoded batches, decodes and transforms) a loader's batches onto `device`.

    Args:
        device: the rank's device.
        channels_last: lay images out channels-last, to match a model converted with
            `model.to(memory_format=torch.channels_last)` (faster convolutions on tensor cores).
        transform: for encoded batches, the per-image transform to run on the device after
            decoding (the loader's own transform when it decodes). None: batches arrive decoded.

    >>> images, labels = ToDevice(torch.device("cpu"))(torch.zeros(2, 3, 8, 8), torch.tensor([0, 1]))
    >>> tuple(images.shape), labels.tolist()
    ((2, 3, 8, 8), [0, 1])
    """

    def __init__(self, device: torch.device, channels_last: bool = False,
                 transform: Callable[..., Any] | None = None) -> None:
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.transform = transform

    def __call__(self, images: torch.Tensor | EncodedBatch, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's images and labels on the device; an encoded image that does not decode is
        left out there: a stand-in labelled `unreadable_label(position)` takes its place."""
        transform = self.transform
        if transform is None:
            if isinstance(images, EncodedBatch):
                raise TypeError("ToDevice got a batch of encoded images but has no transform to run after "
                                "decoding them: give it the loader's transform (decode_on='device').")
            return (images.to(self.device, non_blocking=True, memory_format=self.memory_format),
                    labels.to(self.device, non_blocking=True))
        if not isinstance(images, EncodedBatch):
            raise TypeError(f"ToDevice has a transform to run after decoding, so it takes encoded batches "
                            f"(encoded_collate's); got a {type(images).__name__}: give it no transform "
                            "for a loader that decodes.")
        samples: list[tuple[torch.Tensor | None, int]] = [
            (None, unreadable_label(position)) if image is None else (transform(image), label)
            for image, label, position in zip(decode_on(self.device, images.data), labels.tolist(),
                                              images.positions.tolist())
        ]
        ready = with_stand_ins(samples, lambda: blank_image(transform).to(self.device))
        batch = torch.stack([image for image, _ in ready]).contiguous(memory_format=self.memory_format)
        return batch, torch.tensor([label for _, label in ready], device=self.device)
