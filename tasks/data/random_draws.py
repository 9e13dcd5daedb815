"""RandomResizedCrop's box and RandomHorizontalFlip's coin, drawn as torchvision draws them, for less.

Both paths that crop images one by one, the loaders' (`loader_steps.LoaderSteps`) and the rank's
decode on its device (`device_batches.BatchTransform`), draw each image's box and flip from torch's
CPU generator, so that a seed gives the transform's own crops (tests/test_uint8_batches.py). Through
torchvision's transforms the box cost about 60-90 us and the flip 35-50, most of it inspecting the
input and allocating tensors: 2-5% of a loader's decode and steps, and on the device path a rank's
one decode thread's time at thousands of images a second (bench/RESULTS.md, "The input pipeline on
a noisy machine"). Here the same calls are made on the same generator, in the same order, on tensors
of the same dtype (`uniform_` and `exp_` on one of the default float dtype, `random_` on one int64,
as `torch.randint` does): the same numbers, in about half the time. A subclass of RandomResizedCrop
may draw otherwise: it keeps its own `make_params`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torchvision.transforms import v2

MAX_ATTEMPTS = 10  # RandomResizedCrop's tries at a box of its scale and ratio before its central fallback


def drawn_params(step: v2.Transform, image: torch.Tensor) -> dict[str, Any]:
    """`step.make_params([image])`: for RandomResizedCrop the box (top, left, height, width) it
    crops `image` to, drawn here; any other step (Resize, CenterCrop, a subclass) makes its own.

    >>> _ = torch.manual_seed(0)
    >>> step = v2.RandomResizedCrop(8)
    >>> box = drawn_params(step, torch.zeros(3, 30, 40))
    >>> _ = torch.manual_seed(0)
    >>> box == step.make_params([torch.zeros(3, 30, 40)])
    True
    """
    if type(step) is not v2.RandomResizedCrop:
        return dict(step.make_params([image]))
    height, width = image.shape[-2:]
    area = height * width
    low, high = step._log_ratio.tolist()  # its own bounds, in the dtype it made them in (not remade from `ratio`)
    draw, index = torch.empty(1), torch.empty(1, dtype=torch.int64)
    for _ in range(MAX_ATTEMPTS):
        target_area = area * draw.uniform_(step.scale[0], step.scale[1]).item()
        aspect_ratio = draw.uniform_(low, high).exp_().item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = int(index.random_(0, height - h + 1).item())
            left = int(index.random_(0, width - w + 1).item())
            return {"top": top, "left": left, "height": h, "width": w}
    return central_box(step, height, width)


def central_box(step: v2.RandomResizedCrop, height: int, width: int) -> dict[str, int]:
    """RandomResizedCrop's fallback where no drawn box fitted: the centre, at the nearest ratio it allows."""
    in_ratio = width / height
    if in_ratio < min(step.ratio):
        w, h = width, int(round(width / min(step.ratio)))
    elif in_ratio > max(step.ratio):
        w, h = int(round(height * max(step.ratio))), height
    else:
        w, h = width, height
    return {"top": (height - h) // 2, "left": (width - w) // 2, "height": h, "width": w}


def flips(step: v2.RandomHorizontalFlip) -> bool:
    """Whether `step` flips the image it is given: torchvision's coin, compared with p as it compares
    it (in the draw's dtype: float32, or float64 under that default dtype), read as a Python bool.

    >>> _ = torch.manual_seed(0)
    >>> [flips(v2.RandomHorizontalFlip()) for _ in range(4)]
    [True, False, True, True]
    """
    return not bool(torch.rand(1) >= step.p)
