"""A stratified, deterministic train/val split, computed once and shared by every rank.

Per-rank shuffles (as in the dask-pytorch-ddp examples) give each rank a different split,
so images one rank validates on are trained on by another. Here the flow splits once from
a seed and ships the same index lists to every rank.

An image's side depends on the image alone: a hash of its key and the seed, read as a
number in [0, 1), against `val_fraction`. A nightly run over a growing bucket therefore
never moves an image an earlier run trained on into validation (reshuffling each class
whenever images were added did: 198 of 404 new validation images of a class grown from
1,000 to 1,010 had been trained on, and warm starts then validated on their own training
images). The price is exactness: each class's share held out is `val_fraction` within
binomial noise (for a class of n images, within 2 x sqrt(f (1 - f) / n) of f about 19
times in 20) rather than rounded to the image. One exception keeps every class of two or
more images on both sides: a class with no image below the threshold holds out its image
nearest to it, and a class with every image below holds its image nearest the threshold
back for training; the latter (a class of 2 at 20 %: 1 time in 25) is the one case where a
later, larger class can move that image into validation.
"""

from __future__ import annotations

import hashlib

from prefect import task
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel

from prefect_ddp.tasks.data.manifest import Manifest, digest


class Split(BaseModel):
    """Positions into the manifest; disjoint, and together every image of it."""

    train: list[int]
    val: list[int]
    seed: int
    val_fraction: float

    def digest(self, manifest: Manifest) -> str:
        """Fingerprint of the split's keys, compared across ranks."""
        return digest([manifest.paths[i] for i in self.train] + ["--"] + [manifest.paths[i] for i in self.val])

    def record(self, manifest: Manifest) -> dict[str, object]:
        """What the model card says of the split its model was trained and selected on."""
        return {"source": manifest.root, "seed": self.seed, "val_fraction": self.val_fraction,
                "val_images": len(self.val), "val_digest": digest([manifest.paths[i] for i in self.val])}


def draw(key: str, seed: int) -> float:
    """The image's number in [0, 1): it goes to validation when below val_fraction.

    >>> round(draw("cat/001.jpg", 0), 6)
    0.488005
    """
    return int.from_bytes(hashlib.sha256(f"{seed}\0{key}".encode()).digest()[:8], "big") / 2**64


def both_sides(draws: list[tuple[float, int]], val_fraction: float) -> tuple[list[int], list[int]]:
    """(held out, kept) for a class whose draws all fell on one side: the image nearest
    the threshold crosses over, so the class is both trained and validated on."""
    nearest = min(draws, key=lambda d: abs(d[0] - val_fraction))[1]
    others = [position for _, position in draws if position != nearest]
    all_held = draws[0][0] < val_fraction
    return (others, [nearest]) if all_held else ([nearest], others)


def stratified_split(manifest: Manifest, val_fraction: float, seed: int) -> Split:
    """Hold out the images whose `draw` is below `val_fraction`, class by class.

    The result depends only on the keys, labels, fraction and seed, not on listing order
    nor on which other images exist (but for the two-sided rule of the module docstring).
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive); got {val_fraction}.")
    by_class: dict[int, list[tuple[float, int]]] = {}
    for position, key in enumerate(manifest.paths):
        by_class.setdefault(manifest.labels[position], []).append((draw(key, seed), position))
    train: list[int] = []
    val: list[int] = []
    for draws in by_class.values():
        held = [position for number, position in draws if number < val_fraction]
        kept = [position for number, position in draws if number >= val_fraction]
        if len(draws) >= 2 and not (held and kept):
            held, kept = both_sides(draws, val_fraction)
        val += held
        train += kept
    if not val:
        raise ValueError(
            f"val_fraction={val_fraction} leaves no validation images for {len(manifest)} "
            "images: raise val_fraction or add images."
        )
    return Split(train=sorted(train), val=sorted(val), seed=seed, val_fraction=val_fraction)
def share(n_val: int, n_train: int) -> str:
    return f"{n_val / max(n_val + n_train, 1):.1%}"


@task(name="split", retries=0, result_serializer="json")
def split_dataset(manifest: Manifest, val_fraction: float, seed: int) -> Split:
    """Split, and leave a table of train/val sizes per class."""
    split = stratified_split(manifest, val_fraction, seed)
    rows = []
    for label, name in enumerate(manifest.classes):
        n_train = sum(1 for i in split.train if manifest.labels[i] == label)
        n_val = sum(1 for i in split.val if manifest.labels[i] == label)
        rows.append({"class": name, "train": n_train, "val": n_val, "val share": share(n_val, n_train)})
    rows.append({"class": "total", "train": len(split.train), "val": len(split.val),
                 "val share": share(len(split.val), len(split.train))})
    create_table_artifact(
        key="train-val-split",
        table=rows,
        description=f"Split by each image's key and seed {seed} against val_fraction {val_fraction}: an "
        "image trained on never moves into validation as the folder grows; each class's val share is "
        "val_fraction within binomial noise.",
    )
    return split
