"""A rank of an elastic gang: how far it got, and its state parked for the next formation.

In a gang formed with a size range (`cluster.min_world_size`; tasks/gang/resizing.py) each
rank parks its training state in its worker's memory as it leaves its formation: when the
supervisor asks the gang to regroup larger (every `training.regroup_every_steps` steps or at
an epoch's end), or mid-epoch when a peer is lost. The next formation takes the newest parked state over its process group
(`RankContext.hand_over`) instead of reading the checkpoint, and goes on from the same
global sample position (tasks/data/positioned_sampler.py), so that within the epoch no
image is trained twice or skipped beyond the sampler's bounded remainder.

What is parked is the checkpoint's own snapshot (tasks/training/checkpoints.py) with the
position added, so a state handed over and one read from storage resume the same way, the
learning rate rescaled to the new world size as after any re-formation.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from prefect_ddp.tasks.data.positioned_sampler import PositionedSampler
from prefect_ddp.tasks.gang import RankContext
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.training.checkpoints import BestEpoch, TrainingState
from prefect_ddp.tasks.training.optimization import Warmup
from prefect_ddp.tasks.training.run_stop import RunStop


@dataclass(frozen=True)
class EpochSoFar:
    """What the formations before trained of an epoch, up to the global position the next one
    starts from, where the last of them left whole (to grow), so that the epoch's record covers
    every image of it: the sums of the images' losses over their ranks, the images trained
    before a rank was lost with their sums (counted in train_samples, in no loss), and the
    unreadable images met (counted against data.max_unreadable_fraction)."""

    sums: tuple[float, ...] = (0.0, 0.0, 0.0)  # loss sum, correct, count (the recipe's PassSums.sums)
    uncounted: int = 0
    unreadable: tuple[str, ...] = ()

    def plus(self, sums: list[float], unreadable: Iterable[str]) -> EpochSoFar:
        return EpochSoFar(tuple(mine + more for mine, more in zip(self.sums, sums)), self.uncounted,
                          tuple(sorted({*self.unreadable, *unreadable})))

    def as_dict(self) -> dict[str, Any]:
        """As parked with a state: plain values, which `torch.load(weights_only=True)` reads back."""
        return {"sums": list(self.sums), "uncounted": self.uncounted, "unreadable": list(self.unreadable)}

    @classmethod
    def from_dict(cls, parked: dict[str, Any]) -> EpochSoFar:
        return cls(tuple(parked["sums"]), parked["uncounted"], tuple(parked["unreadable"]))


@dataclass
class Position:
    """Where this rank's attempt is: the epoch under way (from 0), the global sample position
    this formation started it from, and the images of it this rank has trained through its last
    optimizer step."""

    epoch: int
    start: int = 0
    samples: int = 0
    # What the formations before trained of the epoch up to `start`, where the last left whole;
    # None: it lost a rank, and the images up to `start` are counted without their sums.
    carried: EpochSoFar | None = None
    stopped: RunStop | None = None  # the run ended early here: no epoch is trained after it

    def stepped(self, epoch: int, samples: int) -> None:
        self.epoch, self.samples = epoch, samples

    def epoch_done(self, epoch: int) -> None:
        self.epoch, self.start, self.samples, self.carried = epoch + 1, 0, 0, None

    def global_position(self, sampler: Any) -> int | None:
        """The sample position the gang reached in the epoch; None where the next formation could
        not start there (tar shards' sampler starts epochs only at their beginning)."""
        if self.samples == 0:
            return self.start
        if not isinstance(sampler, PositionedSampler):
            return None
        return sampler.position_after(min(self.samples, len(sampler)))


def park_state(ctx: RankContext, state: TrainingState, position: Position, sampler: Any,
               history: list[dict[str, Any]], fingerprint: dict[str, Any], warmup: Warmup,
               best: BestEpoch | None, trained: EpochSoFar | None = None, settled: bool = True) -> bool:
    """Park this rank's state in its worker for the gang's next formation; False where it cannot
    (a position the next formation could not start from, or the snapshot failed: logged, never
    raised, so the rank's own way out stays the one seen). The next formation then reads the
    checkpoint, as a fixed-size gang does. `trained`: the epoch's train sums so far, where every
    rank is here to add them up (a grow), for the next formation to go on with (`Position.carried`).
    A stopped run parks its stop: the next formation trains nothing more, wherever it stopped.
    `settled`: the model holds exactly the weights of the position parked; a state parked after a
    failure is not, and the next formation never takes its weights for a recorded epoch's
    (tasks/training/best_weights.py)."""
    where = 0 if position.stopped else position.global_position(sampler)
    if where is None:
        return False
    try:
        warmup.end_epoch(state.optimizer)  # the epoch's own rate, as a checkpoint holds it
        snapshot = state.snapshot(position.epoch - 1, history, fingerprint, ctx.world_size, best=best,
                                  stop=position.stopped)
        snapshot["position"] = where
        snapshot["trained"] = trained.as_dict() if trained else None
        snapshot["settled"] = settled
        buffer = io.BytesIO()
        torch.save(snapshot, buffer)
        ctx.park((position.epoch, where), buffer.getvalue(), carries=best[0] if best else -1)
    except Exception:
        run_logger().exception("Rank %d could not park its state; the next formation reads the checkpoint", ctx.rank)
        return False
    return True
