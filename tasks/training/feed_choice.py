"""Where a rank decodes its images when training.decode_on="auto" (the default): in its loader
processes on the CPU, or on its GPU (docs/architecture.md, "Data: the feed chosen").

Which one keeps a GPU busy depends on what nothing in the config says: how many cores each
rank's loaders have, what an image costs them (a 256-px copy about 1 ms of a core, a 12-MP
photo 25-60 ms; bench/RESULTS.md) and how fast the model takes images (ResNet-50 on an H200
about 4,300 a second, a small model on a small GPU a few hundred). So before its first epoch
each CUDA rank measures the three on its own host (`measure_feed`): the model's training step
on a synthetic batch, the loaders' decode and augment of a few of the run's own images on one
core (as `prefect_ddp.tasks.training.decode_cost.probe_decode` times them), and the same images decoded and
transformed as a batch on the device (`ToDevice`). `choose_feed` then takes the feed that
trains more images a second, and says why. A rank without CUDA decodes in its loaders: on a
CPU device, decoding would take the rank's own core instead of its loaders'.

The estimate leans towards the loaders, whose pixels are exactly the CPU path's: it counts
the device's decode as added to its step (no overlap, though the decode runs a batch ahead on
a side stream), and the loaders' cost as their decode and augment alone (what fetching and
collating add is the per-epoch verdict's to show, tasks/training/step_times.py); and the
device must come out `DEVICE_MARGIN` ahead. It is measured once per rank setup (a gang that
re-forms measures again), not per epoch: epochs read from the byte cache's resized copies
cost the loaders less than the first, which this does not foresee.

Every step that measures leaves the run as it found it: torch's random generators forked (the
run's draws are the same as without the measurement), BatchNorm statistics and gradients
restored, nothing stepped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from prefect_ddp.tasks.data.dataset import SizedTransform, encoded_tensor
from prefect_ddp.tasks.data.device_batches import EncodedBatch, ToDevice, decode_on
from prefect_ddp.tasks.data.loader_steps import loader_steps
from prefect_ddp.tasks.data.loaders import Feed
from prefect_ddp.tasks.training.decode_cost import decodable, one_torch_thread, seconds_per_image

# The device must train this many times the loaders' images a second to be chosen (module docstring).
DEVICE_MARGIN = 1.1
FEED_PROBE_IMAGES = 8  # the run's own images timed on one core and on the device
TIMED_STEPS = 3  # of the model and of the device's decode, after one that warms them up


@dataclass(frozen=True)
class FeedMeasures:
    """What a rank measured, in seconds per image: the model's step, the loaders' decode and augment
    on one core, and the decode and transform as a batch on the device (None: it does not decode there)."""

    step_s: float
    loader_s: float
    device_s: float | None
    loader_processes: int


@dataclass(frozen=True)
class FeedChoice:
    """Where the rank decodes, and the sentence that says why."""

    decode_on: Feed
    why: str


def choose_feed(measured: FeedMeasures) -> FeedChoice:
    """The feed that trains more images a second (module docstring).

    The loaders feed `loader_processes` / `loader_s` images a second (the rank's own thread, between
    steps, where it has none); the device trains 1 / `step_s`, and decoding there too, 1 / (`step_s` +
    `device_s`).

    >>> choose_feed(FeedMeasures(step_s=0.0002, loader_s=0.025, device_s=0.00005, loader_processes=15)).decode_on
    'device'
    >>> choose_feed(FeedMeasures(step_s=0.002, loader_s=0.0025, device_s=0.00005, loader_processes=15)).decode_on
    'loader'
    """
    model_rate = 1 / measured.step_s
    processes = measured.loader_processes
    if processes:
        loader_rate = min(model_rate, processes / measured.loader_s)
        loaders = f"its {processes} loader process(es) decode and augment about {processes / measured.loader_s:,.0f}"
    else:
        loader_rate = 1 / (measured.step_s + measured.loader_s)
        loaders = f"the rank itself decodes and augments about {1 / measured.loader_s:,.0f}"
    cost = (f"{loaders} images a second ({measured.loader_s * 1e3:.2f} ms per image per core) and the model "
            f"trains {model_rate:,.0f} a second ({measured.step_s * 1e3:.3f} ms per image)")
    if measured.device_s is None:
        return FeedChoice("loader", f"{cost}; this rank cannot decode its JPEGs on its device.")
    device_rate = 1 / (measured.step_s + measured.device_s)
    device = f"decoding on the device ({measured.device_s * 1e3:.3f} ms per image) would train about {device_rate:,.0f}"
    if device_rate > DEVICE_MARGIN * loader_rate:
        return FeedChoice("device", f"{cost}; {device}, more than the loaders' {loader_rate:,.0f}.")
    return FeedChoice("loader", f"{cost}; {device}, not more than the loaders' {loader_rate:,.0f}.")


def measure_feed(model: nn.Module, inputs: ToDevice, transform: SizedTransform, images: list[bytes], batch_size: int,
                 image_size: int, amp_dtype: torch.dtype | None, loader_processes: int) -> FeedMeasures | None:
    """The rank's measures (module docstring) with its train `transform`, on the run's `images` as its
    loaders read them (the stored copies where they read shards stored resized); None where none of
    them decodes."""
    device = inputs.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # the run draws as without it
        step_s = model_step_seconds(model, inputs, batch_size, image_size, amp_dtype)
        loader_transform = loader_steps(transform)
        readable = decodable(images, loader_transform)
        if not readable:
            return None
        with one_torch_thread():
            loader_s = seconds_per_image(readable, loader_transform)
        device_s = device_decode_seconds(inputs, images, batch_size)
    return FeedMeasures(step_s, loader_s, device_s, loader_processes)


def model_step_seconds(model: nn.Module, inputs: ToDevice, batch_size: int, image_size: int,
                       amp_dtype: torch.dtype | None) -> float:
    """Seconds per image of the model's forward and backward on a synthetic batch on the rank's
    device, as the training pass runs them (autocast, memory format); the model left as it was
    (weights, BatchNorm statistics, gradients, mode). The optimizer's update is left out: nothing
    may step, and it is a small share of a step (bench/RESULTS.md, "GPU")."""
    device = inputs.device
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    grads = {param: None if param.grad is None else param.grad.clone() for param in model.parameters()}
    was_training = model.training
    images = torch.randn(batch_size, 3, image_size, image_size, device=device).contiguous(
        memory_format=inputs.memory_format)
    labels = torch.zeros(batch_size, dtype=torch.long, device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()

    model.train()
    try:
        seconds = timed(step, device)
    finally:
        for param, grad in grads.items():
            param.grad = grad
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])
        model.train(was_training)
    return seconds / batch_size


def device_decode_seconds(inputs: ToDevice, images: list[bytes], batch_size: int) -> float | None:
    """Seconds per image of decoding and transforming a batch of `images` (those the device decodes,
    repeated to `batch_size`) on the rank's device; None where it decodes none of them (a torchvision
    built without its GPU decoder). One the device refuses is left out rather than timed: it would
    fail the batched call and have every image of the batch decoded again one by one."""
    device = inputs.device
    tensors = [encoded_tensor(data) for data in images if data]
    decoded = decode_on(device, tensors, fall_back=False) if tensors else []
    readable = [data for data, image in zip(tensors, decoded) if image is not None]
    if not readable:
        return None
    batch = EncodedBatch([readable[number % len(readable)] for number in range(batch_size)], torch.arange(batch_size))
    labels = torch.zeros(batch_size, dtype=torch.long)
    return timed(lambda: inputs(batch, labels), device) / batch_size


def timed(work: Callable[[], object], device: torch.device) -> float:
    """Mean seconds of `work` over TIMED_STEPS runs, after one that warms it up (cuDNN's and nvjpeg's setup)."""
    work()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(TIMED_STEPS):
        work()
    synchronize(device)
    return (time.perf_counter() - started) / TIMED_STEPS


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
