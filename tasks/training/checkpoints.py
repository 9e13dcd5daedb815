"""Checkpoints a re-formed gang resumes from, and the guard that they belong to this job.

A checkpoint is a plain dict (model, optimizer, lr_scheduler, scaler, epoch, history), as
in torchvision's reference recipe, plus two things a resume must check: the job's
fingerprint (classes, split, model and recipe), so a run never continues another job's
training, and the world size it was written at, so a gang re-formed on fewer workers
keeps the learning rate the linear scaling rule gives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.swa_utils import AveragedModel

from prefect_ddp.tasks.data.storage import (
    GARBLED,
    exists,
    garbled_text,
    read_bytes,
    read_json,
    torch_from_bytes,
    write_json,
)
from prefect_ddp.tasks.gang import broadcast_bytes
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.training.checkpoint_writer import to_cpu
from prefect_ddp.tasks.training.run_stop import RunStop

# The recipe fields that change what a resumed training would compute.
RECIPE_FIELDS = {"batch_size", "image_size", "optimizer", "lr", "momentum", "weight_decay",
                 "scale_lr_by_world_size", "warmup_epochs", "sync_batchnorm", "scheduler", "amp", "amp_dtype"}


def job_fingerprint(classes: list[str], split_digest: str, model: Any, training: Any) -> dict[str, Any]:
    """What a checkpoint must match to be resumed (epochs may grow; loader settings may change).

    The fine-tuning knobs count where set (`knobs_set`), so that a checkpoint written before they
    existed still matches a job that leaves them at their defaults, as it trained."""
    return {
        "classes": list(classes),
        "split_digest": split_digest,
        "model": model.model_dump(include={"backbone", "freeze_backbone"}),
        "recipe": training.model_dump(include=RECIPE_FIELDS) | training.knobs_set(),
    }


class CheckpointMismatch(ValueError):
    """The checkpoint in the run's folder was written by another job."""


# The best epoch's weights, when a checkpoint carries them: (epoch counted from 1, state dict).
BestEpoch = tuple[int, dict[str, torch.Tensor]]


class Resumed(NamedTuple):
    """What the last checkpoint gives back (`TrainingState.resume`)."""

    next_epoch: int  # the first epoch still to train, counted from 0
    history: list[dict[str, Any]]
    best: BestEpoch | None  # the best epoch's weights, where they are not the checkpoint's own
    position: int = 0  # the global sample position reached within next_epoch (a state parked mid-epoch)
    # What the formations before trained of next_epoch up to `position`, where the last left whole
    # (to grow): tasks/training/regrouping.py's EpochSoFar, as parked; None where a rank was lost.
    trained: dict[str, Any] | None = None
    stopped: RunStop | None = None  # the run ended here early: nothing more is trained (tasks/training/run_stop.py)
    # The model holds exactly the weights of `next_epoch - 1` (a checkpoint, a regroup's park), not a
    # failed formation's, whose next step may have begun (tasks/training/leaving.py).
    settled: bool = True


@dataclass
class TrainingState:
    """Everything a checkpoint restores, kept together so saving and loading stay in step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    average: AveragedModel | None = None  # training.ema_decay's average of the weights (tasks/training/weights_average.py)

    def snapshot(self, epoch: int, history: list[dict[str, Any]], fingerprint: dict[str, Any],
                 world_size: int, best: BestEpoch | None = None, stop: RunStop | None = None) -> dict[str, Any]:
        """The checkpoint, copied into memory of its own (`to_cpu`): training may go on while it
        is written (tasks/training/checkpoint_writer.py).

        `best`: the best epoch's weights (already a copy) when they are not this epoch's and
        model.pt may not hold them yet: a gang resumed from this checkpoint writes model.pt
        from them (tasks/training/best_weights.py). `stop`: the run ended early after `epoch`;
        a gang resumed from this checkpoint trains nothing more.
        """
        snapshot: dict[str, Any] = to_cpu({
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "scaler": self.scaler.state_dict(),
            "epoch": epoch,
            "history": history,
            "job": fingerprint,
            "world_size": world_size,
        })
        if self.average is not None:  # training.ema_decay's: a run without one writes no key
            snapshot["average"] = to_cpu(self.average.state_dict())
        if best is not None:
            snapshot["best"] = {"epoch": best[0], "model": best[1]}
        if stop is not None:
            snapshot["stopped"] = stop.as_dict()
        return snapshot

    def resume(self, url: str, options: dict[str, Any], fingerprint: dict[str, Any],
               world_size: int, scale_lr: bool, device: torch.device | str = "cpu",
               handed: bytes | None = None) -> Resumed:
        """Load the last committed checkpoint, if any: where to go on, the history so far, and
        the best epoch's weights it carries. `handed`: a snapshot every rank already holds (an
        elastic gang's survivor handed it over in memory: tasks/gang/handover.py), loaded
        instead; storage is then not read.

        Rank 0 alone reads storage and every rank loads the bytes it read. Ranks that read
        for themselves could disagree: on separate hosts with a local output folder each
        sees its own disk, and a checkpoint can land between two reads. They would then
        train on from different epochs with different optimizer states. Call it before DDP
        wraps the model, on every rank (it is a collective).
        """
        if handed is None:
            data = broadcast_bytes(read_committed(url, options) if is_rank0() else None, device)
        else:
            data = handed
        checkpoint = readable_checkpoint(url, data)
        if checkpoint is None:
            return Resumed(0, [], None)
        refuse_other_jobs(url, checkpoint.get("job"), fingerprint)
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        if self.scheduler is not None and checkpoint["lr_scheduler"] is not None:
            self.scheduler.load_state_dict(checkpoint["lr_scheduler"])
        if checkpoint["scaler"]:  # empty when saved without loss scaling (bfloat16, or no amp)
            self.scaler.load_state_dict(checkpoint["scaler"])
        if self.average is not None:  # the fingerprint's ema_decay: a checkpoint of this job carries one
            self.average.load_state_dict(checkpoint["average"])
        if scale_lr and checkpoint["world_size"] != world_size:
            rescale_lr(self.optimizer, self.scheduler, world_size / checkpoint["world_size"])
        # Absent in checkpoints of older releases and of every-epoch runs. Rank 0 alone writes model.pt,
        # but every rank of an elastic gang keeps what a handed-over state carries (it may hand it on).
        best = checkpoint.get("best") if is_rank0() or handed is not None else None
        return Resumed(checkpoint["epoch"] + 1, list(checkpoint["history"]),
                       (best["epoch"], best["model"]) if best else None, checkpoint.get("position", 0),
                       checkpoint.get("trained"), RunStop.from_dict(checkpoint.get("stopped")),
                       checkpoint.get("settled", True))


def readable_checkpoint(url: str, data: bytes | None) -> dict[str, Any] | None:
    """The checkpoint in `data`, or None where there is none or it cannot be read (cut short or
    garbled in storage): the gang then starts over, as every rank holds the same bytes and so
    decides alike, instead of failing every attempt on the same file."""
    if data is None:
        return None
    try:
        checkpoint: dict[str, Any] = torch_from_bytes(data)
    except GARBLED as error:
        if is_rank0():
            run_logger().warning("The checkpoint at %s cannot be read (%s): training starts over from epoch 1, "
                                 "and the next checkpoint replaces it.", url, garbled_text(error))
        return None
    return checkpoint


def is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def read_committed(url: str, options: dict[str, Any]) -> bytes | None:
    """The checkpoint's bytes, or None before the first one is written (it is written whole or not at all)."""
    return read_bytes(url, options) if exists(url, options) else None


