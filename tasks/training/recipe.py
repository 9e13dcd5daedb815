"""The transfer-learning recipe that runs on every rank of the gang: one rank's life.

Read top to bottom like torchvision's reference `train.py`: `train_classifier` sets the rank up
(tasks/training/rank_setup.py), takes up the run where the gang's last formation left it
(tasks/training/formation.py), then `train_epochs` trains and validates each epoch
(tasks/training/epoch.py) and reaches a boundary. What happens at a boundary (telling the
supervisor, the best epoch's weights, checkpoints, progress, a sweep's pruning, an elastic
gang growing) is done by parts, called through one interface (tasks/training/boundary.py) in
the order of one table (tasks/training/parts.py); a caller adds its own with `parts`.

Rank 0 writes a checkpoint (a plain dict: model, optimizer, lr_scheduler, scaler, epoch,
history, with the job's fingerprint: tasks/training/checkpoints.py) when the schedule says; a
re-formed gang resumes from it, and only from its own job's. `model.pt` holds the best epoch's
weights (tasks/selection.py), not the last epoch's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from prefect_ddp.tasks.data.loader_leftovers import remove_dead_loader_folders
from prefect_ddp.tasks.gang import GangRegroup, RankContext, wrap_ddp
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.training.best_weights import BestWeights
from prefect_ddp.tasks.training.boundary import Boundaries, EpochEnd, TrainingEnd
from prefect_ddp.tasks.training.checkpoint_writer import BackgroundWriter
from prefect_ddp.tasks.training.checkpointing import Checkpointing
from prefect_ddp.tasks.training.epoch import run_epoch
from prefect_ddp.tasks.training.formation import Formation, begin, take_up
from prefect_ddp.tasks.training.job import TrainJob
from prefect_ddp.tasks.training.optimization import step_scheduler
from prefect_ddp.tasks.training.parts import PartFactory, RankTraining, boundary_parts
from prefect_ddp.tasks.training.rank_result import RankResult
from prefect_ddp.tasks.training.rank_setup import RankSetup, set_up_rank
from prefect_ddp.tasks.training.run_stop import RunStop
from prefect_ddp.tasks.training.step_times import time_gradient_sync
from prefect_ddp.tasks.training.unreadable import UnreadableTally

# The parts whose seconds are training's wait for rank 0's copies to memory and writes.
WRITING_PARTS = (BestWeights, Checkpointing)


def train_classifier(ctx: RankContext, job: TrainJob, parts: Sequence[PartFactory] = ()) -> RankResult:
    """Per-rank entry point: train, validate, checkpoint; rank 0 keeps the best epoch's model.

    Every rank stops early together when a part says so (a sweep's pruner), or when too many
    images turn out unreadable (tasks/training/unreadable.py): it then returns why, for the flow
    to fail with. `parts`: factories of boundary parts of the caller's own, each called with the
    rank's `RankTraining` (tasks/training/parts.py), e.g. `run_gang(partial(train_classifier,
    parts=[MyPart]), job)` with a `MyPart(BoundaryPart)` whose `__init__` takes a RankTraining.
    """
    rank = set_up_rank(ctx, job, run_logger())
    formation = take_up(ctx, job, rank)
    try:
        # Right before each write, in the writing thread: a rank whose gang lost its worker writes nothing more.
        with BackgroundWriter(before_write=ctx.check_lease if ctx.is_main else lambda: None) as writer:
            return train_formation(ctx, job, rank, formation, writer, parts)
    except GangRegroup:
        raise
    except BaseException:  # an elastic gang's rank parks its state for the next formation, its writes over
        formation.leaving.after_failure()
        raise


def train_formation(ctx: RankContext, job: TrainJob, rank: RankSetup, formation: Formation,
                    writer: BackgroundWriter, parts: Sequence[PartFactory]) -> RankResult:
    """train_classifier's epochs on this formation of the gang, from where it took the run up."""
    ddp_model = wrap_ddp(rank.state.model, rank.device)
    time_gradient_sync(ddp_model, rank.clock)
    unreadable = UnreadableTally(job.unreadable, job.manifest, rank.device, announce=ctx.is_main)
    unreadable.after_resume(formation.history)
    training = RankTraining(ctx, job, rank, formation, begin(ctx, job, formation), writer)
    if not formation.handed:  # a resumed best epoch model.pt may lack; one handed over waits for a checkpoint
        formation.kept.write_after_checkpoint(writer)
    taken_up = formation.position.stopped  # a formation before stopped the run: nothing more to train
    with Boundaries(boundary_parts(training, parts)) as boundary:
        try:
            trained = Trained(stop=taken_up) if taken_up else train_epochs(training, ddp_model, unreadable, boundary)
        finally:
            rank.data.train_epochs.close()  # its loader processes stop now, busy or not
            remove_dead_loader_folders()  # a killed peer's orphaned loader processes have exited by now
        boundary.after_training(TrainingEnd(formation.history, trained.stop,
                                            stop_saved=taken_up is not None and not formation.handed))
        if trained.checkpoint_s:  # the wait for the last writes joins the last epoch's
            trained.checkpoint_s[-1] = round(trained.checkpoint_s[-1] + boundary.spent(WRITING_PARTS), 3)
    return RankResult(
        rank=ctx.rank,
        worker_address=ctx.worker_address,
        split_digest=job.split.digest(job.manifest),
        local_train_samples=trained.local_train_samples,
        checkpoint_s=trained.checkpoint_s,
        checkpoints=training.attempt.schedule.decisions,
        history=formation.history,
        best_epoch=formation.kept.epoch,
        selected_by=formation.kept.selection.describe(),
        pruned_at=trained.stop.pruned_at if trained.stop else None,
        attempts=training.attempt.attempts,
        unreadable=unreadable.summary(),
        stopped=trained.stop.unreadable if trained.stop else None,
        recipe=rank.recipe,
        comparison=formation.comparison,
    )


@dataclass
class Trained:
    """What this formation's loop did, per epoch trained here, and why it ended."""

    local_train_samples: list[int] = field(default_factory=list)  # the images this rank trained on
    # The seconds training waited for rank 0's copies to memory and writes, outside the record
    # (which the checkpoint holds).
    checkpoint_s: list[float] = field(default_factory=list)
    stop: RunStop | None = None  # why the run ended before its last epoch, here or in a formation before


def train_epochs(training: RankTraining, ddp_model: nn.Module, unreadable: UnreadableTally,
                 boundary: Boundaries) -> Trained:
    """The epochs left: each trained and validated, then recorded, then its boundary's parts; stops
    early where a part says so, or too many images turned out unreadable."""
    ctx, rank, formation, epochs = training.ctx, training.rank, training.formation, training.job.training.epochs
    position, history = formation.position, formation.history
    log, level = run_logger(), logging.INFO if ctx.is_main else logging.DEBUG  # rank 0 speaks for the gang
    trained = Trained()
    for epoch in range(position.epoch, epochs):
        record, images = run_epoch(ctx, rank, ddp_model, boundary, unreadable, position, epoch,
                                   start=position.start, next_epoch=epoch + 1 if epoch + 1 < epochs else None,
                                   selection=formation.kept.selection)
        exceeded = unreadable.exceeded(record["epoch"])  # the gang's count: every rank stops here, or none
        if exceeded:
            log.log(level, "Stopped in epoch %d, keeping nothing of it: %s", record["epoch"], exceeded)
            trained.stop = position.stopped = RunStop(len(history) and history[-1]["epoch"], exceeded, "unreadable")
            break
        trained.local_train_samples.append(images)
        step_scheduler(rank.state.scheduler, record["val_loss"])
        history.append(record)
        position.epoch_done(epoch)
        log.log(level, "epoch %d/%d %s", record["epoch"], epochs, record)
        stop = boundary.after_epoch(EpochEnd(epoch, history, last=epoch == epochs - 1))
        trained.checkpoint_s.append(round(boundary.spent(WRITING_PARTS), 3))  # rank 0's; the others write none
        if stop:
            log.log(level, "Stopped after epoch %d: %s", record["epoch"], stop.why)
            trained.stop = position.stopped = RunStop(record["epoch"], stop.why, "pruned" if stop.pruned else "stop")
            break
    return trained
