"""The boundary part where an elastic gang's ranks ask whether to regroup larger."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn

from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data.positioned_sampler import PositionedSampler
from prefect_ddp.tasks.gang import RankContext, all_gather_strings, all_reduce_sum
from prefect_ddp.tasks.training.boundary import BoundaryPart, EpochEnd, StepEnd, Stop
from prefect_ddp.tasks.training.checkpoint_writer import BackgroundWriter
from prefect_ddp.tasks.training.leaving import Leaving
from prefect_ddp.tasks.training.progress import ProgressReporter
from prefect_ddp.tasks.training.regrouping import EpochSoFar


@dataclass
class GrowChecks(BoundaryPart):
    """Where an elastic gang's ranks ask whether to regroup larger (tasks/gang/resizing.py): after
    every `every` optimizer steps of an epoch (0: never mid-epoch) and at the end of each epoch
    but the last. Every rank asks at the same step (`regroup_requested` is a collective: rank 0
    reads the flag, all get its answer), so all leave together, or none. Each ask costs one
    one-integer broadcast; the flag itself is read at most once a second (bench/RESULTS.md,
    bench.elastic's boundary part)."""

    name = "grow checks"

    ctx: RankContext
    leaving: Leaving
    progress: ProgressReporter
    writer: BackgroundWriter
    every: int

    @classmethod
    def of(cls, ctx: RankContext, cfg: TrainingConfig, leaving: Leaving, progress: ProgressReporter,
           writer: BackgroundWriter) -> GrowChecks | None:
        """None for a fixed-size gang; mid-epoch asks only where a formation can take over mid-epoch
        (a PositionedSampler: tar shards' epochs start only at their beginning)."""
        if not ctx.elastic:
            return None
        every = cfg.regroup_every_steps if isinstance(leaving.sampler, PositionedSampler) else 0
        every = math.ceil(every / cfg.accumulate_steps) * cfg.accumulate_steps  # at an optimizer step, in batches
        return cls(ctx, leaving, progress, writer, every)

    def after_step(self, step: StepEnd) -> None:
        """Mid-epoch: the epoch's train sums and unreadable images so far go along, gathered over
        the whole gang (every rank is here), so the epoch's record covers every image of it."""
        if self.every and step.step % self.every == 0 and step.step < step.steps and self.ctx.regroup_requested():
            position = self.leaving.position
            # From a failure: the images up to its start counted, without sums.
            before = position.carried or EpochSoFar(uncounted=position.start)
            self._leave(before.plus(all_reduce_sum(step.sums.sums(), self.ctx.device),
                                    all_gather_strings(sorted(step.sums.unreadable), self.ctx.device)))

    def after_epoch(self, end: EpochEnd) -> Stop | None:
        if not end.last and self.ctx.regroup_requested():
            self._leave(None)
        return None

    def _leave(self, trained: EpochSoFar | None) -> NoReturn:
        self.writer.wait()  # a failed write fails the rank here, not unseen in the regroup
        self.leaving.regroup(self.progress, trained)
