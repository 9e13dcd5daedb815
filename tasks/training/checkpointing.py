"""The boundary part that checkpoints: rank 0's checkpoints, taken when the schedule says.

A checkpoint is the state a re-formed gang resumes from (tasks/training/checkpoints.py); it is
copied to memory in the training thread and written by the formation's BackgroundWriter
(tasks/training/checkpoint_writer.py), then model.pt's new best after it (tasks/training/best_weights.py).
"""

from __future__ import annotations

import time
from typing import Any

from prefect_ddp.tasks.data.storage import save_torch
from prefect_ddp.tasks.gang import RankContext
from prefect_ddp.tasks.training.best_weights import BestWeights
from prefect_ddp.tasks.training.boundary import BoundaryPart, EpochEnd, Stop, TrainingEnd
from prefect_ddp.tasks.training.checkpoint_interval import CheckpointSchedule
from prefect_ddp.tasks.training.checkpoint_writer import BackgroundWriter, CheckpointWriteError
from prefect_ddp.tasks.training.checkpoints import TrainingState
from prefect_ddp.tasks.training.job import RunFiles
from prefect_ddp.tasks.training.run_stop import RunStop


class Checkpointing(BoundaryPart):
    """Rank 0's checkpoints: taken when the schedule says, written in the background.

    A sweep's trial checkpoints every epoch and waits for the write before the epoch is
    reported to the study: Optuna keeps a reported value for good, so it must belong to
    weights that a re-formed gang resumes from, never to an epoch lost with a rank. At the end
    every rank waits for rank 0's last writes: the last checkpoint and model.pt exist once the
    ranks return, and the champion's scoring reads model.pt.
    """

    name = "checkpoint"

    def __init__(self, ctx: RankContext, state: TrainingState, schedule: CheckpointSchedule, files: RunFiles,
                 fingerprint: dict[str, Any], writer: BackgroundWriter, kept: BestWeights) -> None:
        self.ctx = ctx
        self.state = state
        self.schedule = schedule
        self.files = files
        self.fingerprint = fingerprint
        self.writer = writer
        self.kept = kept

    def after_epoch(self, end: EpochEnd) -> Stop | None:
        """On rank 0: raise a failed write, then checkpoint the epoch just recorded if it is due."""
        if self.ctx.is_main:
            self.writer.check()
            if self.schedule.due(end.record["seconds"], end.last):
                self.save(end.history)
        return None

    def after_training(self, end: TrainingEnd) -> None:
        """A stop the checkpoint lacks (decided now, or taken over in memory) is checkpointed as the
        run's end, and best weights taken over after the last epoch get their checkpoint; then every
        rank waits for rank 0's writes, in rounds that tell the supervisor it is alive (`wait_for_main`)."""
        if self.ctx.is_main and end.stop and not end.stop_saved:
            self.save_stop(end.history, end.stop)
        elif self.ctx.is_main and self.kept.waiting():
            self.save(end.history)
        self.ctx.wait_for_main(self.writer.finished)
        self.writer.wait()

    def save_stop(self, history: list[dict[str, Any]], stop: RunStop) -> None:
        """Checkpoint the run's stop, also after an earlier write failed (then in this thread, and
        the failure raised after it): the stop's checkpoint is whole on its own, carrying the best
        weights model.pt may lack, so the gang re-formed after that failure ends at the stop."""
        try:
            self.writer.wait()
        except CheckpointWriteError:
            self.ctx.check_lease()
            save_torch(self.files.checkpoint, self.snapshot(history, stop), self.files.options)
            raise
        self.save(history, stop)

    def save(self, history: list[dict[str, Any]], stop: RunStop | None = None) -> None:
        """Checkpoint the epochs of `history` (and the run's `stop`), then model.pt's new best after
        it; the schedule learns the seconds training waited for the copy (δ)."""
        started = time.monotonic()
        writer = self.writer
        writer.wait()  # the writes before: one snapshot in memory at a time, and a failed write raised here
        self.ctx.check_lease()  # a rank whose gang no longer holds its worker copies nothing (the writer checks again)
        epoch = stop.epoch if stop else history[-1]["epoch"]
        snapshot = self.snapshot(history, stop)
        writer.submit(f"the checkpoint of epoch {epoch}{' (the run stopped)' if stop else ''}", lambda: save_torch(
            self.files.checkpoint, snapshot, self.files.options, on_part=lambda: self.ctx.progress("checkpoint", epoch=epoch)))
        self.kept.write_after_checkpoint(writer)
        if self.ctx.trial is not None:
            writer.wait()
        self.schedule.saved(time.monotonic() - started)

    def snapshot(self, history: list[dict[str, Any]], stop: RunStop | None) -> dict[str, Any]:
        """The checkpoint of `history`'s last epoch, or of the run's `stop`, in memory of its own."""
        epoch = stop.epoch if stop else history[-1]["epoch"]
        # A stopped run's weights are taken for no epoch's: it carries its best whatever its epoch (run_stop.py).
        return self.state.snapshot(epoch - 1, history, self.fingerprint, self.ctx.world_size,
                                   best=self.kept.unwritten(None if stop else epoch), stop=stop)
