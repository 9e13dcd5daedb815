"""Which epoch a run keeps: one rule for training, the run's summary, promotion and sweeps.

A run's model (`model.pt`) holds the weights of its best epoch: the first epoch with the
best value of the selection metric, `val_acc` (higher is better) unless the run is a
sweep trial, whose sweep names the metric and direction. The same rule picks the epoch the
summary and report call best, the value Optuna is told for a trial, and the epoch the
sweep's report names, so the model a sweep points at is the model it reports; promotion
compares the val accuracy of that same epoch. A value that is not a number (a diverged
epoch's loss) is never best, unless no epoch's is.

    >>> best_index([0.5, 0.9, 0.9, 0.7], "maximize")
    1
    >>> best_index([float("nan"), 2.0, 1.0], "minimize")
    2
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Direction = Literal["maximize", "minimize"]


@dataclass(frozen=True)
class Selection:
    """The metric (as the epochs' records name it) and whether more of it is better."""

    metric: str = "val_acc"
    direction: Direction = "maximize"

    def describe(self) -> str:
        return f"{'highest' if self.direction == 'maximize' else 'lowest'} {self.metric}"


def is_better(new: float, old: float | None, direction: Direction) -> bool:
    """Whether `new` beats `old` (None: nothing yet, which anything beats), strictly: a tie
    keeps the earlier epoch."""
    if old is None:
        return True
    if math.isnan(new):
        return False
    if math.isnan(old):
        return True
    return new > old if direction == "maximize" else new < old


def best_index(values: Sequence[float], direction: Direction) -> int:
    """The position of the first best value (the first one when none is a number)."""
    best = 0
    for position, value in enumerate(values):
        if position and is_better(value, values[best], direction):
            best = position
    return best
