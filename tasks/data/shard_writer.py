"""Tar shards of the training images: one sequential GET per shard instead of one per image.

Per-image mode (the default) sends one GET per image per epoch; where latency or request
cost dominates (small images, large sets; docs/architecture.md,
"Data: tar shards") the `training.images_per_shard` option
packs the training images into tar shards once and reads those instead:

    write:  manifest + split.train --(one GET per image, concurrently)--> shard-000000.tar ...
            + index.json, written LAST, below OUTPUT/shards/KEY/
    read:   each loader worker GETs the shards its part of the epoch overlaps, whole, one
            after the other (the next ones are fetched while the current one is decoded),
            and shuffles its images through a buffer.

- Members follow webdataset's layout: `<key>.<ext>` (the image's bytes as stored) and
  `<key>.cls` (its class index, decimal). Keys are sample numbers, never user-given names,
  so nothing from a bucket becomes a path; the folder is named by a digest (`shard_key`).
  The index lists each sample's image key, so that a sample whose bytes do not decode
  (decode-check sampled others; an image gone when packed is packed empty) is named
  when training leaves it out (prefect_ddp.tasks.data.dataset, prefect_ddp.tasks.training.unreadable).
- KEY digests the source root, the training images (paths, sizes, labels), the classes and
  the shard size, so a later run over the same data and split reuses the shards, and a
  changed image (another size) or another split gets new ones. A set without its index, or
  whose index does not match its folder or its shards, is written again.
"""

from __future__ import annotations

import hashlib
import io
import random
import tarfile
from collections.abc import Sequence
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from prefect_ddp.tasks.data.dataset import (
    S3ImageFolder,
    open_rgb,
)
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.splitting import Split
from prefect_ddp.tasks.data.storage import (
    filesystem,
    read_json,
    write_bytes,
    write_json,
)
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.retries import retry_transient
from prefect_ddp.tasks.urls import child_url

SHARDS_FOLDER = "shards"
INDEX = "index.json"
LABEL_SUFFIX = "cls"


class ShardIndex(BaseModel):
    """What a complete shard set holds; `shards[i]` is a file name in the set's folder.

    `paths[n]` is the image key (relative to the source root) of sample n, the member
    `<n>.<ext>`: a sample that does not decode in training is named by it (prefect_ddp.tasks.training.unreadable).
    An index written before it had paths does not validate, so its set is written again.
    (Not `keys`: Prefect walks a task's result with dict(obj), which would call a field named keys.)
    """

    key: str
    split_digest: str
    classes: list[str]
    images_per_shard: int
    shards: list[str]
    images: list[int]
    bytes: list[int]
    paths: list[str]


def shard_key(manifest: Manifest, positions: Sequence[int], images_per_shard: int) -> str:
    """The digest naming a shard set: same source, images, sizes, labels and shard size, same key."""
    rows = [manifest.root, str(images_per_shard), *manifest.classes, "--"]
    rows += [f"{manifest.paths[i]}\t{manifest.sizes[i]}\t{manifest.labels[i]}" for i in sorted(positions)]
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:24]


def shard_folder(output_base: str, manifest: Manifest, positions: Sequence[int], images_per_shard: int) -> str:
    """OUTPUT/shards/KEY: below the output prefix, beside the run folders, shared by runs.

    >>> m = Manifest(root="s3://b/imgs", classes=["a"], paths=["a/1.jpg"], sizes=[9], labels=[0])
    >>> shard_folder("s3://b/out", m, [0], 100)
    's3://b/out/shards/b7d6855b6421b08d09bf68c5'
    """
    return child_url(output_base, SHARDS_FOLDER, shard_key(manifest, positions, images_per_shard))


def complete_index(folder: str, storage_options: dict[str, Any], key: str) -> ShardIndex | None:
    """The set's index when the set is complete and is the one `key` names, else None.

    Complete: the index exists (it is written last), names this key, and every shard it
    lists is in the folder with the size it recorded (one listing, no request per shard).
    """
    fs, path = filesystem(folder, storage_options)
    try:
        index = ShardIndex.model_validate(read_json(child_url(folder, INDEX), storage_options))
        present = {entry["name"].rsplit("/", 1)[-1]: entry["size"] for entry in fs.ls(path, detail=True)}
    except (FileNotFoundError, ValueError):
        return None
    if index.key != key or any(present.get(name) != size for name, size in zip(index.shards, index.bytes)):
        return None
    return index


