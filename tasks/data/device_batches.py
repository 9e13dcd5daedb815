"""Getting a batch onto the rank's device: the copy, the memory format, and optionally the decode.

By default the DataLoader's processes decode and augment every image on the CPU and the
rank copies finished tensors to its device. A GPU can outrun the CPUs that feed it (one
ResNet-50 step on an H100 takes a few ms; decoding 256 photo-sized JPEGs on one core takes
about a second), so `training.decode_on="device"` moves the decode there instead: the
loader hands over each image's encoded bytes and the rank decodes the batch's JPEGs in one
call to torchvision's nvjpeg decoder (`torchvision.io.decode_jpeg(..., device="cuda")`).
Images that are not JPEGs (PNG, 16-bit, CMYK) are still decoded on the CPU by
`prefect_ddp.tasks.data.decoding.open_rgb`. nvjpeg ignores EXIF orientation, so each JPEG's
tag is read on the CPU (from its header) and applied to the decoded tensor (`upright`), as
`open_rgb` applies it on the CPU path.

The loader's transform then runs on the batch (`BatchTransform`), not image by image: only
the crop and resize are per image (the images differ in size until then); the flips are
applied to the stacked batch, and the dtype conversion and normalisation run once on it.
Image by image, each of the transform's steps costs the rank's thread a Python call and a
small kernel per image; batched, the same random draws (torch's CPU generator) make the same
tensors, and nothing is read back from the device.

An image whose decode fails there (or that is gone: its bytes arrive empty) is left out as
the loader leaves out those it decodes itself (prefect_ddp.tasks.data.dataset): a stand-in takes its place,
labelled with its position, which the encoded batch carries for that. What a decoder
accepts without an error is trained on as it decodes.

A pass takes its batches through `ToDevice.batches`, which decodes encoded ones a batch
ahead, on a thread and CUDA stream of their own, while the rank trains on the one before
(prefect_ddp.tasks.data.device_ahead).

The same code runs on a CPU device (decoding in the rank's process), which is how the
tests here exercise it; it only pays off on a GPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils.data import default_collate
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from prefect_ddp.tasks.data.dataset import (
    BLANK_SIDE,
    EncodedImage,
    decoded,
    unreadable_label,
)
from prefect_ddp.tasks.data.device_ahead import batches_ahead
from prefect_ddp.tasks.data.decoding import JPEG_MAGIC, exif_orientation, jpeg_header, upright
from prefect_ddp.tasks.data.loader_steps import BATCH_STEPS, ERASING_STEPS, device_steps
from prefect_ddp.tasks.data.random_draws import drawn_params, flips


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


def decode_on(device: torch.device, images: list[torch.Tensor], fall_back: bool = True) -> list[torch.Tensor | None]:
    """Upright uint8 CHW RGB tensors on `device`: JPEGs in one batched decode there, the rest on
    the CPU; None for an image that does not decode.

    A JPEG the device's decoder refuses is decoded on the CPU, as the loader would decode it
    (`fall_back`), so an image trains whichever feed the rank takes (decode_on="auto" may take
    either, tasks/training/feed_choice.py); without `fall_back` it is None, for a caller that
    asks what the device itself decodes."""
    is_jpeg = [bytes(data[:3].tolist()) == JPEG_MAGIC for data in images]
    jpegs = iter(decode_jpegs(device, [data for data, jpeg in zip(images, is_jpeg) if jpeg]))
    decoded = [upright_or_none(next(jpegs), jpeg_orientation(data)) if jpeg else decode_other(device, data)
               for data, jpeg in zip(images, is_jpeg)]
    if not fall_back:
        return decoded
    return [decode_other(device, data) if image is None and jpeg else image
            for image, data, jpeg in zip(decoded, images, is_jpeg)]


# Pixels decoded at once on the device (about 800 MB as uint8 RGB): a batch of 256 12-MP photos
# would otherwise be held whole at full size, 9 GB, beside the step's activations (device_ahead).
DECODE_PIXELS = 2**28


def pixel_chunks(images: list[torch.Tensor], pixels: int | None = None) -> list[list[torch.Tensor]]:
    """`images` in order, cut into runs of at most `pixels` pixels (DECODE_PIXELS) by their JPEG headers
    (at least one image a run; an image whose header does not say counts as none), so each run decodes
    and is sized before the next decodes.

    >>> [len(chunk) for chunk in pixel_chunks([torch.zeros(0, dtype=torch.uint8)] * 3, pixels=1)]
    [3]
    """
    pixels = DECODE_PIXELS if pixels is None else pixels
    chunks: list[list[torch.Tensor]] = [[]]
    held = 0
    for data in images:
        header = jpeg_header(data.numpy().data) if len(data) else None
        size = header.size[0] * header.size[1] if header is not None and header.size else 0
        if chunks[-1] and held + size > pixels:
            chunks.append([])
            held = 0
        chunks[-1].append(data)
        held += size
    return chunks


def jpeg_orientation(data: torch.Tensor) -> int | None:
    """The orientation tag of an encoded JPEG as `open_rgb` reads it (`exif_orientation`); None
    where `open_rgb` would refuse the JPEG for its header or PIL reads it as another format,
    whatever the device decoded: the image is then decoded as the loader decodes it, which decides
    as decode-check does."""
    try:
        return exif_orientation(data.numpy().tobytes())
    except Exception:  # any error of PIL's header reading means unreadable, as decode-check takes it
        return None


def upright_or_none(image: torch.Tensor | None, tag: int | None) -> torch.Tensor | None:
    """`upright`, passing over an image that did not decode or whose header PIL refuses (None)."""
    return None if image is None or tag is None else upright(image, tag)


def decode_other(device: torch.device, data: torch.Tensor) -> torch.Tensor | None:
    """An image that is not a JPEG, decoded on the CPU (`prefect_ddp.tasks.data.dataset.decoded`) and moved to `device`."""
    image = decoded(data.numpy().tobytes(), None)
    return image.to(device) if isinstance(image, torch.Tensor) else None


# The steps of a loader's transform (prefect_ddp.tasks.data.dataset) by where the device path runs
# them, in the order they must come: per image (sizing it), per image drawn and applied to the
# batch (the flip), per image after the flip (TrivialAugmentWide: the image is flipped first),
# on the stacked batch, and per image drawn with the sizing but applied to the finished batch
# (RandomErasing: torchvision's erases one box in every image of a batch given it whole).
# PILToTensor is left out: the decode made the tensor.
SIZING_STEPS = (v2.RandomResizedCrop, v2.Resize, v2.CenterCrop)
FLIP_STEPS = (v2.RandomHorizontalFlip,)
AUGMENT_STEPS = (v2.TrivialAugmentWide,)
STEP_GROUPS = (SIZING_STEPS, FLIP_STEPS, AUGMENT_STEPS, BATCH_STEPS, ERASING_STEPS)


def step_group(step: Callable[..., Any]) -> int:
    """Which of STEP_GROUPS `step` belongs to (its place in the order the steps must come)."""
    group = next((number for number, group in enumerate(STEP_GROUPS) if isinstance(step, group)), None)
    if group is None:
        allowed = ", ".join(kind.__name__ for group in STEP_GROUPS for kind in group)
        raise TypeError(f"Decoding on the device runs the loader's transform on a batch; it got a {type(step).__name__} "
                        f"step, and runs only these: PILToTensor, {allowed}. Give it a transform made of them "
                        "(train_transform, eval_transform), or decode in the loader (decode_on='loader').")
    return group


class Sized(NamedTuple):
    """An image sized for its batch (uint8 CHW on the device), whether the batch flips it, and
    the box each erasing step erases in it (None: that step leaves it whole)."""

    image: torch.Tensor
    flipped: bool
    erasures: tuple[dict[str, Any] | None, ...] = ()


def erasure(step: v2.RandomErasing, image: torch.Tensor) -> dict[str, Any] | None:
    """`step`'s draws for `image`, in RandomErasing's own order (whether, then where): the box to
    erase, or None. Only the image's shape counts, so the uint8 image draws what the finished one would."""
    if torch.rand(1) >= step.p:
        return None
    params: dict[str, Any] = step.make_params([image])
    return params


