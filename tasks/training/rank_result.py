"""What one rank of the recipe returns to the flow.

It travels from the rank's Dask worker to the flow pickled, so it is a frozen dataclass in the
training layer, importable wherever the recipe is; prefect_ddp.tasks.results.aggregation makes
the run's summary of every rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefect_ddp.tasks.training.optimization import EffectiveRecipe


@dataclass(frozen=True)
class RankResult:
    """What one rank of `train_classifier` returns.

    Attributes:
        rank: the rank's number, 0 for the one that writes.
        worker_address: the Dask worker it ran on.
        split_digest: the digest of the split it trained on; every rank's must be the same.
        local_train_samples: images this rank trained on, per epoch trained in this attempt.
        checkpoint_s: the seconds training waited for each epoch's checkpoint (a copy to memory,
            and any earlier write still under way; 0 where none was taken), per epoch trained in
            this attempt (empty when it trained none); rank 0 alone writes, so its figures are
            the ones the summary shows.
        checkpoints: rank 0's checkpoint decision after each epoch trained in this attempt
            (`interval_s`, `unsaved_s`, `saved`; tasks/training/checkpoint_interval.py); empty
            on the other ranks.
        history: the gang's record of every epoch (a resumed run's earlier ones too),
            all-reduced, so the same on every rank.
        best_epoch: the epoch whose weights model.pt holds (prefect_ddp.tasks.selection);
            None when no epoch was kept.
        selected_by: how that epoch was chosen, in words ("highest val_acc").
        pruned_at: the epoch after which a sweep's pruner stopped the run; None when it was not.
        attempts: rank 0's record of the gang attempts that reached training (`attempt`,
            `world_size`, `resumed_after_epoch`); empty on the other ranks.
        unreadable: images left out as unreadable (prefect_ddp.tasks.training.unreadable):
            `decode_check` and `in_training` counts, and the first `keys` met in training.
        stopped: why every rank stopped for too many unreadable images; None when they did not.
        recipe: the recipe as it ran, with what its empty fields were left to.
        comparison: the kept model and this one scored on the same images
            (prefect_ddp.tasks.results.comparison); None without a kept model to beat, or when
            the run was pruned or stopped.
    """

    rank: int
    worker_address: str
    split_digest: str
    local_train_samples: list[int]
    checkpoint_s: list[float]
    history: list[dict[str, Any]]
    best_epoch: int | None
    selected_by: str
    pruned_at: int | None
    attempts: list[dict[str, Any]]
    unreadable: dict[str, Any]
    stopped: str | None
    recipe: EffectiveRecipe
    comparison: dict[str, Any] | None
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
