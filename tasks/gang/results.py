"""What run_gang hands back: each rank's result, and the story of the attempts behind them.

A gang that was re-formed after a failure still returns one result per rank, so without a
record nobody reading the report would know that it failed on the way, why, or on which
workers. `GangResults` is a plain list of the ranks' results (existing callers index it
as before) that also carries that record.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

R = TypeVar("R")
COMPLETED = "completed"
# An elastic gang's attempt that left to be formed again larger (tasks/gang/resizing.py).
REGROUPED = "regrouped: a worker came free, and the gang was formed again larger"


@dataclass(frozen=True)
class GangAttempt:
    """One formation of the gang: where it ran, how long, and how it ended.

    Attributes:
        number: 1 for the first attempt, 2 for the first re-formation, ...
        workers: the Dask worker addresses of its ranks, in rank order.
        world_size: how many ranks it had.
        ended: "completed", REGROUPED, or the message of the failure that ended it.
        seconds: from submitting its ranks to its end (stopping its ranks included).
        started_at: when its workers were leased (Unix time): the gap since the attempt
            before ended is what the change of formation cost the supervisor.
    """

    number: int
    workers: list[str]
    world_size: int
    ended: str
    seconds: float
    started_at: float = 0.0


class GangResults(list[R]):
    """Each rank's return value in rank order, plus `.attempts`: every GangAttempt it took."""

    def __init__(self, results: Iterable[R] = (), attempts: Iterable[GangAttempt] = ()) -> None:
        super().__init__(results)
        self.attempts = list(attempts)
