"""What decoding costs this run, per image and per core: for a verdict that can say "decode-bound".

An input-bound verdict's usual advice (more loader workers, shards, the byte cache) cannot
close the gap that decoding camera originals opens: a 12-MP JPEG takes ~40-200 ms of a core
to decode and augment even at reduced size, a copy stored at 1.5x the crop ~2 ms
(docs/architecture.md, "Data: pre-resized shards"). So rank 0 times, once, after the first
epoch whose steps wait on data (`DecodeProbe`: a compute-bound run never pays for it, and a
storage fault at the start is the loaders' to report), the training transform on a few of
its own images as the run reads them, and on the same images as pre-resized shards would
store them (`prefect_ddp.tasks.data.decoding.stored_resized`).
With the step times' compute per image, that says how many cores a rank needs to keep its
device busy either way (`decode_verdict`).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from PIL import Image

from prefect_ddp.tasks.config import MAX_NUM_WORKERS
from prefect_ddp.tasks.data.dataset import decode_side, prepare
from prefect_ddp.tasks.data.decoding import stored_resized
from prefect_ddp.tasks.data.loaders import LoaderWorkers

PROBE_IMAGES = 3
# A rank's loader processes count as busy (the input CPU-bound) when decoding its images takes this
# share of their time.
CPU_BUSY = 0.7
# Decoding originals counts as what bounds the input when it costs this many times a pre-resized copy
# (and more than the model's compute per image: `DecodeCost.bounds`).
DECODE_BOUND = 3.0


@dataclass(frozen=True)
class DecodeCost:
    """Decode + augment seconds per image on one core, for the originals and for copies stored at `side`."""

    megapixels: float  # the probed originals' mean
    original_s: float
    resized_s: float
    side: int

    def keeps_busy(self, images_per_s: float, loader_processes: int) -> bool:
        """Whether decoding `images_per_s` keeps a rank's loader processes (its own process where it
        has none) busy: then its input is bound by its CPUs, not by the storage's round trips."""
        return self.original_s * images_per_s >= CPU_BUSY * max(1, loader_processes)

    def bounds(self, compute_s_per_image: float) -> bool:
        """Whether decoding is what starves the model: one core of it cannot keep up with the model's
        compute per image, and pre-resized copies would cost a third of it or less."""
        return (compute_s_per_image > 0 and self.original_s >= compute_s_per_image
                and self.original_s >= DECODE_BOUND * max(self.resized_s, 1e-6))


class DecodeProbe:
    """`probe_decode` of the images `fetch` gives, taken the first time it is called, then kept."""

    def __init__(self, fetch: Callable[[], list[bytes]], image_size: int, transform: Callable) -> None:
        self.fetch = fetch
        self.image_size = image_size
        self.transform = transform
        self._cost: DecodeCost | None = None
        self._taken = False

    def __call__(self) -> DecodeCost | None:
        if not self._taken:
            self._taken = True
            self._cost = probe_decode(self.fetch(), self.image_size, self.transform)
        return self._cost


def probe_decode(images: list[bytes], image_size: int, transform: Callable) -> DecodeCost | None:
    """The cost of `transform` on `images` (bytes as the run reads them) and on pre-resized copies; None
    when none of them decodes. One thread: a loader worker decodes on one core."""
    side = decode_side(image_size)
    readable = decodable(images, transform)
    if not readable:
        return None
    resized = [stored_resized(data, side).data or data for data in readable]
    with one_torch_thread():
        original_s, resized_s = (seconds_per_image(batch, transform) for batch in (readable, resized))
    return DecodeCost(megapixels=sum(megapixels(data) for data in readable) / len(readable),
                      original_s=original_s, resized_s=resized_s, side=side)


