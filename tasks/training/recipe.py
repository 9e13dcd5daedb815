"""The transfer-learning recipe that runs on every rank of the gang.

Read top to bottom like torchvision's reference `train.py`: `train_one_epoch`, `evaluate`
(the loaders are prefect_ddp.tasks.data.loaders'; the optimiser, its schedule and the
normalisation layers prefect_ddp.tasks.training.optimization's), then `set_up_rank`, `run_epoch` and
`train_classifier`, the per-rank entry point that `run_gang` calls. The loop does not care
about world size: at world size 1 there is no process group and the wrappers do nothing.

An image that turns out unreadable when a loader reads it (gone, or not decoding) holds
its place in its batch as a stand-in (prefect_ddp.tasks.data.dataset) that the loop masks out of the loss
and the counts (`readable_loss`), and is counted against data.max_unreadable_fraction
(prefect_ddp.tasks.training.unreadable).

Rank 0 writes a checkpoint (a plain dict: model, optimizer, lr_scheduler, scaler, epoch,
history, with the job's fingerprint: prefect_ddp.tasks.training.checkpoints) after every epoch; a re-formed gang
resumes from it, and only from its own job's. `model.pt` holds the best epoch's weights
(prefect_ddp.tasks.selection), not the last epoch's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, field_validator
from torch import nn
from torch.utils.data import DataLoader

from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.dataset import (
    eval_transform,
    train_transform,
)
from prefect_ddp.tasks.data.device_batches import ToDevice
from prefect_ddp.tasks.data.loader_leftovers import remove_dead_loader_folders
from prefect_ddp.tasks.data.loaders import RankData, rank_data
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.positioned_sampler import PositionedSampler
from prefect_ddp.tasks.training.decode_cost import PROBE_IMAGES, DecodeProbe
from prefect_ddp.tasks.data.splitting import Split
from prefect_ddp.tasks.data.storage import save_torch, write_json
from prefect_ddp.tasks.gang import (
    GangRegroup,
    RankContext,
    all_gather_strings,
    all_reduce_sum,
    sync_buffers,
    wrap_ddp,
)
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.reporting import (
    run_logger,
)
from prefect_ddp.tasks.selection import Selection, best_index, is_better
from prefect_ddp.tasks.tracking import TrackedRun
from prefect_ddp.tasks.training.champion import Champion, score_against_champion
from prefect_ddp.tasks.training.checkpoint_interval import CheckpointSchedule
from prefect_ddp.tasks.training.checkpoint_writer import BackgroundWriter, to_cpu
from prefect_ddp.tasks.training.checkpoints import (
    BestEpoch,
    Resumed,
    TrainingState,
    job_fingerprint,
    failures_seen,
    record_attempt,
)
from prefect_ddp.tasks.training.model import (
    WarmStart,
    build_model,
    download_weights,
    load_warm_start,
    model_card,
)
from prefect_ddp.tasks.training.optimization import (
    EffectiveRecipe,
    Warmup,
    build_optimizer,
    build_scheduler,
    frozen_batchnorm,
    frozen_random_backbone,
    keep_frozen_in_eval,
    scales_lr,
    step_scheduler,
    sync_batchnorm,
    warmup_epochs,
)
from prefect_ddp.tasks.training.pass_sums import PassSums
from prefect_ddp.tasks.training.progress import ProgressReporter
from prefect_ddp.tasks.training.rank_result import RankResult
from prefect_ddp.tasks.training.regrouping import EpochSoFar, Position, park_state
from prefect_ddp.tasks.training.step_times import (
    StepClock,
    epoch_timing,
    input_advice,
    gang_rows,
    live_text,
    split_rows,
    time_gradient_sync,
)
from prefect_ddp.tasks.training.unreadable import UnreadableLimit, UnreadableTally
from prefect_ddp.tasks.urls import child_url

CHECKPOINT = "checkpoint.pt"
ATTEMPTS = "attempts.json"


class TrainJob(BaseModel):
    """Everything a rank needs, as plain values: data, split, model and recipe."""

    source: Location
    output: Location  # url: this run's output folder
    manifest: Manifest
    split: Split
    model: ModelConfig
    training: TrainingConfig
    warm_start: WarmStart | None = None  # the deployment's kept model, resolved by the flow
    unreadable: UnreadableLimit = UnreadableLimit()  # decode-check's exclusions and data.max_unreadable_fraction
    tracked: TrackedRun | None = None  # the MLflow run rank 0 logs each epoch's metrics to
    champion: Champion | None = None  # the kept model to score beside this run's at the end

    @field_validator("source", "output")
    @classmethod
    def _plain_settings(cls, location: Location) -> Location:
        """A `DataLocation` block given here travels to the ranks as its plain settings only."""
        return location.plain()


@runtime_checkable
class EpochSampler(Protocol):
    """A sampler told each epoch, to shuffle it anew: a PositionedSampler, or a ShardLoader's."""

    def set_epoch(self, epoch: int) -> None: ...