class BatchTransform:
    """A loader's transform (`train_transform`, `eval_transform`) run on a batch of decoded images,
    making the tensors it makes image by image (module docstring).

    Each image is sized by the transform's crop and resize steps, which draw their parameters
    as the transform does (`drawn_params`: its `make_params`, RandomResizedCrop's for less,
    from torch's CPU generator), and the flip is drawn after them, per image, as the transform draws it
    (`flips`): a seed gives the same crops and flips.
    The flips are then applied to the stacked batch at once, and so are the dtype conversion
    and normalisation. Nothing reads a value back from the device. The fine-tuning knobs'
    steps (training.trivial_augment, random_erasing) run per image: TrivialAugmentWide on the
    flipped image, RandomErasing's box drawn with the image's other draws and erased from the
    finished batch, so a seed still gives the tensors the transform gives image by image.

    >>> from prefect_ddp.tasks.data.dataset import eval_transform
    >>> batch = BatchTransform(eval_transform(8))
    >>> images = [batch.sized(torch.zeros(3, 12, 20, dtype=torch.uint8)) for _ in range(2)]
    >>> tuple(batch.finished(images, torch.contiguous_format).shape)
    (2, 3, 8, 8)
    """

    def __init__(self, transform: Callable[..., Any]) -> None:
        given: list[Any] = transform.transforms if isinstance(transform, v2.Compose) else [transform]
        steps = [step for step in given if not isinstance(step, v2.PILToTensor)]
        groups = [step_group(step) for step in steps]
        if groups != sorted(groups):
            raise TypeError(f"Decoding on the device sizes each image, then flips, then converts the batch; the "
                            f"transform's steps come in another order: {[type(step).__name__ for step in steps]}. "
                            "Order them so (as train_transform does), or decode in the loader (decode_on='loader').")
        self.sizing = [step for step, group in zip(steps, groups) if group == 0]
        self.flips = [step for step, group in zip(steps, groups) if group == 1]
        self.augments = [step for step, group in zip(steps, groups) if group == 2]
        self.batch_steps = [step for step, group in zip(steps, groups) if group == 3]
        self.erasing = [step for step, group in zip(steps, groups) if group == 4]

    def sized(self, image: torch.Tensor) -> Sized:
        """`image` (uint8 CHW) cropped and resized by the transform's steps, with its flip drawn
        (applied here where per-image steps follow it) and its erasures."""
        for step in self.sizing:
            image = step.transform(image, drawn_params(step, image))
        flipped = False
        for flip in self.flips:  # RandomHorizontalFlip's own draw: flipped when below p
            flipped ^= flips(flip)
        if self.augments:  # they see the image flipped, as the transform's do
            image, flipped = image.flip(-1) if flipped else image, False
            for step in self.augments:
                image = step(image)
        return Sized(image, flipped, tuple(erasure(step, image) for step in self.erasing))

    def finished(self, images: Sequence[Sized], memory_format: torch.memory_format) -> torch.Tensor:
        """`images` stacked in `memory_format`, the flips applied, then the transform's batch steps."""
        # Laid out on the uint8 stack, a quarter of the float batch's size; the steps keep the layout.
        batch = torch.stack([image.image for image in images]).contiguous(memory_format=memory_format)
        flipped = [image.flipped for image in images]
        if any(flipped):  # the choices are on the host: the mask is copied over, never read back
            mask = torch.tensor(flipped).to(batch.device, non_blocking=True).view(-1, 1, 1, 1)
            batch = torch.where(mask, batch.flip(-1), batch)
        for step in self.batch_steps:
            batch = step(batch)
        for index, image in enumerate(images):
            for step, box in zip(self.erasing, image.erasures):
                if box is not None:
                    batch[index] = step.transform(batch[index], box)
        return batch.contiguous(memory_format=memory_format)


