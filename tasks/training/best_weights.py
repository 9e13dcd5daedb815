"""The boundary part that keeps the best epoch's weights and writes them to model.pt."""

from __future__ import annotations

import threading
from typing import Any

from torch import nn
from torch.optim.swa_utils import AveragedModel

from prefect_ddp.tasks.data.storage import save_torch, write_json
from prefect_ddp.tasks.gang import RankContext
from prefect_ddp.tasks.selection import Selection, best_index, is_better
from prefect_ddp.tasks.training.boundary import BoundaryPart, EpochEnd, Stop
from prefect_ddp.tasks.training.checkpoint_writer import BackgroundWriter, to_cpu
from prefect_ddp.tasks.training.checkpoints import BestEpoch, Resumed
from prefect_ddp.tasks.training.job import RunFiles
from prefect_ddp.tasks.training.weights_average import kept_module


class BestWeights(BoundaryPart):
    """Rank 0's `model.pt`: the weights of the best epoch so far (tasks/selection.py), with its card.

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

    The copy is forgotten only once model.pt and its card have landed (`_landed`, in the
    writing thread), never when it is handed to the writer: a write the store refuses leaves
    the copy here, so that a rank of an elastic gang parks it (tasks/training/leaving.py) and
    the next formation writes it, instead of going on with model.pt one best behind.
    """

    name = "best weights"

    def __init__(self, ctx: RankContext, model: nn.Module, files: RunFiles, selection: Selection,
                 average: AveragedModel | None = None) -> None:
        self.ctx = ctx
        self.model = model  # the unwrapped one, whose state_dict model.pt holds
        self.average = average  # the weights' moving average, kept instead where an epoch says so
        self.enabled = ctx.is_main
        # In an elastic gang every rank keeps the unwritten best weights: any survivor may hand its state over.
        self.keeps = ctx.is_main or ctx.elastic
        self.files = files
        self.selection = selection
        self.best: float | None = None
        self.epoch: int | None = None  # the best epoch so far, counted from 1: model.pt's once written
        # (epoch, its weights) until model.pt holds them; the writing thread clears it (`_landed`).
        self._unwritten: BestEpoch | None = None
        self._submitted: BestEpoch | None = None  # the copy last given to the writer
        self._lock = threading.Lock()

    def after_resume(self, resumed: Resumed) -> None:
        """The best epoch of the history resumed, and its weights where model.pt may lack them:
        given to the writer by `write_after_checkpoint`, or carried by the next checkpoint or park."""
        history = resumed.history
        if not history:
            return
        values = [h[self.selection.metric] for h in history]
        best = best_index(values, self.selection.direction)
        self.best, self.epoch = values[best], history[best]["epoch"]
        if self.keeps and resumed.best and resumed.best[0] == self.epoch:  # the copy carried: exact
            self._hold(resumed.best)
        # Mid-epoch the model is past that epoch; a stopped run's weights (tasks/training/run_stop.py) and a
        # failed formation's (tasks/training/leaving.py) may be too.
        elif best == len(history) - 1 and resumed.position == 0 and not resumed.stopped and resumed.settled:
            self._keep(history[best])

    def after_epoch(self, end: EpochEnd) -> Stop | None:
        """An epoch better than the best before it: its weights copied to memory, to be written."""
        value = end.record[self.selection.metric]
        if is_better(value, self.best, self.selection.direction):
            self.best, self.epoch = value, end.record["epoch"]
            self._keep(end.record)
        return None

    def _keep(self, record: dict[str, Any]) -> None:
        """A copy of the weights the epoch of `record` kept: the model's, or the average's that did better."""
        if self.keeps and self.epoch is not None:
            self._hold((self.epoch, to_cpu(kept_module(self.model, self.average, record).state_dict())))

    def _hold(self, best: BestEpoch) -> None:
        with self._lock:
            self._unwritten = best

    def unwritten(self, epoch: int | None) -> BestEpoch | None:
        """The kept best epoch's weights for the checkpoint of `epoch` (counted from 1; None: a
        state parked mid-epoch, or a stopped run's, whose weights are taken for no recorded
        epoch's) to carry: None when model.pt has them already, or they are that checkpoint's own."""
        if self._unwritten is None or self._unwritten[0] == epoch:
            return None
        return self._unwritten

    def waiting(self) -> bool:
        """Whether a best epoch's weights wait for a checkpoint to hold them before model.pt may
        (given to the writer already, they wait for the write alone)."""
        return self._unwritten is not None and self._unwritten is not self._submitted

    def write_after_checkpoint(self, writer: BackgroundWriter) -> None:
        """Give the writer the best epoch kept since the last checkpoint, to write after it (rank 0);
        the copy stays here until the write lands."""
        best = self._unwritten
        if best is None or not self.enabled:
            return
        self._submitted = best
        writer.submit(f"model.pt (epoch {best[0]})", lambda: self._write(best))

    def _write(self, best: BestEpoch) -> None:
        """In the writing thread: model.pt, then its card; the copy is forgotten once both landed."""
        epoch, weights = best
        save_torch(self.files.model, weights, self.files.options,
                   on_part=lambda: self.ctx.progress("checkpoint", epoch=epoch))
        write_json(self.files.card, self.files.card_fields | {
            "epoch": epoch, "selected_by": self.selection.describe()}, self.files.options)
        self._landed(best)

    def _landed(self, best: BestEpoch) -> None:
        """Forget `best`, unless a newer best took its place while it was written."""
        with self._lock:
            if self._unwritten is best:
                self._unwritten = None