def readable_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the batch's readable images, and how many there are.

    Stand-ins for unreadable images (negative labels, prefect_ddp.tasks.data.dataset) add nothing. They are
    masked, not cut out of the batch: no device sync, and a batch with none readable keeps
    its graph, so its zero loss still runs backward, and DDP's gradient all-reduce with it.
    """
    readable = labels >= 0
    losses = nn.functional.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    return torch.where(readable, losses, 0).sum(), readable.sum()


def train_one_epoch(
    model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler, inputs: ToDevice, amp_dtype: torch.dtype | None,
    on_step: Callable[[int, int], None] | None = None, clock: StepClock | None = None,
    warmup: Warmup | None = None, frozen: Sequence[nn.Module] = (), sums: PassSums | None = None,
    batches: Iterable[Any] | None = None,
) -> PassSums:
    """One pass over this rank's shard; returns the rank's local sums.

    `inputs` puts each batch of images on the rank's device (decoding it there when the
    loader hands over encoded images); `amp_dtype` None trains in full precision.
    `on_step(done, total)` is called after every optimizer step, for progress reports.
    `clock` is cut at each part of the step (prefect_ddp.tasks.training.step_times); the
    final mark counts the wait that ends the pass, so its parts add up to the pass.
    `warmup` scales each step's learning rate while it lasts; the BatchNorm layers in
    `frozen` stay in eval mode (prefect_ddp.tasks.training.optimization). `sums`: where to
    add the pass's sums (a new PassSums by default), for a caller that reads them mid-pass.
    `batches`: the loader's batches for this pass where the caller began them (an epoch started
    ahead, tasks/data/epoch_ahead.py); the loader's own otherwise.
    The loss is the mean over the batch's readable images; a batch with none still steps,
    with a zero loss: which batches hold readable images differs between ranks, and a rank
    that skipped its step would leave the others waiting in DDP's all-reduce.
    """
    model.train()
    keep_frozen_in_eval(frozen)
    sums = sums if sums is not None else PassSums()
    clock = clock or StepClock(inputs.device)
    clock.start()
    for step, (images, labels) in enumerate(loader if batches is None else batches, start=1):
        images, labels = inputs(images, labels)
        clock.mark("data")
        with torch.autocast(inputs.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images)
            loss_sum, readable = readable_loss(logits, labels)
        clock.mark("forward")
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss_sum / readable.clamp(min=1)).backward()
        clock.after_backward()
        if warmup:
            warmup.before_step(optimizer)
        scaler.step(optimizer)
        scaler.update()
        clock.mark("optimizer")
        sums.add(loader, logits, labels, loss_sum, readable)
        if on_step:
            on_step(step, len(loader))
        clock.mark("other")
    clock.mark("data")  # the wait for the loader to say the pass is over
    if warmup:
        warmup.end_epoch(optimizer)
    return sums


@torch.inference_mode()
def evaluate(model: nn.Module, loader: DataLoader, inputs: ToDevice,
             on_batch: Callable[[int, int], None] | None = None) -> PassSums:
    """This rank's shard of the val set, in full precision; returns the rank's local sums.

    `on_batch(done, total)` is called after every batch, for progress reports: a pass over
    a large validation set lasts far longer than a rank may be silent (`validate`).
    """
    model.eval()
    sums = PassSums()
    for done, (images, labels) in enumerate(loader, start=1):
        images, labels = inputs(images, labels)
        logits = model(images)
        sums.add(loader, logits, labels, *readable_loss(logits, labels))
        if on_batch:
            on_batch(done, len(loader))
    return sums


def validate(ctx: RankContext, model: nn.Module, loader: DataLoader, inputs: ToDevice, epoch: int) -> PassSums:
    """`evaluate`, telling the supervisor after every batch and leaving if the gang is being stopped.

    Without a report per batch, a validation pass longer than the hang limit allows was
    taken for a hang on every attempt (docs/architecture.md, "Gang: progress").
    """
    ctx.progress("validation", epoch=epoch + 1)
    return evaluate(model, loader, inputs, on_batch=partial(between_batches, ctx, epoch))


def between_batches(ctx: RankContext, epoch: int, done: int, total: int) -> None:
    """After every validation batch: tell the supervisor, leave if the gang is being stopped."""
    ctx.progress("validation", epoch=epoch + 1, step=done)
    ctx.check_stop()


def autocast_dtype(cfg: TrainingConfig, device: torch.device, log: Any) -> torch.dtype | None:
    """The autocast type, or None for full precision (amp off, or a rank without CUDA)."""
    if not cfg.amp or device.type != "cuda":
        return None
    if cfg.amp_dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        log.warning("training.amp_dtype=bfloat16, but %s has no bfloat16 support (it needs Ampere or "
                    "newer): using float16 with loss scaling instead.", torch.cuda.get_device_name(device))
        return torch.float16
    return getattr(torch, cfg.amp_dtype)


def batch_inputs(cfg: TrainingConfig, device: torch.device) -> tuple[ToDevice, ToDevice]:
    """How train and val batches reach the device: copied as decoded, or decoded and transformed there."""
    channels_last = cfg.channels_last and device.type == "cuda"
    on_device = cfg.decode_on == "device"
    return (ToDevice(device, channels_last, train_transform(cfg.image_size) if on_device else None),
            ToDevice(device, channels_last, eval_transform(cfg.image_size) if on_device else None))


class BestWeights:
    """Rank 0's `model.pt`: the weights of the best epoch so far (prefect_ddp.tasks.selection), with its card.

    So that the model a run ships, a sweep points at and promotion compares is the epoch the
    reports call best, also when later epochs got worse or a sweep pruned the run. An epoch
    that beats the best before it is copied into memory, and written right after the next
    checkpoint, by the same writer (tasks/training/checkpoint_writer.py): model.pt never
    holds an epoch that the last checkpoint's history lacks, so a gang re-formed from that
    checkpoint agrees with model.pt about which epoch is best, also when checkpoints skip
    epochs (`training.checkpoint_every="auto"`). A crash between the checkpoint and model.pt
    leaves model.pt one best behind, so the checkpoint carries what model.pt is to hold: its
    own weights when its epoch is the best, or else the kept best epoch's (`unwritten`), and
    a gang resumed from it writes model.pt again (`after_resume`). Weights an elastic gang's
    formation took over in memory (tasks/gang/handover.py) wait for its first checkpoint too:
    that formation may be lost before it, and the gang then resumes from the older checkpoint.
    """

    def __init__(self, ctx: RankContext, job: TrainJob, selection: Selection, options: dict[str, Any]) -> None:
        self.ctx = ctx
        self.enabled = ctx.is_main
        # In an elastic gang every rank keeps the unwritten best weights: any survivor may hand its state over.
        self.keeps = ctx.is_main or ctx.elastic
        self.job = job
        self.selection = selection
        self.options = options  # the output's, as rank_data derived them
        self.best: float | None = None
        self.epoch: int | None = None  # the best epoch so far, counted from 1: model.pt's once written
        self._unwritten: tuple[int, dict[str, torch.Tensor]] | None = None  # (epoch, its weights)

    def after_resume(self, model: nn.Module, resumed: Resumed) -> None:
        """The best epoch of the history resumed, and its weights where model.pt may lack them:
        given to the writer by `write_after_checkpoint`, or carried by the next checkpoint or park."""
        history = resumed.history
        if not history:
            return
        values = [h[self.selection.metric] for h in history]
        best = best_index(values, self.selection.direction)
        self.best, self.epoch = values[best], history[best]["epoch"]
        if best == len(history) - 1 and resumed.position == 0:  # mid-epoch, the model is past that epoch
            self._keep(model)
        elif self.keeps and resumed.best and resumed.best[0] == self.epoch:
            self._unwritten = resumed.best

    def after_epoch(self, model: nn.Module, record: dict[str, Any]) -> None:
        value = record[self.selection.metric]
        if not is_better(value, self.best, self.selection.direction):
            return
        self.best, self.epoch = value, record["epoch"]
        self._keep(model)

    def _keep(self, model: nn.Module) -> None:
        if self.keeps and self.epoch is not None:
            self._unwritten = (self.epoch, to_cpu(model.state_dict()))

    def unwritten(self, epoch: int | None) -> BestEpoch | None:
        """The kept best epoch's weights for the checkpoint of `epoch` (counted from 1; None: a
        state parked mid-epoch, whose weights are no recorded epoch's) to carry: None when
        model.pt has them already, or they are that checkpoint's own."""
        if self._unwritten is None or self._unwritten[0] == epoch:
            return None
        return self._unwritten

    def waiting(self) -> bool:
        """Whether a best epoch's weights wait for a checkpoint to hold them before model.pt may."""
        return self._unwritten is not None

    def write_after_checkpoint(self, writer: BackgroundWriter) -> None:
        """Give the writer the best epoch kept since the last checkpoint, to write after it (rank 0)."""
        if self._unwritten is None or not self.enabled:
            return
        epoch, weights = self._unwritten
        self._unwritten = None
        writer.submit(f"model.pt (epoch {epoch})", lambda: self._write(epoch, weights))

    def _write(self, epoch: int, weights: dict[str, torch.Tensor]) -> None:
        job = self.job
        save_torch(child_url(job.output.url, "model.pt"), weights, self.options,
                   on_part=lambda: self.ctx.progress("checkpoint", epoch=epoch))
        card = model_card(job.model, job.manifest.classes, job.training.image_size)
        write_json(child_url(job.output.url, "model.json"), card | {
            "epoch": epoch, "selected_by": self.selection.describe(),
            "split": job.split.record(job.manifest)}, self.options)


