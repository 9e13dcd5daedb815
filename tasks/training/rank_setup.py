"""A rank set up to train: the model (warm-started if asked) on its device, its optimizer,
schedule and loaders, and how batches reach the device.

The loaders are tasks/data/loaders.py's; the optimiser, its schedule and the normalisation
layers tasks/training/optimization.py's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data.dataset import eval_transform, train_transform_for
from prefect_ddp.tasks.data.decoding import stored_resized
from prefect_ddp.tasks.data.device_batches import ToDevice
from prefect_ddp.tasks.data.loader_steps import loader_steps
from prefect_ddp.tasks.data.loaders import Feed, RankData, rank_data
from prefect_ddp.tasks.data.preprocessing import Preprocessing
from prefect_ddp.tasks.data.shard_writer import shard_format
from prefect_ddp.tasks.gang import RankContext
from prefect_ddp.tasks.training.checkpoints import TrainingState
from prefect_ddp.tasks.training.decode_cost import PROBE_IMAGES, DecodeProbe
from prefect_ddp.tasks.training.feed_choice import FEED_PROBE_IMAGES, choose_feed, measure_feed
from prefect_ddp.tasks.training.job import TrainJob
from prefect_ddp.tasks.training.model import build_model, download_weights, load_warm_start
from prefect_ddp.tasks.training.optimization import (
    EffectiveRecipe,
    Warmup,
    build_optimizer,
    build_scheduler,
    frozen_batchnorm,
    frozen_random_backbone,
    scales_lr,
    sync_batchnorm,
    warmup_epochs,
)
from prefect_ddp.tasks.training.step_knobs import StepKnobs
from prefect_ddp.tasks.training.step_times import StepClock, input_advice
from prefect_ddp.tasks.training.weights_average import weights_average


def autocast_dtype(cfg: TrainingConfig, device: torch.device, log: Any) -> torch.dtype | None:
    """The autocast type, or None for full precision (amp off, or a rank without CUDA)."""
    if not cfg.amp or device.type != "cuda":
        return None
    if cfg.amp_dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        log.warning("training.amp_dtype=bfloat16, but %s has no bfloat16 support (it needs Ampere or "
                    "newer): using float16 with loss scaling instead.", torch.cuda.get_device_name(device))
        return torch.float16
    return getattr(torch, cfg.amp_dtype)


def batch_inputs(cfg: TrainingConfig, preprocessing: Preprocessing, device: torch.device) -> tuple[ToDevice, ToDevice]:
    """How train and val batches reach the device and are finished there: uint8 batches converted
    and normalised, encoded ones (decode_on="device") decoded and transformed whole."""
    channels_last = cfg.channels_last and device.type == "cuda"
    return (ToDevice(device, channels_last, train_transform_for(cfg, preprocessing)),
            ToDevice(device, channels_last, eval_transform(cfg.image_size, preprocessing)))


@dataclass
class RankSetup:
    """A rank's recipe, set up: what a checkpoint holds, the data, and how batches reach the device."""

    state: TrainingState  # its model is the unwrapped one: checkpoints, model.pt and validation use it
    data: RankData  # its loaders, the images read outside them and the storage options, from one call
    train_inputs: ToDevice
    val_inputs: ToDevice
    amp_dtype: torch.dtype | None
    clock: StepClock
    input_advice: str  # what would feed this run's ranks faster, for an input-bound verdict
    decode_cost: DecodeProbe | None  # rank 0's: what decoding the run's images costs, for the verdict
    batch_size: int
    warmup: Warmup
    frozen: list[nn.Module]  # BatchNorm layers kept in eval mode
    recipe: EffectiveRecipe
    knobs: StepKnobs  # what a training step does beyond plain cross-entropy

    @property
    def device(self) -> torch.device:
        return self.train_inputs.device


def set_up_rank(ctx: RankContext, job: TrainJob, log: Any) -> RankSetup:
    """The model (warm-started if asked) on the rank's device, its optimizer, schedule and loaders."""
    device = torch.device(ctx.device)
    amp_dtype = autocast_dtype(job.training, device, log)
    train_inputs, val_inputs = batch_inputs(job.training, job.preprocessing, device)
    # A download says how it gets on, so its time does not count against the start's allowance.
    download_weights(job.model, partial(ctx.progress, "download"))
    ctx.progress("data")
    data = rank_data(ctx, job.source, job.output, job.manifest, job.split, job.training, job.preprocessing)
    model = build_model(job.model, len(job.manifest.classes), data.source_options, job.training.image_size,
                        job.training.drop_path)
    if job.warm_start:
        load_warm_start(model, job.warm_start)
    if (reason := frozen_random_backbone(job.model, job.warm_start is not None)) and ctx.is_main:
        log.warning(reason)
    # Module.to's documented forms take a device or a memory_format, not both in one call.
    model = model.to(device).to(memory_format=train_inputs.memory_format)
    # Measured before SyncBatchNorm: its training-mode forward runs collectives, and a rank whose
    # measure failed would leave the others waiting in them.
    if job.training.decode_on == "auto" and chosen_feed(ctx, job, data, model, train_inputs, amp_dtype, log) == "device":
        data = rank_data(ctx, job.source, job.output, job.manifest, job.split, job.training, job.preprocessing,
                         decode_on="device")
    say_loader_processes(ctx, job, data, log)
    synced = job.training.sync_batchnorm and sync_batchnorm(model, device, ctx.world_size, log)
    optimizer = build_optimizer(model, job.training, ctx.world_size)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    state = TrainingState(model, optimizer, build_scheduler(optimizer, job.training), scaler,
                          weights_average(model, job.training.ema_decay))
    advice = input_advice(job.training, from_object_store="://" in job.manifest.root,
                          loader_processes=data.loader_workers.workers, cached=data.cache.keeps_every_image)
    warm_epochs = warmup_epochs(job.training, ctx.world_size)
    scaled_by = ctx.world_size if scales_lr(job.training) else 1
    warmup = Warmup(warm_epochs * len(data.train), start=1 / scaled_by if scaled_by > 1 else 0.0)
    frozen = frozen_batchnorm(model)
    recipe = EffectiveRecipe(
        lr=max(group["lr"] for group in optimizer.param_groups), lr_scaled_by=scaled_by,
        warmup_epochs=warm_epochs, weight_decay=job.training.weight_decay, frozen_batchnorm=len(frozen),
        sync_batchnorm=synced, knobs=job.training.knobs_set())
    return RankSetup(state, data, train_inputs, val_inputs, amp_dtype, StepClock(device), advice,
                     decode_probe(ctx, job, data, log),
                     job.training.batch_size, warmup, frozen, recipe,
                     StepKnobs.of(job.training, len(job.manifest.classes)))


