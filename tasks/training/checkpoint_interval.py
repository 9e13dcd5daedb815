"""How often rank 0 checkpoints: every epoch, or at the interval Young and Daly's rule gives.

A checkpoint stalls the gang while rank 0 copies its state (δ, measured at every save),
and a failure loses the work since the last one. Checkpointing every epoch wastes δ per
epoch: 10-18 % of a 64-GPU job's time in docs/scaling.md's figures, against 0.4-1 % at the
interval that balances the two, τ = sqrt(2 δ M) for a mean time between failures M
(Young), in Daly's higher-order form. With `training.checkpoint_every="auto"` rank 0 takes
δ from its own saves, M from the failures this run has seen (its attempts) or, before any,
`training.mtbf_h`, and caps τ at `training.max_lost_min` so a run never risks more work
than that. Epochs are the boundaries: rank 0 checkpoints after an epoch when waiting for
the next one would leave more than τ of training unsaved, and always after the last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from prefect_ddp.tasks.config import TrainingConfig


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Daly's optimum interval between checkpoints, in seconds of work, for a blocking save
    of `save_s` and a mean time between failures of `mtbf_s`.

    Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps"
    (2006): τ = sqrt(2δM)(1 + sqrt(δ/2M)/3 + (δ/2M)/9) - δ for δ < 2M, else M. The
    64-GPU example of docs/scaling.md (section 5, case B: ResNet-50, δ = 2 s, 8 nodes of 633.6 h
    each, so M = 633.6 / 8 = 79.2 h):

    >>> round(young_daly_interval_s(2.0, 79.2 * 3600))
    1067
    """
    if save_s <= 0:
        return 0.0
    if mtbf_s <= 0:
        raise ValueError(f"mtbf_s={mtbf_s} is not positive: give the mean time between failures in seconds.")
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_s


@dataclass
class CheckpointSchedule:
    """Rank 0's decision, after each epoch, whether to checkpoint now.

    `every_epoch`: today's behaviour. Otherwise the interval follows the measured save cost
    and the failures seen, capped at `max_lost_s`.
    """

    every_epoch: bool
    mtbf_s: float  # expected time between failures before this run has seen any
    max_lost_s: float  # never more than this much training unsaved at a boundary
    failures: int = 0  # failures this run has seen (the gang's earlier attempts)
    trained_s: float = 0.0  # training time of this run so far, earlier attempts' included
    unsaved_s: float = 0.0  # training time since the last checkpoint
    save_s: float | None = None  # the blocking part of the last save
    decisions: list[dict[str, Any]] = field(default_factory=list)  # per epoch: auto, interval, capped, unsaved, saved

    @classmethod
    def for_run(cls, cfg: TrainingConfig, failures: int, history: list[dict[str, Any]],
                every_epoch: bool = False) -> CheckpointSchedule:
        """The schedule of `cfg` for a gang that has seen `failures` and trained the epochs of
        `history`; `every_epoch` whatever `cfg` says (a sweep's trial: tasks/training/checkpointing.py)."""
        return cls(every_epoch=every_epoch or cfg.checkpoint_every == "epoch", mtbf_s=cfg.mtbf_h * 3600,
                   max_lost_s=cfg.max_lost_min * 60, failures=failures,
                   trained_s=sum(float(h.get("seconds", 0.0)) for h in history))

    @property
    def mtbf_seen_s(self) -> float:
        """M: the parameter until a failure is seen, then the shorter of it and what was seen."""
        if self.failures == 0:
            return self.mtbf_s
        return min(self.mtbf_s, max(self.trained_s, 1.0) / self.failures)

    @property
    def interval_s(self) -> float:
        """τ now: Young/Daly from the last save's cost, capped at max_lost_s; 0 before any save
        (the first boundary saves, and measures δ)."""
        if self.every_epoch or self.save_s is None:
            return 0.0
        return min(young_daly_interval_s(self.save_s, self.mtbf_seen_s), self.max_lost_s)

    def due(self, epoch_s: float, last: bool) -> bool:
        """After an epoch of `epoch_s` seconds (`last`: the last this run trains): checkpoint now?
        Records the decision."""
        self.trained_s += epoch_s
        self.unsaved_s += epoch_s
        # Waiting one more epoch would leave unsaved_s + epoch_s at risk at the next boundary.
        save = self.every_epoch or last or self.unsaved_s + epoch_s > self.interval_s
        self.decisions.append({"auto": not self.every_epoch, "interval_s": round(self.interval_s, 1),
                               "capped": 0 < self.interval_s == self.max_lost_s,
                               "unsaved_s": round(self.unsaved_s, 1), "saved": save})
        return save

    def saved(self, blocking_s: float) -> None:
        """A checkpoint was taken; its blocking part took `blocking_s`."""
        self.save_s = blocking_s
        self.unsaved_s = 0.0