def between_steps(ctx: RankContext, progress: ProgressReporter, clock: StepClock, batch_size: int, started: float,
                  position: Position, grow: GrowChecks | None, sums: PassSums, epoch: int, done: int,
                  total: int) -> None:
    """After every optimizer step: note how far the rank got, tell the supervisor, leave if the
    gang is being stopped or regroups larger here, move the bar."""
    position.stepped(epoch, done * batch_size)
    ctx.progress("step", epoch=epoch + 1, step=done)
    ctx.check_stop()
    if grow:
        grow.after_step(done, total, sums)
    progress.step(epoch, done, total,
                  lambda: live_text(clock.totals(), done * batch_size, time.monotonic() - started))


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

    @property
    def device(self) -> torch.device:
        return self.train_inputs.device


def set_up_rank(ctx: RankContext, job: TrainJob, log: Any) -> RankSetup:
    """The model (warm-started if asked) on the rank's device, its optimizer, schedule and loaders."""
    device = torch.device(ctx.device)
    amp_dtype = autocast_dtype(job.training, device, log)
    train_inputs, val_inputs = batch_inputs(job.training, device)
    # A download says how it gets on, so its time does not count against the start's allowance.
    download_weights(job.model, partial(ctx.progress, "download"))
    ctx.progress("data")
    data = rank_data(ctx, job.source, job.output, job.manifest, job.split, job.training)
    log.log(logging.INFO if ctx.is_main else logging.DEBUG, "Loader processes per loader of rank %d: %d (%s).",
            ctx.rank, data.loader_workers.workers, data.loader_workers.why)
    model = build_model(job.model, len(job.manifest.classes), data.source_options)
    if job.warm_start:
        load_warm_start(model, job.warm_start)
    if (reason := frozen_random_backbone(job.model, job.warm_start is not None)) and ctx.is_main:
        log.warning(reason)
    synced = job.training.sync_batchnorm and sync_batchnorm(model, device, ctx.world_size, log)
    # Module.to's documented forms take a device or a memory_format, not both in one call.
    model = model.to(device).to(memory_format=train_inputs.memory_format)
    optimizer = build_optimizer(model, job.training, ctx.world_size)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    state = TrainingState(model, optimizer, build_scheduler(optimizer, job.training), scaler)
    advice = input_advice(job.training, from_object_store="://" in job.manifest.root,
                          loader_processes=data.loader_workers.workers)
    warm_epochs = warmup_epochs(job.training, ctx.world_size)
    scaled_by = ctx.world_size if scales_lr(job.training) else 1
    warmup = Warmup(warm_epochs * len(data.train), start=1 / scaled_by if scaled_by > 1 else 0.0)
    frozen = frozen_batchnorm(model)
    recipe = EffectiveRecipe(
        lr=optimizer.param_groups[0]["lr"], lr_scaled_by=scaled_by,
        warmup_epochs=warm_epochs, weight_decay=job.training.weight_decay, frozen_batchnorm=len(frozen),
        sync_batchnorm=synced)
    return RankSetup(state, data, train_inputs, val_inputs, amp_dtype, StepClock(device), advice,
                     decode_probe(ctx, job, data, log),
                     job.training.batch_size, warmup, frozen, recipe)


