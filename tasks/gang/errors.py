"""What the gang raises: one base error, and the two ends a caller may want to tell apart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefect_ddp.tasks.gang.results import GangAttempt


class GangError(RuntimeError):
    """The gang could not be formed or did not finish; the message says which rank and why.

    `attempts` lists every attempt of the run_gang call it ended (workers, how each ended),
    so a report can show that the gang was re-formed; empty when no attempt was formed.
    """

    def __init__(self, message: str, attempts: Sequence[GangAttempt] = ()) -> None:
        super().__init__(message)
        self.attempts = list(attempts)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keeps `attempts` when Prefect or Dask pickle the error (the default keeps args only).
        return type(self), (str(self), self.attempts)

    def after(self, attempts: Sequence[GangAttempt], max_restarts: int) -> GangError:
        """This error as it ends a run_gang call: the same kind, saying how many attempts were made."""
        return type(self)(
            f"{self} [after {len(attempts)} attempt(s) of at most {max_restarts + 1} "
            f"(max_restarts={max_restarts}); this error's .attempts lists each one's workers and end]",
            attempts,
        )


class GangTimeout(GangError):
    """run_gang's `timeout` passed. Never retried: the limit covers all attempts together."""


class GangHung(GangError):
    """No rank made progress for the hang limit (docs/architecture.md, "Gang: progress"); the
    message names the rank, its worker, its last progress and how long it was silent. Retried
    like any failure: the gang is re-formed on healthy workers from the last checkpoint."""


class GangStopped(GangError):
    """Raised in a rank by `RankContext.check_stop()` once the supervisor stops the gang.

    Let it propagate: the rank then leaves its process group and its task run ends
    Cancelled, which is how the supervisor expects a stopped rank to end.
    """


class GangRegroup(Exception):
    """Raised by a rank's function to leave its formation for a larger one, after
    `RankContext.regroup_requested()` said so and it parked its state (tasks/gang/resizing.py).

    Not a GangError: nothing went wrong. The rank's task run completes, and the supervisor
    forms the gang again on the workers free.
    """


class GangRefused(GangError):
    """The chosen workers cannot run this gang as they are set up. Never retried: the fix is
    on the cluster or in the parameters, and a re-formed gang would meet the same."""