def decodable(images: list[bytes], transform: Callable) -> list[bytes]:
    """Those of `images` that decode, as the loader would take them."""
    return [data for data in images if prepare(data, 0, 0, transform)[0] is not None]


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread while the block runs, as in a loader process (forked workers run one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def seconds_per_image(images: list[bytes], transform: Callable) -> float:
    """CPU seconds of this thread per image for decoding and transforming `images`."""
    started = time.thread_time()
    for data in images:
        prepare(data, 0, 0, transform)
    return (time.thread_time() - started) / len(images)


def megapixels(data: bytes) -> float:
    with Image.open(io.BytesIO(data)) as image:
        return image.width * image.height / 1e6


def cores_needed(seconds_per_image: float, compute_s_per_image: float) -> int:
    """The cores that decode at `seconds_per_image` each as fast as the model takes images.

    >>> cores_needed(0.010, 0.001), cores_needed(0.001, 0.010)
    (10, 1)
    """
    return max(1, round(seconds_per_image / max(compute_s_per_image, 1e-6)))


def cpu_verdict(cost: DecodeCost, data_share: float, compute_s_per_image: float, loaders: LoaderWorkers) -> str:
    """The input-bound verdict when the rank's CPUs are what it waits for: its loader processes (or
    the rank itself, without any) are busy decoding, so only more of its cores, more cores per GPU,
    or less decoding per image would feed it faster.

    >>> cpu_verdict(DecodeCost(0.2, 0.005, 0.004, 96), 0.6, 0.0005, LoaderWorkers(1, "", 16))[:60]
    'CPU-bound: 60% of each step waits for data while its 1 loade'
    """
    needed = cores_needed(cost.original_s, compute_s_per_image) + 1  # and one for the rank itself
    busy = (f"its {loaders.workers} loader process(es) are busy decoding and augmenting" if loaders.workers
            else "the rank decodes and augments its batches itself")
    used = loaders.workers + 1
    usable = min(needed, loaders.cpus, MAX_NUM_WORKERS + 1)
    if used < usable:
        fix = f"it may use {loaders.cpus} and uses {used}: set training.num_workers={usable - 1}."
    elif used > MAX_NUM_WORKERS and loaders.cpus > used:
        fix = (f"it uses {used} of its {loaders.cpus}, the most training.num_workers allows ({MAX_NUM_WORKERS}): "
               "decode on the device (training.decode_on='device') or read pre-resized shards "
               "(training.images_per_shard).")
    else:
        fix = (f"it has {loaders.cpus}. Run fewer ranks per host, on hosts with more cores per GPU, or decode "
               "on the device (training.decode_on='device').")
    return (
        f"CPU-bound: {data_share:.0%} of each step waits for data while {busy}, "
        f"{cost.original_s * 1e3:.1f} ms per image per core. At this model's {compute_s_per_image * 1e3:.2f} ms "
        f"of compute per image a rank needs about {needed} cores (on a GPU host, {needed} per GPU) to keep its "
        f"device busy; {fix}"
    )


def decode_verdict(cost: DecodeCost, data_share: float, compute_s_per_image: float) -> str:
    """The input-bound verdict when decoding originals dominates: what it costs, what pre-resized shards
    would, and the cores a rank needs for this model either way."""
    def cores(seconds: float) -> str:
        count = cores_needed(seconds, compute_s_per_image)
        return f"{count} core{'s' if count > 1 else ''}"

    return (
        f"decode-bound: {data_share:.0%} of each step waits for data; the originals average "
        f"{cost.megapixels:.1f} MP and cost {cost.original_s * 1e3:.1f} ms per image per core to decode and "
        f"augment, copies stored at {cost.side} px about {cost.resized_s * 1e3:.1f} ms. At this model's "
        f"{compute_s_per_image * 1e3:.2f} ms of compute per image, a rank needs about {cores(cost.original_s)} "
        f"decoding originals, {cores(cost.resized_s)} reading pre-resized shards "
        "(training.images_per_shard; training.shard_side sets their size) or, from the second epoch on, "
        "the resized copies the byte cache keeps (training.cache_gb)."
    )