def decode_probe(ctx: RankContext, job: TrainJob, data: RankData, log: Any) -> DecodeProbe | None:
    """Rank 0's measure of what decoding this run's training images costs, taken when an epoch is
    input-bound (prefect_ddp.tasks.training.decode_cost); None on other ranks and where the run does
    not decode originals on its CPUs (`RankData.decodes_originals`)."""
    cfg = job.training
    if not ctx.is_main or not data.decodes_originals:
        return None
    positions = job.split.train[:PROBE_IMAGES]

    def fetch() -> list[bytes]:
        try:
            images = data.images.dataset(positions, None).fetch(range(len(positions)))
        except OSError as exc:  # the loaders meet the storage's trouble and say so; the verdict goes without
            log.debug("Could not fetch images to time their decoding: %s", exc)
            return []
        return [image for image in images if image]

    return DecodeProbe(fetch, cfg.image_size, train_transform(cfg.image_size))


def run_epoch(ctx: RankContext, rank: RankSetup, ddp_model: nn.Module, progress: ProgressReporter,
              unreadable: UnreadableTally, position: Position, epoch: int,
              start: int = 0, grow: GrowChecks | None = None,
              next_epoch: int | None = None) -> tuple[dict[str, Any], int]:
    """Train and validate one epoch, from global sample position `start` (an elastic gang's
    formation that took over mid-epoch); returns the gang's record of it and the images this
    rank trained on. `next_epoch`: the epoch the run trains after this one, if any, whose loading
    starts while this one validates.

    The record's `time` is where the gang's time went (prefect_ddp.tasks.training.step_times):
    every rank's row of it travels in the same all-reduce as the metrics. An epoch taken over
    mid-epoch says where (`taken_over_at_sample`) and counts the images the formation before
    trained in `train_samples`; its losses and accuracies cover them too where that formation
    left whole, to grow (its sums carried in `position`), else only the part trained here.
    """
    started = time.monotonic()
    assert isinstance(rank.data.train.sampler, EpochSampler), "rank_data's train loaders sample by epoch"
    train = PassSums()
    on_step = partial(between_steps, ctx, progress, rank.clock, rank.batch_size, started, position, grow, train,
                      epoch)
    train_one_epoch(ddp_model, rank.data.train, rank.state.optimizer, rank.state.scaler,
                    rank.train_inputs, rank.amp_dtype, on_step=on_step, clock=rank.clock,
                    warmup=rank.warmup, frozen=rank.frozen, sums=train,
                    batches=rank.data.train_epochs.batches(epoch, start))
    trained_at = time.monotonic()
    if next_epoch is not None:  # its first batches load while this epoch validates (tasks/data/epoch_ahead.py)
        rank.data.train_epochs.start(next_epoch)
    sync_buffers(rank.state.model)
    val = validate(ctx, rank.state.model, rank.data.val, rank.val_inputs, epoch)
    sums = [*train.sums(), *val.sums()]
    rows = gang_rows(rank.clock.totals(), time.monotonic() - trained_at, trained_at - started, int(train.count),
                     ctx.rank, ctx.world_size)
    totals = all_reduce_sum([*sums, *rows], rank.device)
    carried = position.carried if start else None  # the formations before's part of the epoch (regrouping.Position)
    if carried:
        for index, part in enumerate(carried.sums):
            totals[index] += part
    record = epoch_record(epoch, totals[:len(sums)], rank.state.optimizer, time.monotonic() - started)
    timing = epoch_timing(split_rows(totals[len(sums):]), rank.input_advice, rank.decode_cost,
                          rank.data.loader_workers)
    record["time"] = timing.model_dump()
    record["images_per_s"] = timing.images_per_s
    record["data_wait_pct"] = round(100 * timing.shares["data"], 1)
    met = train.unreadable | val.unreadable | set(carried.unreadable if carried else ())
    record["unreadable"] = unreadable.pool(met, record["epoch"])  # first met this epoch
    if start:  # taken over mid-epoch: the images before `start` without sums (a rank lost with them) counted too
        record["taken_over_at_sample"] = start
        record["train_samples"] += carried.uncounted if carried else start
    return record, int(train.count)


