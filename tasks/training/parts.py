"""The boundary parts of a rank's training, in the order each boundary calls them: one table.

docs/architecture.md ("Training: a rank's life") tells the same order. Each part is a module of
its own under tasks/training/; the interface they share is tasks/training/boundary.py. A caller
of `train_classifier` adds parts of its own with `PartFactory`s: after the project's, but
before the grow checks, which may leave the formation at a boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prefect_ddp.tasks.gang import RankContext
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.training.boundary import BoundaryPart
from prefect_ddp.tasks.training.champion_scoring import ChampionScoring
from prefect_ddp.tasks.training.checkpoint_writer import BackgroundWriter
from prefect_ddp.tasks.training.checkpointing import Checkpointing
from prefect_ddp.tasks.training.formation import Attempt, Formation
from prefect_ddp.tasks.training.grow_checks import GrowChecks
from prefect_ddp.tasks.training.heartbeats import Heartbeats
from prefect_ddp.tasks.training.job import TrainJob
from prefect_ddp.tasks.training.progress import ProgressReporter
from prefect_ddp.tasks.training.rank_setup import RankSetup
from prefect_ddp.tasks.training.pruning import Pruning


@dataclass(frozen=True)
class RankTraining:
    """One rank's training in one formation of the gang: what a part may be built from."""

    ctx: RankContext
    job: TrainJob
    rank: RankSetup  # the model, optimizer, loaders and device
    formation: Formation  # where it started, the history, the best weights kept
    attempt: Attempt  # the attempts so far and the checkpoint schedule
    writer: BackgroundWriter  # rank 0's writes, in order, off the training thread


# Called once per formation on every rank; None: the part has nothing to do in this run.
PartFactory = Callable[[RankTraining], BoundaryPart | None]


def boundary_parts(training: RankTraining, extra: Sequence[PartFactory] = ()) -> list[BoundaryPart]:
    """The parts, in the order each boundary calls them: the caller's (`extra`) after the
    project's own, before the grow checks. The caller's are made first, so that one that cannot be
    made fails before any part holds a thread."""
    ctx, job, formation = training.ctx, training.job, training.formation
    callers = [make(training) for make in extra]
    progress = progress_bar(training)
    parts = [
        Heartbeats(ctx),  # first: the parts after it may take their time
        formation.kept,  # the best epoch's weights copied before the checkpoint that is to carry them
        Checkpointing(ctx, training.rank.state, training.attempt.schedule, formation.files, formation.fingerprint,
                      training.writer, formation.kept),
        # At the end, once the checkpoint part waited for model.pt to be written.
        ChampionScoring(ctx, job.champion, training.rank, formation) if job.champion else None,
        progress,
        Pruning(ctx),  # after the checkpoint: a trial's epoch is written before the study hears of it
        *callers,
        GrowChecks.of(ctx, job.training, formation.leaving, progress, training.writer),  # it may leave: last
    ]
    return [part for part in parts if part is not None]


def progress_bar(training: RankTraining) -> ProgressReporter:
    """Rank 0's bar for this formation, saying so where it took the run over from a rank's memory."""
    ctx, job, position = training.ctx, training.job, training.formation.position
    progress = ProgressReporter(ctx, job.training.epochs, run_logger(), job.tracked)
    if training.formation.handed:
        progress.note(position.epoch + position.start / len(job.split.train), f"The gang went on with "
                      f"{ctx.world_size} ranks at epoch {position.epoch + 1}, sample {position.start}, from the "
                      "state a rank kept in memory")
    return progress
