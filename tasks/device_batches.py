"""Getting a batch onto the rank's device: the copy, the memory format, and optionally the decode.

By default the DataLoader's processes decode and augment every image on the CPU and the
rank copies finished tensors to its device. A GPU can outrun the CPUs that feed it (one
ResNet-50 step on an H100 takes a few ms; decoding 256 photo-sized JPEGs on one core takes
about a second), so `training.decode_on="device"` moves the decode there instead: the
loader hands over each image's encoded bytes and the rank decodes the batch's JPEGs in one
call to torchvision's nvjpeg decoder (`torchvision.io.decode_jpeg(..., device="cuda")`),
then augments on the GPU with the same torchvision transforms. Images that are not JPEGs
(PNG, 16-bit, CMYK) are still decoded on the CPU by `tasks.dataset.open_rgb`.

The same code runs on a CPU device (decoding in the rank's process), which is how the
tests here exercise it; it only pays off on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.data import default_collate
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from tasks.dataset import open_rgb

JPEG_MAGIC = b"\xff\xd8\xff"


def encoded_collate(batch: Sequence[tuple[torch.Tensor, int]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Keep the encoded images as a list: their lengths differ, so they cannot be stacked."""
    return [data for data, _ in batch], default_collate([label for _, label in batch])


def decode_on(device: torch.device, images: list[torch.Tensor]) -> list[torch.Tensor]:
    """uint8 CHW RGB tensors on `device`: JPEGs in one batched decode there, the rest on the CPU."""
    is_jpeg = [bytes(data[:3].tolist()) == JPEG_MAGIC for data in images]
    jpegs = [data for data, jpeg in zip(images, is_jpeg) if jpeg]
    decoded = iter(decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device) if jpegs else [])
    return [
        next(decoded) if jpeg else v2.functional.pil_to_tensor(open_rgb(data.numpy().tobytes())).to(device)
        for data, jpeg in zip(images, is_jpeg)
    ]


class ToDevice:
    """Moves (and, for encoded batches, decodes and transforms) a loader's images onto `device`.

    Args:
        device: the rank's device.
        channels_last: lay images out channels-last, to match a model converted with
            `model.to(memory_format=torch.channels_last)` (faster convolutions on tensor cores).
        transform: for encoded batches, the per-image transform to run on the device after
            decoding (the loader's own transform when it decodes). None: batches arrive decoded.
    """

    def __init__(self, device: torch.device, channels_last: bool = False, transform: Callable | None = None) -> None:
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.transform = transform

    def __call__(self, images: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        if self.transform is None:
            return images.to(self.device, non_blocking=True, memory_format=self.memory_format)
        batch = torch.stack([self.transform(image) for image in decode_on(self.device, images)])
        return batch.contiguous(memory_format=self.memory_format)