def with_sized_stand_ins(images: list[Sized | None], blank: Callable[[], Sized]) -> list[Sized]:
    """`images` with each unreadable one (None) replaced as a loader's batch replaces it
    (`prefect_ddp.tasks.data.dataset.with_stand_ins`): by the batch's first readable image,
    flipped alike, or by `blank()` where none is readable."""
    stand_in = next((image for image in images if image is not None), None)
    if stand_in is None:
        stand_in = blank()
    return [stand_in if image is None else image for image in images]


class ToDevice:
    """Moves a loader's batches onto `device` and finishes them there: a uint8 batch is converted
    and normalised (the transform's DEVICE_STEPS, prefect_ddp.tasks.data.loader_steps), an encoded
    one decoded and transformed whole (`BatchTransform`).

    Args:
        device: the rank's device.
        channels_last: lay images out channels-last, to match a model converted with
            `model.to(memory_format=torch.channels_last)` (faster convolutions on tensor cores).
        transform: the loader's transform (`train_transform`, `eval_transform`), whose steps from
            the float conversion on run here on a uint8 batch, and all of which run on an encoded
            one. None: batches arrive finished (float), as a loader with the whole transform makes them.

    >>> images, labels = ToDevice(torch.device("cpu"))(torch.zeros(2, 3, 8, 8), torch.tensor([0, 1]))
    >>> tuple(images.shape), labels.tolist()
    ((2, 3, 8, 8), [0, 1])
    """

    def __init__(self, device: torch.device, channels_last: bool = False,
                 transform: Callable[..., Any] | None = None) -> None:
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.transform = transform
        self.batched = None if transform is None else BatchTransform(transform)
        self.finishing = None if transform is None else device_steps(transform)

    def __call__(self, images: torch.Tensor | EncodedBatch, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's images and labels on the device; an encoded image that does not decode is
        left out there: a stand-in labelled `unreadable_label(position)` takes its place."""
        if isinstance(images, EncodedBatch):
            return self.decoded(images, labels)
        finishing = self.finishing
        if (finishing is None) != images.is_floating_point():
            raise TypeError(f"ToDevice got a batch of {images.dtype} images {'without' if finishing is None else 'with'} "
                            "a transform to finish them: give it the loader's transform for uint8 batches "
                            "(loader_steps' output), none for batches the loader finished.")
        # Copied without blocking: a blocking copy would first wait for all the work queued on the
        # device (the previous step), which this batch's work could otherwise overlap.
        moved = images.to(self.device, non_blocking=True, memory_format=self.memory_format)
        labels = labels.to(self.device, non_blocking=True)
        if finishing is None:
            return moved, labels
        return finished_on_device(moved, finishing).contiguous(memory_format=self.memory_format), labels

    def batches(self, loader_batches: Iterable[Any]) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
        """Each of a loader's batches on the device, finished; encoded ones decoded a batch ahead
        on a thread and stream of their own (prefect_ddp.tasks.data.device_ahead). Close it when
        the pass ends early (`contextlib.closing`): that ends the thread.

        >>> to_device = ToDevice(torch.device("cpu"))
        >>> [labels.tolist() for _, labels in to_device.batches([(torch.zeros(1, 3, 2, 2), torch.tensor([7]))])]
        [[7]]
        """
        batches = iter(loader_batches)
        first = next(batches, None)
        if first is None:
            return
        following = itertools.chain([first], batches)
        if isinstance(first[0], EncodedBatch):
            yield from batches_ahead(following, self, self.device)
        else:
            yield from (self(images, labels) for images, labels in following)

    def decoded(self, images: EncodedBatch, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An encoded batch decoded, transformed and stacked on the device (module docstring)."""
        batched = self.batched
        if batched is None:
            raise TypeError("ToDevice got a batch of encoded images but has no transform to run after "
                            "decoding them: give it the loader's transform (decode_on='device').")
        sized = [None if image is None else batched.sized(image)
                 for chunk in pixel_chunks(images.data) for image in decode_on(self.device, chunk)]
        kept_labels = [label if image is not None else unreadable_label(position)
                       for image, label, position in zip(sized, labels.tolist(), images.positions.tolist())]
        ready = with_sized_stand_ins(sized, lambda: batched.sized(self.blank()))
        return (batched.finished(ready, self.memory_format),
                torch.tensor(kept_labels).to(self.device, non_blocking=True))

    def blank(self) -> torch.Tensor:
        """The black image `prefect_ddp.tasks.data.dataset.blank_image` starts from, decoded on the device."""
        return torch.zeros(3, BLANK_SIDE, BLANK_SIDE, dtype=torch.uint8, device=self.device)


def finished_on_device(batch: torch.Tensor, steps: list[Any]) -> torch.Tensor:
    """A uint8 batch through a transform's DEVICE_STEPS: the conversion and normalisation at once
    on the batch, RandomErasing image by image (it erases one box in every image of a batch given whole)."""
    for step in steps:
        if isinstance(step, v2.RandomErasing):
            batch = torch.stack([step(image) for image in batch])
        else:
            batch = step(batch)
    return batch
