"""A run that ended before its last epoch: a decision of the run, kept with its checkpoint.

A part's `Stop` (a caller's early stop, a sweep's prune: tasks/training/boundary.py) or too
many unreadable images (tasks/training/unreadable.py) ends the run early. The checkpointing
part saves the stop with the run's last checkpoint (tasks/training/checkpointing.py), and a
rank of an elastic gang parks it with its state (tasks/training/regrouping.py), so that every
resume (a flow retry, a re-formed gang, an elastic take-over) ends where the stop ended the
run, instead of training the epochs the stop ruled out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

StopKind = Literal["stop", "pruned", "unreadable"]


@dataclass(frozen=True)
class RunStop:
    """Why and after which epoch the run stopped.

    `epoch`: the last epoch recorded, counted from 1 (0: none was); an unreadable stop keeps
    nothing of the epoch it stopped in. `kind`: "stop" (a part's early stop: the run is kept and
    compared as any), "pruned" (a sweep's pruner: kept by no one) or "unreadable" (the flow fails
    with `why`).
    """

    epoch: int
    why: str
    kind: StopKind

    @property
    def pruned_at(self) -> int | None:
        return self.epoch if self.kind == "pruned" else None

    @property
    def unreadable(self) -> str | None:
        return self.why if self.kind == "unreadable" else None

    def as_dict(self) -> dict[str, Any]:
        """As the checkpoint holds it: plain values, which `torch.load(weights_only=True)` reads back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any] | None) -> RunStop | None:
        return cls(int(saved["epoch"]), str(saved["why"]), saved["kind"]) if saved else None
