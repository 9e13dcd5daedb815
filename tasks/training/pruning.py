"""The boundary part that reports each epoch to a sweep's study, and stops the run it prunes.

Its place is after the checkpoint: a trial's checkpoint is written before the epoch is
reported (tasks/training/checkpointing.py), since Optuna keeps a reported value for good.
`RankContext.report` is a collective, so every rank stops at the same boundary or none does.
Outside a sweep it reports nothing.
"""

from __future__ import annotations

from prefect_ddp.tasks.gang import RankContext
from prefect_ddp.tasks.training.boundary import BoundaryPart, EpochEnd, Stop


class Pruning(BoundaryPart):
    name = "pruning"

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx

    def after_epoch(self, end: EpochEnd) -> Stop | None:
        if not self.ctx.report(end.record["epoch"], end.record):
            return None
        return Stop("pruned by the sweep", pruned=True)
