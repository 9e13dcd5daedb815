"""Where one formation of the gang starts training, and what its boundary parts share.

A formation takes up the run where the last left it: from the state a rank of an elastic
gang's last formation handed over in memory (tasks/gang/handover.py), else from the last
checkpoint of this job (tasks/training/checkpoints.py), else from the start. Rank 0 records
the attempt (checkpoints/attempts.json), from which the checkpoint schedule learns how often
the gang fails (tasks/training/checkpoint_interval.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prefect_ddp.tasks.gang import RankContext
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.selection import Selection
from prefect_ddp.tasks.training.best_weights import BestWeights
from prefect_ddp.tasks.training.checkpoint_interval import CheckpointSchedule
from prefect_ddp.tasks.training.checkpoints import failures_seen, job_fingerprint, record_attempt
from prefect_ddp.tasks.training.job import RunFiles, TrainJob
from prefect_ddp.tasks.training.leaving import Leaving
from prefect_ddp.tasks.training.optimization import scales_lr
from prefect_ddp.tasks.training.rank_setup import RankSetup
from prefect_ddp.tasks.training.regrouping import EpochSoFar, Position


@dataclass
class Formation:
    """This formation's start and what its parts share; `history` grows as epochs are recorded."""

    files: RunFiles
    fingerprint: dict[str, Any]  # the job's: a checkpoint of another job is never resumed
    history: list[dict[str, Any]]  # the gang's record of every epoch so far, a resumed run's too
    position: Position  # where the rank is; from here on, a failure parks the state (`leaving`)
    handed: bool  # taken over from a rank's memory, not read from the checkpoint
    kept: BestWeights
    leaving: Leaving
    comparison: dict[str, Any] | None = None  # the champion's scores beside the run's, once training completed


def take_up(ctx: RankContext, job: TrainJob, rank: RankSetup) -> Formation:
    """The run's state as the last formation left it, on this rank."""
    files = RunFiles.of(job, rank.data.output_options)
    fingerprint = job_fingerprint(job.manifest.classes, job.split.digest(job.manifest), job.model, job.training)
    kept = BestWeights(ctx, rank.state.model, files, ctx.trial.selection if ctx.trial else Selection(),
                       rank.state.average)
    handed = ctx.hand_over(rank.device) if ctx.elastic else None  # a survivor's state, in memory
    resumed = rank.state.resume(files.checkpoint, files.options, fingerprint, ctx.world_size,
                                scales_lr(job.training), rank.device, handed=handed.data if handed else None)
    kept.after_resume(resumed)
    carried = EpochSoFar.from_dict(resumed.trained) if resumed.trained else None
    position = Position(resumed.next_epoch, start=resumed.position, carried=carried, stopped=resumed.stopped)
    # A resumed run's warmup is behind it, as far as it got.
    rank.warmup.done = position.epoch * len(rank.data.train) + position.start // (rank.batch_size * ctx.world_size)
    leaving = Leaving(ctx, rank.state, position, rank.data.train.sampler, resumed.history, fingerprint, rank.warmup,
                      kept)
    return Formation(files, fingerprint, resumed.history, position, handed is not None, kept, leaving)


@dataclass(frozen=True)
class Attempt:
    """This gang attempt as rank 0 recorded it, and the checkpoint schedule that follows from it."""

    attempts: list[dict[str, Any]]  # rank 0's record of the attempts that reached training; [] elsewhere
    schedule: CheckpointSchedule


def begin(ctx: RankContext, job: TrainJob, formation: Formation) -> Attempt:
    """Say where the formation starts, record the attempt (rank 0), and set up the checkpoint schedule."""
    log = run_logger()
    level = logging.INFO if ctx.is_main else logging.DEBUG  # rank 0 speaks for the gang
    position = formation.position
    if formation.handed:
        log.log(level, "Rank %d took over epoch %d at sample %d from the state a rank of the gang's last "
                "formation kept in memory; the checkpoint was not read", ctx.rank, position.epoch + 1, position.start)
    elif position.epoch:
        log.log(level, "Rank %d resumed from %s after epoch %d", ctx.rank, formation.files.checkpoint, position.epoch)
    if position.stopped:
        log.log(level, "The run stopped after epoch %d in an attempt before this one (%s): nothing more is trained. "
                "To train it further, give it a new output.url.", position.stopped.epoch, position.stopped.why)
    attempts = record_attempt(formation.files.attempts, formation.files.options, ctx.attempt + 1, ctx.world_size,
                              position.epoch, position.start, formation.handed,
                              ctx.regroups) if ctx.is_main else []
    schedule = CheckpointSchedule.for_run(job.training, failures=failures_seen(attempts, ctx.attempt, ctx.regroups),
                                          history=formation.history, every_epoch=ctx.trial is not None)
    return Attempt(attempts, schedule)
