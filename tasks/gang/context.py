"""What a rank is told about its gang, and the one error the gang raises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tasks.gang.trial import TrialLink


@dataclass(frozen=True)
class RankContext:
    """What a rank knows about its place in the gang; handed to the training function."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str
    device: str
    worker_address: str
    master_addr: str
    master_port: int
    attempt: int = 0
    output_url: str | None = None
    init_timeout_s: float = 300.0
    trial: TrialLink | None = None  # set when the gang trains one trial of a sweep

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def report(self, step: int, metrics: dict[str, Any]) -> bool:
        """Report one epoch's metrics to the sweep; True when every rank should stop now.

        Call it on every rank after every epoch (it is a collective): rank 0 reports to
        the study and asks the pruner, every rank learns the answer, so all stop at the
        same epoch boundary. Outside a sweep it reports nothing and returns False.
        """
        if self.trial is None:
            return False
        return self.trial.report(step, metrics, is_main=self.is_main, device=self.device)


class GangError(RuntimeError):
    """The gang could not be formed or did not finish; the message says which rank and why."""
