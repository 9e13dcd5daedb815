"""A gang's link to the sweep trial it trains: report each epoch, learn whether to stop.

The study (Optuna's) is the sweep's: only the sweep's process opens it, so a sweep works on
a cluster that shares no disk with it, and one database engine serves every report. Rank 0
sends each epoch's metric to the sweep through a queue in the Dask scheduler and waits for
the pruner's answer on another (the sweep's end is `prefect_ddp.tasks.sweeps.trial_relay.TrialRelay`); the
answer is broadcast, so every rank ends at the same epoch boundary and no collective is
left waiting for a rank that stopped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import distributed

from prefect_ddp.tasks.gang.process_group import broadcast_flag
from prefect_ddp.tasks.selection import Direction, Selection

REPORTED_AT = "reported_at:"
PRUNED_AT = "pruned_at"
# How long rank 0 waits for the sweep's answer to one report before it gives up on the sweep.
ANSWER_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TrialLink:
    """Where a trial's reports go (the name of its queues in the Dask scheduler), and the
    metric the sweep optimises, which also picks the epoch whose weights the trial keeps."""

    channel: str
    number: int
    metric: str
    direction: Direction = "maximize"

    @property
    def selection(self) -> Selection:
        return Selection(self.metric, self.direction)

    @property
    def reports(self) -> str:
        return f"{self.channel}:reports"

    @property
    def answers(self) -> str:
        return f"{self.channel}:answers"

    def report(self, step: int, metrics: dict[str, Any], *, is_main: bool, device: str) -> bool:
        stop = False
        if is_main:
            if self.metric not in metrics:
                raise KeyError(
                    f"The sweep optimises {self.metric!r} but the training function reported "
                    f"{sorted(metrics)}: report it with ctx.report(step, {{{self.metric!r}: value}}), "
                    "or set the sweep's metric to one of those."
                )
            stop = self._ask(step, float(metrics[self.metric]))
        return broadcast_flag(stop, device)

    def _ask(self, step: int, value: float) -> bool:
        """Send one report to the sweep; its pruner's answer: whether to stop now."""
        client = rank_client()
        with scheduler_queue(self.reports, client) as reports, scheduler_queue(self.answers, client) as answers:
            reports.put({"step": step, "value": value, "at": time.time()})
            try:
                answer = answers.get(timeout=ANSWER_TIMEOUT_S)
            except (TimeoutError, distributed.TimeoutError) as exc:
                # Not the builtin TimeoutError: Prefect would record the rank as TimedOut.
                raise RuntimeError(
                    f"Trial {self.number}'s sweep did not answer its report of epoch {step} within "
                    f"{ANSWER_TIMEOUT_S:.0f} s: the sweep's process has stopped or cannot reach the "
                    "Dask scheduler."
                ) from exc
        if isinstance(answer, str):  # the sweep could not record the report
            raise RuntimeError(f"Trial {self.number}: {answer}")
        return bool(answer)


def rank_client() -> distributed.Client:
    """The Dask client of the worker this rank runs on (or this process's, outside a worker)."""
    try:
        return distributed.get_worker().client
    except ValueError:
        return distributed.get_client()


@contextmanager
def scheduler_queue(name: str, client: distributed.Client) -> Iterator[distributed.Queue]:
    """A queue in the scheduler, released when the block ends: the scheduler drops a queue
    once every holder released it, so trials leave nothing behind there."""
    queue = distributed.Queue(name, client=client)
    try:
        yield queue
    finally:
        queue.close()


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
