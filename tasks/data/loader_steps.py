"""A transform split where the batch leaves the loader: uint8 images out of the loaders, the
float conversion and normalisation on the rank's device (docs/architecture.md, "Data: uint8 batches").

A loader process used to hand over float32 images, normalised: four bytes a value to convert,
normalise, stack into shared memory, pin and copy, where the decoded image has one. The
loaders now run a transform's steps only up to `DEVICE_STEPS` (`loader_steps`): decode, crop,
resize, flip, TrivialAugmentWide, all on uint8; the rank's `ToDevice` runs the rest on the
batch (prefect_ddp.tasks.data.device_batches). The pixels are the transform's own, the same
values image by image (tests/test_uint8_batches.py); only RandomErasing's draws move from the
loader process's generator to the rank's.

Images are laid out channels-last all the way: a decoder writes HWC, torch's uint8 resize is
fastest on channels-last input, and the batch is stacked as NHWC, the layout a GPU rank's
model takes (training.channels_last), so nothing is transposed on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate
from torchvision.transforms import InterpolationMode, v2

from prefect_ddp.tasks.data.dataset import SizedTransform
from prefect_ddp.tasks.data.random_draws import drawn_params, flips

# The steps that run on the rank's device on a loader's uint8 batch: the float conversion and the
# normalisation, on the whole batch, and RandomErasing, which erases the normalised image, image by
# image. Once one comes, all that follow must. (The device decode path groups its steps by them too.)
BATCH_STEPS = (v2.ToDtype, v2.Normalize)
ERASING_STEPS = (v2.RandomErasing,)
DEVICE_STEPS = BATCH_STEPS + ERASING_STEPS


class LoaderSteps(SizedTransform):
    """The steps of a transform that a loader runs, on a decoded uint8 CHW image (`decoded_tensor`).

    Each runs on the image as a batch of one laid out channels-last, so torch's resize reads and
    writes that layout (about 0.2 ms an image less than on a CHW crop here); RandomResizedCrop
    draws its box as the transform does (`drawn_params`, the numbers of its `make_params`), then crops
    and resizes in two kernels, as torchvision's `resized_crop` does, and RandomHorizontalFlip its
    coin (`flips`). Returns the image CHW, a view of HWC memory.
    """

    def forward(self, *inputs: Any) -> Any:
        image: torch.Tensor = inputs[0].unsqueeze(0)
        for step in self.transforms:
            if isinstance(step, v2.RandomResizedCrop):
                image = resized_crop(step, image)
            elif type(step) is v2.RandomHorizontalFlip:  # its coin drawn as its forward draws it (random_draws)
                image = image.flip(-1) if flips(step) else image
            elif isinstance(step, v2.Resize):  # a turned image is not channels-last: its resize would not be
                image = step(image.contiguous(memory_format=torch.channels_last))
            else:
                image = step(image)
        return image[0]


def resized_crop(step: v2.RandomResizedCrop, image: torch.Tensor) -> torch.Tensor:
    """`step` on a batch of one: its box drawn as it draws it (`drawn_params`), the crop copied
    channels-last (a copy even where the box spans the whole width and the view is channels-last
    already: its batch stride is then not its size, and torch would lay the resize out NCHW), then
    resized (`resized`)."""
    box = drawn_params(step, image)
    crop = image[..., box["top"]:box["top"] + box["height"], box["left"]:box["left"] + box["width"]]
    return resized(crop.clone(memory_format=torch.channels_last), list(step.size), step.interpolation,
                   step.antialias)


def resized(crop: torch.Tensor, size: list[int], interpolation: Any, antialias: bool | None) -> torch.Tensor:
    """`v2.functional.resize(crop, size, interpolation, antialias=antialias)` of `resized_crop`'s
    copy (a channels-last batch of one) to a (height, width) `size`.

    Where torchvision resizes a uint8 CPU image bilinear with antialiasing in uint8 itself
    (`native_uint8_bilinear`), the loaders' usual crop, the crop goes straight to the `interpolate`
    call its resize ends in, with the arguments it passes: the same kernel, the same pixels and
    layout (tests/test_uint8_batches.py), without its dispatch and checks, 0.94-0.96x the loader
    path's CPU on 500x375 photos (bench/RESULTS.md, "The loaders' resize"). Any other goes through
    torchvision's resize.
    """
    if (crop.dtype == torch.uint8 and crop.device.type == "cpu" and interpolation == InterpolationMode.BILINEAR
            and antialias and native_uint8_bilinear()):
        return torch.nn.functional.interpolate(crop, size=size, mode="bilinear", align_corners=False, antialias=True)
    same: torch.Tensor = v2.functional.resize(crop, size, interpolation, antialias=antialias)
    return same


@functools.cache
def native_uint8_bilinear() -> bool:
    """Whether torchvision's resize runs torch's uint8 bilinear kernel itself on this CPU (AVX2,
    AVX512, ARM; elsewhere it resizes in float and rounds, other pixels by one level), asked of
    torchvision once a process (the CPU's capability is fixed at torch's start); False where
    this torchvision has no such check to ask, so that its resize decides."""
    check = getattr(v2.functional._geometry, "_do_native_uint8_resize_on_cpu", None)
    return bool(check(InterpolationMode.BILINEAR)) if check else False


def split_at_device(transform: Callable[..., Any]) -> tuple[list[Any], list[Any]]:
    """A transform's steps before DEVICE_STEPS (PILToTensor left out: the decode made the tensor)
    and from them on; a TypeError naming the steps where another step follows a device step."""
    steps = [step for step in (transform.transforms if isinstance(transform, v2.Compose) else [transform])
             if not isinstance(step, v2.PILToTensor)]
    first = next((at for at, step in enumerate(steps) if isinstance(step, DEVICE_STEPS)), len(steps))
    loader, device = steps[:first], steps[first:]
    if any(not isinstance(step, DEVICE_STEPS) for step in device):
        raise TypeError(f"The loaders hand over uint8 images and the rank converts and normalises them, so a "
                        f"transform's {', '.join(kind.__name__ for kind in DEVICE_STEPS)} steps must come last; "
                        f"got {[type(step).__name__ for step in steps]}. Put the uint8 steps first (as "
                        "train_transform does).")
    return loader, device


def loader_steps(transform: SizedTransform) -> LoaderSteps:
    """The part of `transform` (`train_transform`, `eval_transform`) that the loaders run, needing
    the same decoded side.

    >>> from prefect_ddp.tasks.data.dataset import eval_transform
    >>> steps = loader_steps(eval_transform(8))
    >>> [type(step).__name__ for step in steps.transforms], steps.decode_side
    (['Resize', 'CenterCrop'], 9)
    """
    return LoaderSteps(split_at_device(transform)[0], transform.decode_side)


def device_steps(transform: Callable[..., Any]) -> list[Any]:
    """The part of `transform` that the rank runs on a loader's uint8 batch (DEVICE_STEPS)."""
    return split_at_device(transform)[1]


def collate_images(samples: Sequence[tuple[torch.Tensor, int]], shared: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of uint8 images stacked as NHWC memory (in a loader process into shared memory, as
    torch's `default_collate` stacks; in its own memory where not `shared`, for a batch that crosses
    the process's pipe, prefect_ddp.tasks.data.pipe_handover), returned NCHW channels-last, with the labels.

    >>> images, labels = collate_images([(torch.zeros(3, 4, 5, dtype=torch.uint8), 1)] * 2)
    >>> tuple(images.shape), images.is_contiguous(memory_format=torch.channels_last), labels.tolist()
    ((2, 3, 4, 5), True, [1, 1])
    """
    nhwc = [image.permute(1, 2, 0) for image, _ in samples]
    images = default_collate(nhwc) if shared else torch.stack(nhwc)
    labels: torch.Tensor = default_collate([label for _, label in samples])
    return images.permute(0, 3, 1, 2), labels
