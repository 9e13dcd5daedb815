"""A stratified, deterministic train/val split, computed once and shared by every rank.

Per-rank shuffles (as in the dask-pytorch-ddp examples) give each rank a different split,
so images one rank validates on are trained on by another. Here the flow splits once from
a seed and ships the same index lists to every rank.
"""

from __future__ import annotations

import random

from prefect import task
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel

from tasks.manifest import Manifest, digest


class Split(BaseModel):
    """Positions into the manifest; disjoint, and together every image of it."""

    train: list[int]
    val: list[int]
    seed: int
    val_fraction: float

    def digest(self, manifest: Manifest) -> str:
        """Fingerprint of the split's keys, compared across ranks."""
        return digest([manifest.paths[i] for i in self.train] + ["--"] + [manifest.paths[i] for i in self.val])


def stratified_split(manifest: Manifest, val_fraction: float, seed: int) -> Split:
    """Hold out `val_fraction` of every class; a class of 2+ images gives at least one each way.

    The result depends only on the keys, labels, fraction and seed, not on listing order.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive); got {val_fraction}.")
    by_class: dict[int, list[int]] = {}
    for position in sorted(range(len(manifest.paths)), key=manifest.paths.__getitem__):
        by_class.setdefault(manifest.labels[position], []).append(position)
    train: list[int] = []
    val: list[int] = []
    for label, positions in sorted(by_class.items()):
        random.Random(f"{seed}-{manifest.classes[label]}").shuffle(positions)
        n_val = round(len(positions) * val_fraction)
        if len(positions) >= 2:
            n_val = min(max(n_val, 1), len(positions) - 1)
        val += positions[:n_val]
        train += positions[n_val:]
    if not val:
        raise ValueError(
            f"val_fraction={val_fraction} leaves no validation images for {len(manifest)} "
            "images: raise val_fraction or add images."
        )
    return Split(train=sorted(train), val=sorted(val), seed=seed, val_fraction=val_fraction)


@task(name="split", retries=0, result_serializer="json")
def split_dataset(manifest: Manifest, val_fraction: float, seed: int) -> Split:
    """Split, and leave a table of train/val sizes per class."""
    split = stratified_split(manifest, val_fraction, seed)
    rows = []
    for label, name in enumerate(manifest.classes):
        n_train = sum(1 for i in split.train if manifest.labels[i] == label)
        n_val = sum(1 for i in split.val if manifest.labels[i] == label)
        rows.append({"class": name, "train": n_train, "val": n_val})
    rows.append({"class": "total", "train": len(split.train), "val": len(split.val)})
    create_table_artifact(
        key="train-val-split",
        table=rows,
        description=f"Stratified split, seed {seed}, val_fraction {val_fraction}.",
    )
    return split