@dataclass
class Checkpointing:
    """Rank 0's checkpoints: taken when the schedule says, written in the background.

    A sweep's trial checkpoints every epoch and waits for the write before the epoch is
    reported to the study: Optuna keeps a reported value for good, so it must belong to
    weights that a re-formed gang resumes from, never to an epoch lost with a rank.
    """

    ctx: RankContext
    state: TrainingState
    schedule: CheckpointSchedule
    url: str
    options: dict[str, Any]
    fingerprint: dict[str, Any]

    def after_epoch(self, history: list[dict[str, Any]], writer: BackgroundWriter, kept: BestWeights,
                    last: bool) -> None:
        """On rank 0: raise a failed write, then checkpoint the epoch just recorded if it is due."""
        if not self.ctx.is_main:
            return
        writer.check()
        if self.schedule.due(history[-1]["seconds"], last):
            self.save(history, writer, kept)

    def save(self, history: list[dict[str, Any]], writer: BackgroundWriter, kept: BestWeights) -> None:
        """Checkpoint the epochs of `history`, then model.pt's new best after it; the schedule
        learns the seconds training waited for the copy (δ)."""
        started = time.monotonic()
        writer.wait()  # the writes before: one snapshot in memory at a time, and a failed write raised here
        self.ctx.check_lease()  # a rank whose gang no longer holds its worker copies nothing (the writer checks again)
        epoch = history[-1]["epoch"]
        snapshot = self.state.snapshot(epoch - 1, history, self.fingerprint, self.ctx.world_size,
                                       best=kept.unwritten(epoch))
        writer.submit(f"the checkpoint of epoch {epoch}", lambda: save_torch(
            self.url, snapshot, self.options, on_part=lambda: self.ctx.progress("checkpoint", epoch=epoch)))
        kept.write_after_checkpoint(writer)
        if self.ctx.trial is not None:
            writer.wait()
        self.schedule.saved(time.monotonic() - started)


