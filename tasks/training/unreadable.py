"""Images found unreadable during training: counted against `data.max_unreadable_fraction`, reported.

decode-check leaves out what it finds before any rank starts (prefect_ddp.tasks.data.validation). An image
it did not check (`data.validate_sample`), or one deleted or rewritten since, can still
fail when a loader reads it: the loaders leave it out of its batch (prefect_ddp.tasks.data.dataset) and
the training loop collects its key (tasks/training/epoch.py). This module keeps the count.

- After every epoch the ranks pool the keys they met (`all_gather_strings`): every rank
  holds the same set, so all decide alike at the same epoch boundary.
- The share is decode-check's exclusions plus the images met in training, over the images
  listed: each listed image was either left out by decode-check or is trained or
  validated on, so training meets it (docs/troubleshooting.md, "When something is wrong").
- Past the limit, every rank stops at that boundary, keeps no checkpoint or model of the
  epoch, and returns the reason; the flow fails with it in `aggregate`. A ValueError
  raised in a rank would be taken for a failed rank, and `cluster.max_restarts` would
  re-form the gang only to meet the same images.
- Each epoch's record lists the keys first met in it (`unreadable`), so a gang resumed
  from a checkpoint counts on from there, and metrics.json and the report name them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from pydantic import BaseModel, Field

from prefect_ddp.tasks.config import DataConfig
from prefect_ddp.tasks.data.dataset import SHOWN_KEYS
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.gang import all_gather_strings
from prefect_ddp.tasks.reporting import run_logger

REPORTED_KEYS = 20  # keys named in metrics.json and the report; each epoch's record holds all


class UnreadableLimit(BaseModel):
    """What the flow tells the ranks: how many images decode-check left out, and the limit."""

    excluded: int = Field(default=0, ge=0, description="Images decode-check left out: missing or not decoding.")
    limit: float = Field(default=DataConfig.model_fields["max_unreadable_fraction"].default, ge=0, le=1,
                         description="data.max_unreadable_fraction.")


class UnreadableTally:
    """A rank's count of unreadable images: decode-check's, and the keys the gang met in training.

    Args:
        limit: decode-check's exclusions and the limit, from the flow.
        manifest: the images training reads (decode-check's exclusions already out).
        device: where the pooling collective runs (nccl needs CUDA tensors).
        announce: log the images left out (rank 0 speaks for the gang).

    >>> paths = [f"a/{i}.jpg" for i in range(9)]
    >>> m = Manifest(root="s3://b/p", classes=["a"], paths=paths, sizes=[1] * 9, labels=[0] * 9)
    >>> tally = UnreadableTally(UnreadableLimit(excluded=1, limit=0.1), m)
    >>> tally.pool({"a/3.jpg"}, epoch=1)
    ['a/3.jpg']
    >>> tally.exceeded(epoch=1)[:61]
    "2 of the 10 images under 's3://b/p' (20.0%) could not be read"
    """

    def __init__(self, limit: UnreadableLimit, manifest: Manifest, device: torch.device | str = "cpu",
                 announce: bool = False) -> None:
        self.limit = limit
        self.root = manifest.root
        self.listed = len(manifest) + limit.excluded
        self.device = device
        self.announce = announce
        self.keys: list[str] = []  # met in training, in the order first met

    def after_resume(self, history: list[dict[str, Any]]) -> None:
        """Count on from the epochs a checkpoint holds."""
        self.keys = [key for record in history for key in record["unreadable"]]

    def pool(self, met: Iterable[str], epoch: int) -> list[str]:
        """Add the keys this rank met in `epoch` to the gang's; returns those the gang had not met.

        A collective: every rank calls it after every epoch, with what it met or nothing.
        """
        new = sorted(set(all_gather_strings(sorted(met), self.device)).difference(self.keys))
        self.keys += new
        if new and self.announce:
            run_logger().warning("Left out %d unreadable image(s) first met in epoch %d (missing or not decoding), "
                                 "e.g. %s", len(new), epoch, ", ".join(new[:SHOWN_KEYS]))
        return new

    def exceeded(self, epoch: int) -> str | None:
        """Why the run stops after `epoch`, when too large a share of the images could not be read; else None."""
        unreadable = self.limit.excluded + len(self.keys)
        share = unreadable / max(self.listed, 1)
        if share <= self.limit.limit:
            return None
        return (
            f"{unreadable} of the {self.listed} images under {self.root!r} ({share:.1%}) could not be read, more "
            f"than data.max_unreadable_fraction={self.limit.limit:g} allows: {self.limit.excluded} left out by "
            f"decode-check and {len(self.keys)} missing or undecodable when training read them (by epoch {epoch}), "
            f"e.g. {', '.join(self.keys[:SHOWN_KEYS])}. decode-check did not check them (data.validate_sample) or "
            "they changed since: fix or remove those files (data.validate_sample empty checks every image before "
            "training), or raise data.max_unreadable_fraction to train on the rest."
        )

    def summary(self) -> dict[str, Any]:
        """What a rank returns: the counts, and the first keys met in training."""
        return {"decode_check": self.limit.excluded, "in_training": len(self.keys), "keys": self.keys[:REPORTED_KEYS]}
