"""How a rank of an elastic gang leaves its formation: asked to grow, or after a failure.

Either way it parks its state in its worker for the next formation (tasks/training/regrouping.py),
which takes it over in memory instead of reading the checkpoint. The grow checks
(tasks/training/grow_checks.py) call `regroup` at a boundary; the recipe calls `after_failure`
when the formation fails (tasks/training/recipe.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NoReturn

from prefect_ddp.tasks.gang import GangRegroup, RankContext
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.training.best_weights import BestWeights
from prefect_ddp.tasks.training.checkpoints import TrainingState
from prefect_ddp.tasks.training.optimization import Warmup
from prefect_ddp.tasks.training.progress import ProgressReporter
from prefect_ddp.tasks.training.regrouping import EpochSoFar, Position, park_state


@dataclass
class Leaving:
    """How a rank of an elastic gang leaves its formation: its state parked for the next one
    (tasks/training/regrouping.py); a fixed-size gang's ranks park nothing."""

    ctx: RankContext
    state: TrainingState
    position: Position
    sampler: Any
    history: list[dict[str, Any]]
    fingerprint: dict[str, Any]
    warmup: Warmup
    kept: BestWeights

    def regroup(self, progress: ProgressReporter, trained: EpochSoFar | None) -> NoReturn:
        """Asked to regroup larger, at an epoch's end or mid-epoch: park, and leave for the larger formation."""
        sample = self.position.global_position(self.sampler)
        where = (f"after epoch {self.position.epoch}" if not sample
                 else f"at sample {sample} of epoch {self.position.epoch + 1}")
        said = (f"A worker came free: the gang of {self.ctx.world_size} ranks forms again larger {where}, "
                "its state kept in memory")
        progress.note(self.position.epoch + (sample / self.sampler.size if sample else 0), said)
        run_logger().log(logging.INFO if self.ctx.is_main else logging.DEBUG, said)
        self._park(trained, settled=True)
        raise GangRegroup(f"rank {self.ctx.rank} regroups {where}")

    def after_failure(self) -> None:
        """A peer was lost, or this rank failed: park what the survivors may hand over (best effort);
        before its first step a formation passes on what it took over whole."""
        if self.ctx.elastic:
            self._park(self.position.carried if self.position.samples == 0 else None)

    def _park(self, trained: EpochSoFar | None = None, settled: bool = False) -> None:
        """`settled`: the model holds exactly the weights of the position parked (a regroup, at a
        boundary). A rank parking after a failure may have begun the next step: its forward pass
        changed BatchNorm's running statistics, so its weights are taken for no recorded epoch's."""
        # Mid-epoch the model has moved past every recorded epoch, and a stopped run's is taken for none
        # (tasks/training/run_stop.py): kept best weights go along whatever their epoch.
        at_boundary = settled and not self.position.stopped and self.position.global_position(self.sampler) == 0
        best = self.kept.unwritten(self.position.epoch if at_boundary else None)
        park_state(self.ctx, self.state, self.position, self.sampler, self.history, self.fingerprint, self.warmup,
                   best, trained, settled=settled)