@dataclass
class Leaving:
    """How a rank of an elastic gang leaves its formation: its state parked for the next one
    (tasks/training/regrouping.py); a fixed-size gang's ranks park nothing."""

    ctx: RankContext
    state: TrainingState
    position: Position
    sampler: Any
    history: list[dict[str, Any]]
    fingerprint: dict[str, Any]
    warmup: Warmup
    kept: BestWeights

    def regroup(self, progress: ProgressReporter, trained: EpochSoFar | None) -> NoReturn:
        """Asked to regroup larger, at an epoch's end or mid-epoch: park, and leave for the larger formation."""
        sample = self.position.global_position(self.sampler)
        where = (f"after epoch {self.position.epoch}" if not sample
                 else f"at sample {sample} of epoch {self.position.epoch + 1}")
        said = (f"A worker came free: the gang of {self.ctx.world_size} ranks forms again larger {where}, "
                "its state kept in memory")
        progress.note(self.position.epoch + (sample / self.sampler.size if sample else 0), said)
        run_logger().log(logging.INFO if self.ctx.is_main else logging.DEBUG, said)
        self._park(trained)
        raise GangRegroup(f"rank {self.ctx.rank} regroups {where}")

    def after_failure(self) -> None:
        """A peer was lost, or this rank failed: park what the survivors may hand over (best effort);
        before its first step a formation passes on what it took over whole."""
        if self.ctx.elastic:
            self._park(self.position.carried if self.position.samples == 0 else None)

    def _park(self, trained: EpochSoFar | None = None) -> None:
        # Mid-epoch the model has moved past every recorded epoch: kept best weights go along whatever their epoch.
        own = self.position.epoch if self.position.global_position(self.sampler) == 0 else None
        best = self.kept.unwritten(own)
        park_state(self.ctx, self.state, self.position, self.sampler, self.history, self.fingerprint, self.warmup,
                   best, trained)


@dataclass
class GrowChecks:
    """Where an elastic gang's ranks ask whether to regroup larger (tasks/gang/resizing.py): after
    every `every` optimizer steps of an epoch (0: never mid-epoch) and at the end of each epoch
    but the last. Every rank asks at the same step (`regroup_requested` is a collective: rank 0
    reads the flag, all get its answer), so all leave together, or none. Each ask costs one
    one-integer broadcast; the flag itself is read at most once a second (bench/RESULTS.md,
    bench.elastic's boundary part)."""

    ctx: RankContext
    leaving: Leaving
    progress: ProgressReporter
    writer: BackgroundWriter
    every: int
    epochs: int

    @classmethod
    def of(cls, ctx: RankContext, cfg: TrainingConfig, leaving: Leaving, progress: ProgressReporter,
           writer: BackgroundWriter) -> GrowChecks | None:
        """None for a fixed-size gang; mid-epoch asks only where a formation can take over mid-epoch
        (a PositionedSampler: tar shards' epochs start only at their beginning)."""
        if not ctx.elastic:
            return None
        every = cfg.regroup_every_steps if isinstance(leaving.sampler, PositionedSampler) else 0
        return cls(ctx, leaving, progress, writer, every, cfg.epochs)

    def after_step(self, done: int, total: int, sums: PassSums) -> None:
        """Mid-epoch: the epoch's train sums and unreadable images so far go along, gathered over
        the whole gang (every rank is here), so the epoch's record covers every image of it."""
        if self.every and done % self.every == 0 and done < total and self.ctx.regroup_requested():
            position = self.leaving.position
            # From a failure: the images up to its start counted, without sums.
            before = position.carried or EpochSoFar(uncounted=position.start)
            self._leave(before.plus(all_reduce_sum(sums.sums(), self.ctx.device),
                                    all_gather_strings(sorted(sums.unreadable), self.ctx.device)))

    def after_epoch(self, epoch: int) -> None:
        if epoch < self.epochs - 1 and self.ctx.regroup_requested():
            self._leave(None)

    def _leave(self, trained: EpochSoFar | None) -> NoReturn:
        self.writer.wait()  # a failed write fails the rank here, not unseen in the regroup
        self.leaving.regroup(self.progress, trained)


