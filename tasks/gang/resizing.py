"""Growing a gang back while it trains: the supervisor notices free workers, the ranks regroup at a boundary.

A gang formed with a size range (`run_gang(..., min_world_size=...)`) starts on as many
workers up to `world_size` as are free, and shrinks to the survivors when one is lost. While
it trains below its top size, the supervisor asks the scheduler every few seconds which
workers no gang holds (tasks/gang/grow_watch.py); once one is, it sets the attempt's grow flag,
a `distributed.Event` beside its stop flag. A training function that can regroup asks at
its safe boundaries (`RankContext.regroup_requested`, a collective, so every rank gets rank
0's answer), parks its state (`RankContext.park`) and returns `ctx.regrouped()`. The gang is
then formed again on the workers free, more of them, and the new ranks take the parked state
over the new process group (tasks/gang/handover.py). A regroup is not a failure: it does not
count against `max_restarts`, and its attempt ends "regrouped" in the record. Functions that
never ask are never regrouped: they keep their size to the end, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect_ddp.tasks.gang.stopping import stop_requested


@dataclass(frozen=True)
class Regrouped:
    """What every rank of an attempt that left to regroup returns instead of its result."""

    world_size: int  # the size it had


def grow_flag_name(stop_flag: str) -> str:
    return f"{stop_flag}:grow"


def grow_requested(stop_flag: str | None) -> bool:
    """Whether the supervisor asked the attempt of `stop_flag` to regroup larger, as read in the
    last second (one scheduler round trip a second at most, as the stop flag's reads: a rank
    may ask after every few steps)."""
    return stop_requested(grow_flag_name(stop_flag)) if stop_flag is not None else False