def write_shards(
    manifest: Manifest, positions: Sequence[int], source_options: dict[str, Any], output_base: str,
    output_options: dict[str, Any], images_per_shard: int, split_digest: str, seed: int = 0,
    fetch_threads: int = 16, fetch_timeout_s: float = 60,
) -> tuple[ShardIndex, bool]:
    """Pack the images at `positions` into shards below `output_base`; returns (index, reused).

    Images are shuffled (by `seed`) before packing, so a shard mixes classes and the
    reader's buffer needs no whole-set memory to mix well. A complete set with the same key
    is reused as it is.

    Args:
        manifest: the images; `positions` index into it (a split's train list).
        source_options, output_options: fsspec options for the images and for the output.
        output_base: the output prefix; the set goes to `shard_folder(output_base, ...)`.
        images_per_shard: images per shard (the last shard holds the rest).
        split_digest: recorded in the index, to tell which split wrote it.
        fetch_threads, fetch_timeout_s: images fetched at once, and the limit per shard's images.

    >>> # write_shards(manifest, split.train, {}, "s3://b/out", {}, 256, split.digest(manifest))
    """
    if images_per_shard < 1 or not positions:
        raise ValueError(f"write_shards got images_per_shard={images_per_shard} and {len(positions)} "
                         "images; it needs at least one of each.")
    folder = shard_folder(output_base, manifest, positions, images_per_shard)
    key = folder.rsplit("/", 1)[-1]
    existing = complete_index(folder, output_options, key)
    if existing:
        return existing, True
    order = sorted(positions)
    random.Random(f"{seed}-shards").shuffle(order)
    source = S3ImageFolder(manifest.root, [manifest.paths[i] for i in order], [manifest.labels[i] for i in order],
                           source_options, transform=open_rgb, fetch_threads=fetch_threads,
                           fetch_timeout_s=fetch_timeout_s)
    names, counts, sizes = [], [], []
    for number, start in enumerate(range(0, len(order), images_per_shard)):
        indices = list(range(start, min(start + images_per_shard, len(order))))
        data = pack(source, indices)
        names.append(f"shard-{number:06d}.tar")
        write_bytes(child_url(folder, names[-1]), data, output_options)
        counts.append(len(indices))
        sizes.append(len(data))
    index = ShardIndex(key=key, split_digest=split_digest, classes=manifest.classes,
                       images_per_shard=images_per_shard, shards=names, images=counts, bytes=sizes,
                       paths=source.keys)
    write_json(child_url(folder, INDEX), index.model_dump(), output_options)
    return index, False


def pack(source: S3ImageFolder, indices: list[int]) -> bytes:
    """One tar shard of `source`'s images at `indices`: `<n>.<ext>` and `<n>.cls` per image.

    An image gone since it was listed is packed empty: training meets it as an image that
    does not decode, leaves it out and names it (prefect_ddp.tasks.training.unreadable), as per-image reading would.
    """
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, data in zip(indices, source.fetch(indices)):
            extension = source.keys[i].rsplit(".", 1)[-1].lower()  # an image extension: manifest.IMAGE_EXTENSIONS
            _add_member(tar, f"{i:08d}.{extension}", data or b"")
            _add_member(tar, f"{i:08d}.{LABEL_SUFFIX}", str(source.labels[i]).encode())
    return buffer.getvalue()


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)  # mtime stays 0: the same images give the same bytes
    tar.addfile(info, io.BytesIO(data))


@task(name="write-shards", retries=2, retry_delay_seconds=10, retry_condition_fn=retry_transient)
def write_train_shards(
    manifest: Manifest, split: Split, source: Location, output_base: Location, images_per_shard: int,
    fetch_threads: int, fetch_timeout_s: float,
) -> ShardIndex:
    """Write (or reuse) the training images' shards, and say which in a markdown artifact.

    Retried twice: a fetch or write that failed on a transient error is worth another
    pass, and the pass after a crash rewrites the set, whose index was never written.
    """
    index, reused = write_shards(
        manifest, split.train, source.storage_options(), output_base.url, output_base.storage_options(),
        images_per_shard, split.digest(manifest), split.seed, fetch_threads, fetch_timeout_s,
    )
    folder = shard_folder(output_base.url, manifest, split.train, images_per_shard)
    what = "Reused the existing" if reused else "Wrote"
    create_markdown_artifact(
        key="train-shards",
        markdown=f"# Training shards\n\n{what} {len(index.shards)} shards, {sum(index.images)} images, "
        f"{sum(index.bytes) / 1e6:.1f} MB, {images_per_shard} images per shard, in `{folder}`.\n",
        description="Tar shards of the training images (training.images_per_shard)",
    )
    return index