def train_classifier(ctx: RankContext, job: TrainJob) -> RankResult:
    """Per-rank entry point: train, validate, checkpoint; rank 0 keeps the best epoch's model.

    Every rank stops early together when a sweep prunes the run, or when too many images
    turn out unreadable (prefect_ddp.tasks.training.unreadable): it then returns why, for the flow to fail with.
    """
    rank = set_up_rank(ctx, job, run_logger())
    model, state = rank.state.model, rank.state
    output = rank.data.output_options
    checkpoint_url = child_url(job.output.url, "checkpoints", CHECKPOINT)
    fingerprint = job_fingerprint(job.manifest.classes, job.split.digest(job.manifest), job.model, job.training)
    kept = BestWeights(ctx, job, ctx.trial.selection if ctx.trial else Selection(), output)
    handed = ctx.hand_over(rank.device) if ctx.elastic else None  # a survivor's state, in memory
    resumed = state.resume(checkpoint_url, output, fingerprint, ctx.world_size, scales_lr(job.training), rank.device,
                           handed=handed.data if handed else None)
    start_epoch, history, start_position = resumed.next_epoch, resumed.history, resumed.position
    carried = EpochSoFar.from_dict(resumed.trained) if resumed.trained else None
    kept.after_resume(model, resumed)
    del resumed  # the best epoch's weights it may carry: kept by `kept` alone
    # Where the rank is, and its way out of an elastic gang's formation: from here on, a failure
    # parks the state for the next formation (the one handed over, until a step is taken).
    position = Position(start_epoch, start=start_position, carried=carried)
    leaving = Leaving(ctx, state, position, rank.data.train.sampler, history, fingerprint, rank.warmup, kept)
    try:
        return train_formation(ctx, job, rank, kept, position, leaving, history, handed is not None,
                               (checkpoint_url, fingerprint))
    except GangRegroup:
        raise
    except BaseException:
        leaving.after_failure()
        raise


