"""The boundary part that tells the gang's supervisor this rank is alive, and where.

The supervisor takes a rank silent for longer than the hang limit for a hung one
(docs/architecture.md, "Gang: progress"); a rank says where it is after every step and at
every epoch's end, and after every step leaves if the gang is being stopped
(`RankContext.check_stop`; an epoch's end is reached only through its steps).
First at every boundary, so that the parts after it may take their time: the checkpoint's
write says how it gets on by itself (tasks/training/checkpointing.py).
"""

from __future__ import annotations

from prefect_ddp.tasks.gang import RankContext
from prefect_ddp.tasks.training.boundary import BoundaryPart, EpochEnd, StepEnd, Stop


class Heartbeats(BoundaryPart):
    name = "heartbeats"

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx

    def after_step(self, step: StepEnd) -> None:
        beat(self.ctx, step.epoch, step.step)

    def after_epoch(self, end: EpochEnd) -> Stop | None:
        self.ctx.progress("checkpoint", epoch=end.record["epoch"])
        return None


def beat(ctx: RankContext, epoch: int, batches: int, phase: str = "step") -> None:
    """Tell the supervisor the rank is through `batches` of epoch `epoch` (from 0) in `phase`, and leave
    if the gang is being stopped: after every optimizer step, after every batch of an accumulated one
    (training.accumulate_steps), and after every validation batch ("validation"), where many batches
    together may take longer than the hang limit."""
    ctx.progress(phase, epoch=epoch + 1, step=batches)
    ctx.check_stop()
