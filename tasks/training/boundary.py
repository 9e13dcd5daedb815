"""The one interface between the training loop and everything it does beside training.

The loop (tasks/training/recipe.py) knows epochs and steps. Whatever else happens between
them (telling the supervisor the rank is alive, keeping the best epoch, checkpointing,
showing progress, a sweep's pruning, an elastic gang growing) is a `BoundaryPart`, in a
module of its own, that the loop calls through `Boundaries` at three kinds of boundary:
after every optimizer step, after every epoch is recorded, and once the epochs are over.
The parts and their order are listed in one place, tasks/training/parts.py, and in
docs/architecture.md ("Training: a rank's life"); a caller of `train_classifier` may add its own.

A part is called on every rank, in the gang's order, so a part that asks the gang a question
(a collective) asks it at the same boundary on every rank. A part that ends the run early
returns a `Stop` from `after_epoch`: the epoch just recorded is kept, the parts after it in
the order are not called at that boundary, and the loop trains no further epoch. Every rank
must say Stop at the same boundary, or none: decide it from the gang's record, or ask the gang.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.training.pass_sums import PassSums
from prefect_ddp.tasks.training.run_stop import RunStop
from prefect_ddp.tasks.training.step_times import StepClock


@dataclass(frozen=True)
class StepEnd:
    """A rank's optimizer step just taken."""

    epoch: int  # counted from 0
    step: int  # this formation's steps of the epoch so far, from 1
    steps: int  # this rank's steps in the epoch from where this formation started it
    images: int  # the images this rank trained on in those steps
    seconds: float  # since this rank began the epoch
    sums: PassSums  # the epoch's train sums on this rank so far
    clock: StepClock  # where this rank's time went in the epoch so far (tasks/training/step_times.py)


@dataclass(frozen=True)
class EpochEnd:
    """An epoch trained, validated and recorded: its record is the last of `history`."""

    epoch: int  # counted from 0
    history: list[dict[str, Any]]  # the gang's record of every epoch of the run so far
    last: bool  # the run's last epoch: no epoch follows it

    @property
    def record(self) -> dict[str, Any]:
        return self.history[-1]


@dataclass(frozen=True)
class TrainingEnd:
    """The loop is over: every epoch trained, or the run stopped early (`stop`)."""

    history: list[dict[str, Any]]
    stop: RunStop | None = None
    stop_saved: bool = False  # the stop was read from the checkpoint: storage holds it already

    @property
    def completed(self) -> bool:
        """Every epoch trained, or a part's early stop ended the run as if its last epoch were the
        one it stopped after (`Stop`); not a prune, nor too many unreadable images."""
        return self.stop is None or self.stop.kind == "stop"


@dataclass(frozen=True)
class Stop:
    """A part's word that the run trains no further epoch; `why` is said in the rank's log.

    `pruned`: a sweep's pruner stopped it, so nothing of the run is kept for promotion and no
    champion is scored (RankResult.pruned_at). Otherwise the run ends as if its last epoch
    was this one (an early stop): its best epoch is kept and compared as any run's. Either way
    the stop is checkpointed as the run's end (tasks/training/run_stop.py): a resumed run
    trains no epoch after it.
    """

    why: str
    pruned: bool = False


class BoundaryPart:
    """What the loop calls between steps and epochs; each hook does nothing unless a part says so.

    `name` names the part in the rank's log. Hooks run in the
    training thread, so a hook that takes long holds the gang up: write in the background, as
    tasks/training/checkpoint_writer.py does.
    """

    name: str = "part"

    def after_step(self, step: StepEnd) -> None:
        """After every optimizer step of this rank."""

    def after_epoch(self, end: EpochEnd) -> Stop | None:
        """After each epoch is recorded; a Stop ends the run after this epoch."""
        return None

    def after_training(self, end: TrainingEnd) -> None:
        """Once, after the last epoch trained (or the one that stopped the run), before the ranks return."""

    def close(self) -> None:
        """Always, last, whether the formation ended well or not: let go of what the part holds."""


class Boundaries:
    """The parts of one formation, called in their order; each one's seconds at the latest boundary.

    Use it as a context manager: leaving the block closes every part, in reverse order, each
    also when one closed before it raised. The first part that failed to close is raised, unless
    the block itself is raising: then it is logged, and the block's own error is the one seen.
    """

    def __init__(self, parts: Sequence[BoundaryPart]) -> None:
        self.parts = list(parts)
        self.seconds = [0.0] * len(self.parts)  # each part's at the latest epoch boundary or end, in order

    def after_step(self, step: StepEnd) -> None:
        for part in self.parts:
            part.after_step(step)

    def after_epoch(self, end: EpochEnd) -> Stop | None:
        """Every part's `after_epoch` until one says Stop."""
        self.seconds = [0.0] * len(self.parts)
        for index, part in enumerate(self.parts):
            started = time.monotonic()
            stop = part.after_epoch(end)
            self.seconds[index] = time.monotonic() - started
            if stop:
                return stop
        return None

    def after_training(self, end: TrainingEnd) -> None:
        self.seconds = [0.0] * len(self.parts)
        for index, part in enumerate(self.parts):
            started = time.monotonic()
            part.after_training(end)
            self.seconds[index] = time.monotonic() - started

    def spent(self, kinds: tuple[type[BoundaryPart], ...]) -> float:
        """The seconds the parts of `kinds` spent at the latest boundary."""
        return sum(seconds for part, seconds in zip(self.parts, self.seconds) if isinstance(part, kinds))

    def __enter__(self) -> Boundaries:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        failures: list[Exception] = []
        for part in reversed(self.parts):
            try:
                part.close()
            except Exception as failure:
                failures.append(failure)
                if kind is not None:
                    run_logger().exception("The %s part could not close while the rank was already failing",
                                           part.name)
        if failures and kind is None:
            raise failures[0]