def train_formation(ctx: RankContext, job: TrainJob, rank: RankSetup, kept: BestWeights, position: Position,
                    leaving: Leaving, history: list[dict[str, Any]], handed: bool,
                    checkpoint: tuple[str, dict[str, Any]]) -> RankResult:
    """train_classifier's epochs on this formation of the gang, from `position` on."""
    log = run_logger()
    # Rank 0 speaks for the gang; the others log at debug so the run's log stays readable.
    level = logging.INFO if ctx.is_main else logging.DEBUG
    model, state, output = rank.state.model, rank.state, rank.data.output_options
    checkpoint_url, fingerprint = checkpoint
    start_epoch, start_position = position.epoch, position.start
    # A resumed run's warmup is behind it, as far as it got.
    rank.warmup.done = start_epoch * len(rank.data.train) + start_position // (rank.batch_size * ctx.world_size)
    ddp_model = wrap_ddp(model, rank.device)
    time_gradient_sync(ddp_model, rank.clock)
    unreadable = UnreadableTally(job.unreadable, job.manifest, rank.device, announce=ctx.is_main)
    unreadable.after_resume(history)
    if handed:
        log.log(level, "Rank %d took over epoch %d at sample %d from the state a rank of the gang's last "
                "formation kept in memory; the checkpoint was not read", ctx.rank, start_epoch + 1, start_position)
    elif start_epoch:
        log.log(level, "Rank %d resumed from %s after epoch %d", ctx.rank, checkpoint_url, start_epoch)
    attempts = record_attempt(child_url(job.output.url, "checkpoints", ATTEMPTS), output, ctx.attempt + 1,
                              ctx.world_size, start_epoch, start_position, handed, ctx.regroups) if ctx.is_main else []
    schedule = CheckpointSchedule.for_run(job.training, failures=failures_seen(attempts, ctx.attempt, ctx.regroups),
                                          history=history,
                                          every_epoch=ctx.trial is not None)
    saves = Checkpointing(ctx, state, schedule, checkpoint_url, output, fingerprint)
    progress = ProgressReporter(ctx, job.training.epochs, log, job.tracked)
    if handed:
        progress.note(start_epoch + start_position / len(job.split.train), f"The gang went on with {ctx.world_size} "
                      f"ranks at epoch {start_epoch + 1}, sample {start_position}, from the state a rank kept in memory")
    local_train_samples: list[int] = []
    # Per epoch trained here, outside the record (which the checkpoint holds): the seconds training
    # waited for rank 0's copies to memory and writes; the wait for the last writes joins the last.
    checkpoint_s: list[float] = []
    pruned_at = stopped = None
    # Right before each write, in the writing thread: a rank whose gang lost its worker writes nothing more.
    with BackgroundWriter(before_write=ctx.check_lease if ctx.is_main else lambda: None) as writer:
        if not handed:  # a resumed best epoch model.pt may lack; one handed over waits for a checkpoint to hold it
            kept.write_after_checkpoint(writer)
        grow = GrowChecks.of(ctx, job.training, leaving, progress, writer)
        try:
            for epoch in range(start_epoch, job.training.epochs):
                record, trained = run_epoch(ctx, rank, ddp_model, progress, unreadable, position, epoch,
                                            start=start_position if epoch == start_epoch else 0, grow=grow,
                                            next_epoch=epoch + 1 if epoch + 1 < job.training.epochs else None)
                stopped = unreadable.exceeded(record["epoch"])  # the gang's count: every rank stops here, or none
                if stopped:
                    log.log(level, "Stopped after epoch %d, keeping nothing of it: %s", record["epoch"], stopped)
                    break
                local_train_samples.append(trained)
                step_scheduler(state.scheduler, record["val_loss"])
                history.append(record)
                position.epoch_done(epoch)
                log.log(level, "epoch %d/%d %s", record["epoch"], job.training.epochs, record)
                ctx.progress("checkpoint", epoch=record["epoch"])
                waiting = time.monotonic()
                kept.after_epoch(model, record)
                saves.after_epoch(history, writer, kept, last=epoch == job.training.epochs - 1)
                checkpoint_s.append(round(time.monotonic() - waiting, 3))  # rank 0's; the others write none
                if ctx.is_main:
                    progress.epoch_done(history)
                if ctx.report(record["epoch"], record):  # a sweep's pruner stops every rank here
                    pruned_at = record["epoch"]
                    log.log(level, "Pruned by the sweep after epoch %d", pruned_at)
                    break
                if grow:
                    grow.after_epoch(epoch)
            if ctx.is_main and kept.waiting() and not (pruned_at or stopped):  # taken over after the last epoch
                saves.save(history, writer, kept)
            waiting = time.monotonic()
            # The last checkpoint and model.pt exist once the ranks return; the champion's scoring reads model.pt.
            ctx.wait_for_main(writer.finished)
            writer.wait()
            if checkpoint_s:
                checkpoint_s[-1] = round(checkpoint_s[-1] + time.monotonic() - waiting, 3)
        finally:
            progress.close()
            rank.data.train_epochs.close()  # its loader processes stop now, busy or not
            remove_dead_loader_folders()  # a killed peer's orphaned loader processes have exited by now
    # Every rank agrees on pruned_at and stopped: all score, or none does.
    comparison = (score_against_champion(ctx, job.champion, job.output.url, rank.data, rank.device, kept.epoch)
                  if job.champion and kept.epoch and not (pruned_at or stopped) else None)
    return RankResult(
        rank=ctx.rank,
        worker_address=ctx.worker_address,
        split_digest=job.split.digest(job.manifest),
        local_train_samples=local_train_samples,
        checkpoint_s=checkpoint_s,
        checkpoints=schedule.decisions,
        history=history,
        best_epoch=kept.epoch,
        selected_by=kept.selection.describe(),
        pruned_at=pruned_at,
        attempts=attempts,
        unreadable=unreadable.summary(),
        stopped=stopped,
        recipe=rank.recipe,
        comparison=comparison,
    )


def epoch_record(epoch: int, totals: list[float], optimizer, seconds: float) -> dict[str, Any]:
    """One epoch's metrics over the whole gang (from all-reduced sums)."""
    train_loss, train_correct, train_count, val_loss, val_correct, val_count = totals
    return {
        "epoch": epoch + 1,  # counted from 1, as the logs and reports show it
        "train_loss": train_loss / max(train_count, 1),
        "train_acc": train_correct / max(train_count, 1),
        "val_loss": val_loss / max(val_count, 1),
        "val_acc": val_correct / max(val_count, 1),
        "train_samples": int(train_count),
        "val_samples": int(val_count),
        "lr": optimizer.param_groups[0]["lr"],
        "seconds": round(seconds, 2),
    }