def refuse_other_jobs(url: str, theirs: dict[str, Any] | None, ours: dict[str, Any]) -> None:
    if theirs == ours:
        return
    differs = sorted(k for k in ours if (theirs or {}).get(k) != ours[k])
    shown = "; ".join(f"{k}: checkpoint {(theirs or {}).get(k)!r}, this run {ours[k]!r}" for k in differs)
    raise CheckpointMismatch(
        f"The checkpoint at {url} belongs to another job ({shown}); resuming it would continue "
        "someone else's training. Give this run its own output.url, or delete that checkpoint "
        "if it is no longer wanted."
    )


def rescale_lr(optimizer: torch.optim.Optimizer, scheduler: Any, factor: float) -> None:
    """Scale the learning rate (and what the scheduler derives it from) by `factor`."""
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def record_attempt(url: str, options: dict[str, Any], attempt: int, world_size: int,
                   resumed_after_epoch: int, at_sample: int = 0, handed_over: bool = False,
                   regroups: int = 0) -> list[dict[str, Any]]:
    """Append this gang attempt's start to the run's list; returns the list so far.

    An attempt that fails before its first checkpoint leaves no trace in the checkpoint,
    so the list is a file of its own, written by rank 0 when each attempt starts. `at_sample`:
    the global sample position within the next epoch it went on from; `handed_over`: its state
    came from a rank of the formation before, in memory (tasks/gang/handover.py), not storage;
    `regroups`: the attempts of its `run_gang` call before it that ended in a regroup.
    """
    attempts = earlier_attempts(url, options)
    attempts.append({"attempt": attempt, "world_size": world_size, "resumed_after_epoch": resumed_after_epoch,
                     "at_sample": at_sample, "handed_over": handed_over, "regroups": regroups})
    write_json(url, attempts, options)
    return attempts


def earlier_attempts(url: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    """The attempts recorded so far; none where the file is not there, or cannot be read (it is
    then written anew, without them: the report shows fewer attempts, the run goes on)."""
    if not exists(url, options):
        return []
    try:
        attempts = read_json(url, options)
        if not isinstance(attempts, list) or not all(isinstance(row, dict) for row in attempts):
            raise ValueError(f"not a list of attempts: {type(attempts).__name__}")
    except GARBLED as error:
        run_logger().warning("The gang's attempts so far, %s, cannot be read (%s): recording them anew from this "
                             "attempt; the report lists the attempts from here on.", url, garbled_text(error))
        return []
    return attempts


def failures_seen(attempts: list[dict[str, Any]], attempt: int, regroups: int) -> int:
    """The failures before this attempt, for the checkpoint schedule: the attempts of rank 0's
    record before it (a Prefect retry's earlier ones too) less those that followed a regroup,
    which is no failure; at least this `run_gang` call's own (`attempt`, from 0, less its
    `regroups`), where an attempt failed before rank 0 recorded it."""
    after_regroup = sum(1 for before, row in zip(attempts, attempts[1:])
                        if row["attempt"] > 1 and row.get("regroups", 0) > before.get("regroups", 0))
    return max(len(attempts) - 1 - after_regroup, attempt - regroups)
