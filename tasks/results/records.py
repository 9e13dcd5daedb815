"""The run's summary, made of its ranks' results (prefect_ddp.tasks.training.rank_result).

It is what `metrics.json` holds and what the `transfer-learning` flow returns, with the same
keys as its fields (`model_dump()`). Per-epoch records (`history`) stay dicts: checkpoints
hold them, and docs/troubleshooting.md names their keys.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from prefect_ddp.tasks.training.optimization import EffectiveRecipe
from prefect_ddp.tasks.training.step_times import EpochTiming


class RankPlace(BaseModel):
    """Where one rank ran: its number and its Dask worker's address."""

    rank: int
    worker_address: str


class AttemptRow(BaseModel):
    """One formation of the gang (prefect_ddp.tasks.gang.results.GangAttempt: number, workers,
    world_size, ended, seconds, started_at), with where rank 0 went on from: the epoch it
    resumed after (None when it never reached training, 0 when it started from the first
    epoch), the sample position within the next (`at_sample`, an elastic gang's formation
    that took over mid-epoch), and whether its state was handed over in memory; and
    `reformed_s`, the seconds between the attempt before ending and this one's start."""

    number: int
    workers: list[str]
    world_size: int
    ended: str
    seconds: float
    resumed_after_epoch: int | None
    started_at: float = 0.0
    at_sample: int = 0
    handed_over: bool = False
    reformed_s: float | None = None


class TrainingSummary(BaseModel):
    """The run's record: `metrics.json`, and the `transfer-learning` flow's return value.

    Attributes:
        world_size: how many ranks returned a result.
        ranks: where each rank ran, in rank order.
        split_digests: the ranks' split digests, each once: one, when they trained on the same split.
        train_size, val_size: images in the training and validation sets.
        history: rank 0's record of every epoch (RankResult.history).
        best_epoch, best_val_acc: the epoch whose weights model.pt holds, and its val accuracy.
        selected_by: how that epoch was chosen, in words; None for a run recorded before.
        final_val_acc, final_val_loss: the last epoch's.
        time: where the last epoch's time went, with rank 0's checkpoint time when this
            attempt trained it; None for a run recorded before the accounting.
        pruned_at: the epoch after which a sweep's pruner stopped the run; None when it was not.
        attempts: every gang attempt; empty where the gang's attempts were not given.
        unreadable: images left out as unreadable (RankResult.unreadable); empty for a run recorded before.
        recipe: the recipe as it ran; None for a run recorded before.
        comparison: with the kept model, on the same images (RankResult.comparison).
        files: the run's files by name (model.pt, metrics.json, report.md, ...), each its URL.
    """

    world_size: int
    ranks: list[RankPlace]
    split_digests: list[str]
    train_size: int
    val_size: int
    history: list[dict[str, Any]]
    best_epoch: int
    best_val_acc: float
    # Fields later releases added have defaults: a metrics.json an earlier release wrote (a
    # kept model's, a resumed sweep's best trial) still reads.
    selected_by: str | None = None
    final_val_acc: float
    final_val_loss: float
    time: EpochTiming | None = None
    pruned_at: int | None = None
    attempts: list[AttemptRow] = Field(default_factory=list)
    unreadable: dict[str, Any] = Field(default_factory=dict)
    recipe: EffectiveRecipe | None = None
    comparison: dict[str, Any] | None = None
    files: dict[str, str]
