"""What a rank is told about its gang, and how it learns that the gang is stopping."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from prefect_ddp.tasks.gang.errors import GangStopped
from prefect_ddp.tasks.gang.fencing import check_lease
from prefect_ddp.tasks.gang.handover import Parked, hand_over, park
from prefect_ddp.tasks.gang.process_group import broadcast_flag
from prefect_ddp.tasks.gang.progress import send_progress
from prefect_ddp.tasks.gang.resizing import grow_requested
from prefect_ddp.tasks.gang.stopping import stop_requested
from prefect_ddp.tasks.gang.trial import TrialLink

# A round of `RankContext.wait_for_main`: how long rank 0 waits before the ranks hear again.
WAIT_ROUND_S = 1.0


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
    stop_flag: str | None = None  # the scheduler Event the supervisor sets to stop this attempt
    lease: str | None = None  # the scheduler's id of the gang's lease on this worker (tasks/gang/fencing.py)
    gang_id: str | None = None  # one run_gang call's, the same in all its attempts: names its parked state
    max_world_size: int | None = None  # the most ranks the gang may regroup to (None: any free worker)
    elastic: bool = False  # formed with a size range: its function may park state and regroup
    regroups: int = 0  # the attempts before this one that ended in a regroup, not a failure

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def progress_topic(self) -> str | None:
        """The Dask event topic this attempt's ranks report their progress on."""
        return f"{self.stop_flag}-progress" if self.stop_flag else None

    def progress(self, phase: str, epoch: int | None = None, step: int | None = None) -> None:
        """Say where this rank is now: rendezvous, download, data, step, validation or checkpoint.

        The supervisor takes a gang that makes no progress for the hang limit for hung
        (docs/architecture.md, "Gang: progress"); data, validation and checkpoint phases get
        a longer allowance, so call this before a long load or save. Within a phase, call it
        again (or `check_stop()`) as work gets done: each call is progress.
        """
        send_progress(self.progress_topic, self.rank, phase, epoch, step)

    def wait_for_main(self, ready: Callable[[float], bool]) -> None:
        """Every rank waits here until rank 0's `ready(seconds)` (which may block that long) says
        True: rank 0 finishing a long write, say. A collective: call it on every rank.

        In rounds of WAIT_ROUND_S, each a one-flag broadcast: no collective lasts past a round,
        so a write longer than the process group's timeout fails no peer. The waiting sends no
        progress: rank 0's work reports its own as it advances (a write, per part written:
        tasks/data/storage.py), so one that is stuck is still taken for a hang.
        """
        while not broadcast_flag(ready(WAIT_ROUND_S) if self.is_main else False, self.device):
            self.check_stop()

    def report(self, step: int, metrics: dict[str, Any]) -> bool:
        """Report one epoch's metrics to the sweep; True when every rank should stop now.

        Call it on every rank after every epoch (it is a collective): rank 0 reports to
        the study and asks the pruner, every rank learns the answer, so all stop at the
        same epoch boundary. Outside a sweep it reports nothing and returns False.
        """
        if self.trial is None:
            return False
        return self.trial.report(step, metrics, is_main=self.is_main, device=self.device)

    def check_stop(self) -> None:
        """Raise GangStopped once the supervisor has asked this gang to stop; call it between steps.

        The supervisor asks when the flow run is cancelled or interrupted, the gang's
        timeout passes, or another rank or worker failed; and it raises once the gang no
        longer holds this worker (`check_lease`, read at most every 5 s). Leaving here, between steps, ends
        the rank cleanly (its process group is destroyed, its worker stays usable) instead
        of being cancelled mid-step and its worker restarted. Cheap enough for every
        optimizer step: the flag is read from the scheduler at most once a second. Without
        a flag (a unit test, a context made by hand) or outside a Dask worker it does nothing.

        Each rank reads the flag on its own, so they may leave one step apart; a peer left
        waiting in a collective fails on the closed connection, and is recorded as stopped
        too. Example, in a training loop:

            for batch in loader:
                train_step(model, batch)
                ctx.check_stop()
        """
        send_progress(self.progress_topic, self.rank)
        if stop_requested(self.stop_flag):
            raise GangStopped(
                f"Rank {self.rank} on {self.worker_address} left between steps: the gang supervisor "
                "asked this gang to stop (the flow run was cancelled, the gang's timeout passed, or "
                "another rank or its worker failed)."
            )
        check_lease(self.rank, self.worker_address, self.lease)

    def check_lease(self) -> None:
        """Raise GangStopped when the gang no longer holds this worker, and a GangError (a failure,
        retried) when the scheduler cannot be asked; call it right before writing anything a
        later run reads (a checkpoint, the model).

        The scheduler gives a gang's leases back once its flow process stops renewing them
        (killed, frozen or cut off): its ranks must not write on beside a new run's gang
        (tasks/gang/fencing.py). It asks the scheduler now, one round trip; without a lease
        (a unit test, a context made by hand) or outside a Dask worker it does nothing.
        """
        check_lease(self.rank, self.worker_address, self.lease, max_age_s=0)

    def regroup_requested(self) -> bool:
        """Whether the gang should regroup larger now; call it on every rank at a safe boundary
        (a collective: every rank gets rank 0's answer, so all leave together, or none).

        True once the supervisor saw a worker free for a gang formed with a size range
        (tasks/gang/resizing.py). Then park the state (`park`) and raise GangRegroup; the gang
        is formed again on more workers and `hand_over` gives the parked state to every rank.
        """
        below_top = self.max_world_size is None or self.world_size < self.max_world_size
        asked = self.is_main and below_top and grow_requested(self.stop_flag)
        return broadcast_flag(asked, self.device)

    def park(self, position: tuple[int, int], data: bytes, carries: int = -1) -> None:
        """Keep `data` in this worker's memory for the gang's next formation; `position` orders
        the ranks' parked states (the newest is handed over; of equally new ones, one whose
        `data` carries weights storage may lack: their epoch, -1 for none). Nothing without a
        gang id (a context made by hand)."""
        if self.gang_id is not None:
            park(self.gang_id, position, data, carries)

    def hand_over(self, device: torch.device | str = "cpu") -> Parked | None:
        """The newest state a rank of this formation parked in an earlier one, on every rank (a
        collective); None where none did, and the function reads its checkpoint instead."""
        return hand_over(self.gang_id, device) if self.gang_id is not None else None
