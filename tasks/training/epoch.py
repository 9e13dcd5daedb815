"""One epoch of a rank: train, validate, and the gang's record of it.

`run_epoch` passes over this rank's shard of the training images (tasks/training/passes.py),
calling the boundary's parts after every step, then validates, and adds every rank's sums and
step times up in one all-reduce: the record is the same on every rank.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Protocol, runtime_checkable

from torch import nn
from torch.utils.data import DataLoader

from prefect_ddp.tasks.data.device_batches import ToDevice
from prefect_ddp.tasks.gang import RankContext, all_reduce_sum, sync_buffers
from prefect_ddp.tasks.selection import Selection
from prefect_ddp.tasks.training.boundary import Boundaries, StepEnd
from prefect_ddp.tasks.training.heartbeats import beat
from prefect_ddp.tasks.training.pass_sums import PassSums
from prefect_ddp.tasks.training.passes import evaluate, train_one_epoch
from prefect_ddp.tasks.training.rank_setup import RankSetup
from prefect_ddp.tasks.training.regrouping import Position
from prefect_ddp.tasks.training.step_times import epoch_timing, gang_rows, split_rows
from prefect_ddp.tasks.training.unreadable import UnreadableTally
from prefect_ddp.tasks.training.weights_average import with_average

# The sums of the train and validation passes, in the order `epoch_record` reads them.
VALIDATED_SUMS = 6


@runtime_checkable
class EpochSampler(Protocol):
    """A sampler told each epoch, to shuffle it anew: a PositionedSampler, or a ShardLoader's."""

    def set_epoch(self, epoch: int) -> None: ...


def run_epoch(ctx: RankContext, rank: RankSetup, ddp_model: nn.Module, boundary: Boundaries,
              unreadable: UnreadableTally, position: Position, epoch: int,
              start: int = 0, next_epoch: int | None = None,
              selection: Selection = Selection()) -> tuple[dict[str, Any], int]:
    """Train and validate one epoch, from global sample position `start` (an elastic gang's
    formation that took over mid-epoch); returns the gang's record of it and the images this
    rank trained on. After every step the parts of `boundary` are called (tasks/training/boundary.py).
    `next_epoch`: the epoch the run trains after this one, if any, whose loading
    starts while this one validates.

    The record's `time` is where the gang's time went (tasks/training/step_times.py):
    every rank's row of it travels in the same all-reduce as the metrics. An epoch taken over
    mid-epoch says where (`taken_over_at_sample`) and counts the images the formation before
    trained in `train_samples`; its losses and accuracies cover them too where that formation
    left whole, to grow (its sums carried in `position`), else only the part trained here.
    """
    started = time.monotonic()
    assert isinstance(rank.data.train.sampler, EpochSampler), "rank_data's train loaders sample by epoch"
    train = PassSums()
    on_step = partial(between_steps, boundary, rank, started, position, train, epoch)
    train_one_epoch(ddp_model, rank.data.train, rank.state.optimizer, rank.state.scaler,
                    rank.train_inputs, rank.amp_dtype, on_step=on_step, clock=rank.clock,
                    warmup=rank.warmup, frozen=rank.frozen, sums=train,
                    batches=rank.data.train_epochs.batches(epoch, start), knobs=rank.knobs,
                    average=rank.state.average, on_batch=lambda done, total: beat(ctx, epoch, done))
    trained_at = time.monotonic()
    if next_epoch is not None:  # its first batches load while this epoch validates (tasks/data/epoch_ahead.py)
        rank.data.train_epochs.start(next_epoch)
    sync_buffers(rank.state.model)
    val = validate(ctx, rank.state.model, rank.data.val, rank.val_inputs, epoch)
    averaged = validate_average(ctx, rank, epoch)
    sums = [*train.sums(), *val.sums(), *(averaged.sums() if averaged else [])]
    rows = gang_rows(rank.clock.totals(), time.monotonic() - trained_at, trained_at - started, int(train.count),
                     ctx.rank, ctx.world_size)
    totals = all_reduce_sum([*sums, *rows], rank.device)
    carried = position.carried if start else None  # the formations before's part of the epoch (regrouping.Position)
    if carried:
        for index, part in enumerate(carried.sums):
            totals[index] += part
    record = epoch_record(epoch, totals[:VALIDATED_SUMS], rank.state.optimizer, time.monotonic() - started)
    if averaged:  # the average's validation beside the model's, and which of them the epoch keeps
        record = with_average(record, totals[VALIDATED_SUMS:len(sums)], selection)
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


def validate_average(ctx: RankContext, rank: RankSetup, epoch: int) -> PassSums | None:
    """The weights' moving average validated on the model's validation images, where the run keeps one.

    Its BatchNorm statistics are averaged from each rank's own last steps, as the model's are:
    rank 0's are taken, as for the model, so every rank validates the average rank 0 would keep.
    The images it meets unreadable are validation's own, counted once."""
    if rank.state.average is None:
        return None
    sync_buffers(rank.state.average.module)
    return validate(ctx, rank.state.average.module, rank.data.val, rank.val_inputs, epoch)


def between_steps(boundary: Boundaries, rank: RankSetup, started: float, position: Position, sums: PassSums,
                  epoch: int, done: int, total: int) -> None:
    """After every optimizer step: note how far the rank got, then the step's boundary."""
    images = done * rank.batch_size
    position.stepped(epoch, images)
    boundary.after_step(StepEnd(epoch, done, total, images, time.monotonic() - started, sums, rank.clock))


def validate(ctx: RankContext, model: nn.Module, loader: DataLoader, inputs: ToDevice, epoch: int) -> PassSums:
    """`evaluate`, telling the supervisor after every batch and leaving if the gang is being stopped.

    Without a report per batch, a validation pass longer than the hang limit allows was
    taken for a hang on every attempt (docs/architecture.md, "Gang: progress").
    """
    ctx.progress("validation", epoch=epoch + 1)
    return evaluate(model, loader, inputs, on_batch=partial(between_batches, ctx, epoch))


def between_batches(ctx: RankContext, epoch: int, done: int, total: int) -> None:
    """After every validation batch: tell the supervisor, leave if the gang is being stopped."""
    beat(ctx, epoch, done, "validation")


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
        "lr": max(group["lr"] for group in optimizer.param_groups),  # the head's, with training.layer_decay
        "seconds": round(seconds, 2),
    }

