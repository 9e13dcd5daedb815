"""A gang's link to the sweep trial it trains: report each epoch, learn whether to stop.

The Optuna study lives in storage that rank 0 can open (the sweep's SQLite file, or an
RDB URL). Rank 0 reports the metric and asks the pruner; the answer is broadcast, so every
rank ends at the same epoch boundary and no collective is left waiting for a rank that
stopped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from tasks.process_group import broadcast_flag


REPORTED_AT = "reported_at:"
PRUNED_AT = "pruned_at"


@dataclass(frozen=True)
class TrialLink:
    """Where a trial's reports go: the study's storage, its name, the trial, the metric, and
    the sweep's pruner (Optuna keeps no pruner with a study: loaded without one, it would
    judge by its default)."""

    storage: str
    study_name: str
    trial_id: int
    metric: str
    pruner: Any = None

    def report(self, step: int, metrics: dict[str, Any], *, is_main: bool, device: str) -> bool:
        stop = False
        if is_main:
            import optuna

            if self.metric not in metrics:
                raise KeyError(
                    f"The sweep optimises {self.metric!r} but the training function reported "
                    f"{sorted(metrics)}: report it with ctx.report(step, {{{self.metric!r}: value}}), "
                    "or set the sweep's metric to one of those."
                )
            study = optuna.load_study(study_name=self.study_name, storage=self.storage, pruner=self.pruner)
            trial = optuna.trial.Trial(study, self.trial_id)
            trial.report(float(metrics[self.metric]), step)
            # When, so the sweep can plot the metric against wall time.
            trial.set_user_attr(f"{REPORTED_AT}{step}", time.time())
            stop = trial.should_prune()
            if stop:
                trial.set_user_attr(PRUNED_AT, step)
        return broadcast_flag(stop, device)


# The trial a flow run trains, set by the sweep around a trial's child flow run, so the
# transfer-learning flow's Run form needs no parameter that only sweeps use.
_current_trial: ContextVar[TrialLink | None] = ContextVar("current_trial", default=None)


def current_trial() -> TrialLink | None:
    """The sweep trial this thread trains, if any.

    A function, not the ContextVar itself, for the flows to name: Prefect sends a flow's
    function by value with every Dask task of its run, with the globals it names, and a
    ContextVar cannot be pickled.
    """
    return _current_trial.get()


@contextmanager
def training_trial(link: TrialLink) -> Iterator[None]:
    """Within the block, flow runs started in this thread train `link`'s trial."""
    token = _current_trial.set(link)
    try:
        yield
    finally:
        _current_trial.reset(token)