def say_loader_processes(ctx: RankContext, job: TrainJob, data: RankData, log: Any) -> None:
    """The loader processes the rank's feed starts, and why; a limit of the host that leaves the rank
    loading its own batches is a warning (the run goes on slowly), as is each of the run's own
    settings past a limit of the host. Then the byte cache they read through, and why."""
    chosen = data.loader_workers
    starved = chosen.workers == 0 and chosen.cpus > 1 and job.training.num_workers is None
    log.log((logging.WARNING if starved else logging.INFO) if ctx.is_main else logging.DEBUG,
            "Loader processes per loader of rank %d: %d (%s).", ctx.rank, chosen.workers, chosen.why)
    for warning in chosen.warnings:
        log.log(logging.WARNING if ctx.is_main else logging.DEBUG, "Rank %d: %s", ctx.rank, warning)
    log.log(logging.INFO if ctx.is_main else logging.DEBUG, "Byte cache of rank %d: %s.", ctx.rank, data.cache.why)


def chosen_feed(ctx: RankContext, job: TrainJob, data: RankData, model: nn.Module, inputs: ToDevice,
                amp_dtype: torch.dtype | None, log: Any) -> Feed:
    """Where this rank decodes under training.decode_on="auto", measured on its host and said in
    the log (tasks/training/feed_choice.py). `data` are its loaders as built for the loader feed."""
    def said(feed: Feed, why: str) -> Feed:
        place = "on the rank's device, a batch ahead" if feed == "device" else "in the loader processes"
        log.log(logging.INFO if ctx.is_main else logging.DEBUG,
                "Rank %d decodes its training images %s (training.decode_on='auto'): %s", ctx.rank, place, why)
        return feed

    if inputs.device.type != "cuda":
        return said("loader", f"it runs on {inputs.device.type}, where decoding on the device would take the "
                              "rank's own core instead of its loaders'.")
    cfg = job.training
    images = as_the_loaders_read(cfg, fetched(data, job.split.train[:FEED_PROBE_IMAGES], log))
    try:
        measured = measure_feed(model, inputs, train_transform_for(cfg, job.preprocessing), images, cfg.batch_size,
                                cfg.image_size, amp_dtype, data.loader_workers.workers)
    except Exception as exc:  # the measure is the run's own extra: its failure leaves the feed that needs none
        torch.cuda.empty_cache()
        log.warning("Rank %d could not time its feeds (%s: %s); it decodes in its loader processes.",
                    ctx.rank, type(exc).__name__, exc)
        return "loader"
    if measured is None:
        return said("loader", f"none of the {len(images)} images fetched to time the decode decoded.")
    choice = choose_feed(measured)
    return said(choice.decode_on, choice.why)


def as_the_loaders_read(cfg: TrainingConfig, images: list[bytes]) -> list[bytes]:
    """`images` as stored, or as the shards store them where the loaders read shards stored resized
    (training.images_per_shard, shard_side, shard_quality)."""
    fmt = shard_format(cfg)
    if not fmt.images_per_shard or not fmt.side:
        return images
    return [stored_resized(data, fmt.side, fmt.quality).data or data for data in images]


def fetched(data: RankData, positions: list[int], log: Any) -> list[bytes]:
    """The training images at `positions`, as stored; those the storage does not give are left out
    (the loaders meet the storage's trouble and say so; a measure goes without them).

    Read in the rank's own process, so through s3fs (object_reads.fetch_objects): obstore started
    here would leave every loader process forked after it (on a GPU, where decode_on="auto"
    measures before the loaders start: all of them) reading with s3fs, at about 1 ms more CPU
    per image (docs/architecture.md, "Facts: storage clients").
    """
    try:
        images = data.images.dataset(positions, None).fetch(range(len(positions)))
    except OSError as exc:
        log.debug("Could not fetch images to time their decoding: %s", exc)
        return []
    return [image for image in images if image]


def decode_probe(ctx: RankContext, job: TrainJob, data: RankData, log: Any) -> DecodeProbe | None:
    """Rank 0's measure of what decoding this run's training images costs, taken when an epoch is
    input-bound (tasks/training/decode_cost.py); None on other ranks and where the run does
    not decode originals on its CPUs (`RankData.decodes_originals`)."""
    cfg = job.training
    if not ctx.is_main or not data.decodes_originals:
        return None
    positions = job.split.train[:PROBE_IMAGES]
    return DecodeProbe(partial(fetched, data, positions, log), cfg.image_size,
                       loader_steps(train_transform_for(cfg, job.preprocessing)))
