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
- Pre-resized (`ShardFormat.side`, by default what training's crop at `image_size` needs,
  `prefect_ddp.tasks.data.dataset.decode_side`): an image whose shorter side is larger is
  decoded (reduced-size for a JPEG, upright: `open_rgb`), resized so that side is `side`
  and stored as a JPEG at `quality`; one no larger is stored as it is. A 12-MP photo that
  costs training ~60-200 ms of decoding per epoch then costs ~2 ms (docs/architecture.md,
  "Data: pre-resized shards"). The writer decodes on every core its worker may use
  (prefect_ddp.tasks.data.cpu_share) and records the bytes it read and wrote and the CPU
  time its decoding took.
- KEY digests the source root, the training images (paths, sizes, labels), the classes, the
  order's seed and the format (shard size, side, quality), so a later run over the same
  data, split and format reuses the shards, and a changed image (another size), another
  split or format gets new ones. A set without its index, or whose index does not match its
  folder or its shards, is written again, but for the shards a crashed write finished: each
  shard is written whole, then a record of it (`shard-N.json`: its images, size and cost),
  and a shard whose record matches it as listed is kept.
"""

from __future__ import annotations

import hashlib
import io
import logging
import random
import tarfile
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait
from prefect_dask import DaskTaskRunner
from pydantic import BaseModel

from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data.cpu_share import map_on_cpus
from prefect_ddp.tasks.data.dataset import S3ImageFolder, decode_side
from prefect_ddp.tasks.data.decoding import RESIZED_QUALITY, Stored, stored_resized
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.splitting import Split
from prefect_ddp.tasks.data.storage import (
    filesystem,
    garbled_text,
    read_json,
    write_bytes,
    write_json,
)
from prefect_ddp.tasks.data.validation import raise_if_lost
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.retries import retry_transient
from prefect_ddp.tasks.urls import child_url

logger = logging.getLogger(__name__)

SHARDS_FOLDER = "shards"
INDEX = "index.json"
LABEL_SUFFIX = "cls"
RESIZED_SUFFIX = "jpg"


class ShardFormat(BaseModel):
    """How the training images are stored: how many per shard, and at what size."""

    images_per_shard: int
    side: int | None = None  # the shorter side images larger than it are resized to; None: stored as they are
    quality: int = RESIZED_QUALITY  # of the JPEGs resized images are stored as

    def key_rows(self) -> list[str]:
        resized = [f"side {self.side} quality {self.quality}"] if self.side else []
        return [str(self.images_per_shard), *resized]


def shard_format(cfg: TrainingConfig) -> ShardFormat:
    """The training config's shard format: `training.shard_side` (empty: `decode_side(image_size)`, 0:
    the images as stored) and `training.shard_quality`."""
    side = decode_side(cfg.image_size) if cfg.shard_side is None else cfg.shard_side or None
    return ShardFormat(images_per_shard=cfg.images_per_shard or 0, side=side, quality=cfg.shard_quality)


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
    side: int | None = None  # the format's (`ShardFormat`)
    source_bytes: int = 0  # what writing its shards read from the source
    resized: int = 0  # images stored resized
    decode_cpu_s: float = 0.0  # CPU seconds their decoding, resizing and encoding took, all threads


def shard_key(manifest: Manifest, positions: Sequence[int], fmt: ShardFormat, seed: int) -> str:
    """The digest naming a shard set: same source, images, sizes, labels, order and format, same key."""
    rows = [manifest.root, *fmt.key_rows(), f"seed {seed}", *manifest.classes, "--"]
    rows += [f"{manifest.paths[i]}\t{manifest.sizes[i]}\t{manifest.labels[i]}" for i in sorted(positions)]
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:24]


def shard_folder(output_base: str, manifest: Manifest, positions: Sequence[int], fmt: ShardFormat,
                 seed: int) -> str:
    """OUTPUT/shards/KEY: below the output prefix, beside the run folders, shared by runs.

    >>> m = Manifest(root="s3://b/imgs", classes=["a"], paths=["a/1.jpg"], sizes=[9], labels=[0])
    >>> shard_folder("s3://b/out", m, [0], ShardFormat(images_per_shard=100), seed=0)
    's3://b/out/shards/1d2b2c5d0c7dbba623403848'
    """
    return child_url(output_base, SHARDS_FOLDER, shard_key(manifest, positions, fmt, seed))


def complete_index(folder: str, storage_options: dict[str, Any], key: str) -> ShardIndex | None:
    """The set's index when the set is complete and is the one `key` names, else None.

    Complete: the index exists (it is written last), names this key, and every shard it
    lists is in the folder with the size it recorded (one listing, no request per shard).
    """
    fs, path = filesystem(folder, storage_options)
    try:
        index = ShardIndex.model_validate(read_json(child_url(folder, INDEX), storage_options))
        present = {entry["name"].rsplit("/", 1)[-1]: entry["size"] for entry in fs.ls(path, detail=True)}
    except FileNotFoundError:
        return None
    except ValueError as error:  # cut short or garbled on the store (json's and pydantic's errors)
        logger.warning("The shard set's index %s cannot be read (%s): the set counts as not written, and the "
                       "write-shards step writes what is missing again.", child_url(folder, INDEX),
                       garbled_text(error))
        return None
    if index.key != key or any(present.get(name) != size for name, size in zip(index.shards, index.bytes)):
        return None
    return index


class ShardChunk(BaseModel):
    """One shard's images: its number in the set, its first sample's number, their keys and labels."""

    number: int
    first: int
    paths: list[str]  # (not `keys`: see ShardIndex)
    labels: list[int]

    @property
    def name(self) -> str:
        return f"shard-{self.number:06d}.tar"

    @property
    def record(self) -> str:
        """The file beside the shard, written after it, that says it is whole: its `ShardWritten`."""
        return f"shard-{self.number:06d}.json"


class ShardWritten(BaseModel):
    """What writing one shard gave: its size, and what it read and cost (none for a shard found written)."""

    name: str
    images: int
    bytes: int
    source_bytes: int = 0
    resized: int = 0
    cpu_s: float = 0.0


class ShardPlan(BaseModel):
    """A shard set to write: its folder (named by its key), its images in packing order, cut into shards."""

    folder: str
    chunks: list[ShardChunk]

    @property
    def key(self) -> str:
        return self.folder.rsplit("/", 1)[-1]

    @property
    def paths(self) -> list[str]:
        return [path for chunk in self.chunks for path in chunk.paths]


def plan_shards(manifest: Manifest, positions: Sequence[int], output_base: str, fmt: ShardFormat,
                seed: int) -> ShardPlan:
    """The images at `positions` shuffled by `seed` (so a shard mixes classes and the reader's buffer
    needs no whole-set memory to mix well) and cut into shards of `fmt.images_per_shard`."""
    if fmt.images_per_shard < 1 or not positions:
        raise ValueError(f"write_shards got images_per_shard={fmt.images_per_shard} and {len(positions)} "
                         "images; it needs at least one of each.")
    order = sorted(positions)
    random.Random(f"{seed}-shards").shuffle(order)
    step = fmt.images_per_shard
    chunks = [ShardChunk(number=number, first=first, paths=[manifest.paths[i] for i in order[first:first + step]],
                         labels=[manifest.labels[i] for i in order[first:first + step]])
              for number, first in enumerate(range(0, len(order), step))]
    return ShardPlan(folder=shard_folder(output_base, manifest, positions, fmt, seed), chunks=chunks)


def write_shards(
    manifest: Manifest, positions: Sequence[int], source_options: dict[str, Any], output_base: str,
    output_options: dict[str, Any], fmt: ShardFormat, split_digest: str, seed: int = 0,
    fetch_threads: int = 16, fetch_timeout_s: float = 60,
) -> tuple[ShardIndex, bool]:
    """Pack the images at `positions` into shards below `output_base`, in this process; returns (index, reused).

    A complete set with the same key is reused as it is; shards an unfinished write left in
    the set's folder are kept. (The flow spreads the shards over its cluster: `write_train_shards`.)

    Args:
        manifest: the images; `positions` index into it (a split's train list).
        source_options, output_options: fsspec options for the images and for the output.
        output_base: the output prefix; the set goes to `shard_folder(output_base, ...)`.
        fmt: images per shard (the last shard holds the rest) and the size they are stored at.
        split_digest: recorded in the index, to tell which split wrote it.
        fetch_threads, fetch_timeout_s: images fetched at once, and the limit per shard's images.

    >>> # write_shards(manifest, split.train, {}, "s3://b/out", {}, ShardFormat(images_per_shard=256), ...)
    """
    plan = plan_shards(manifest, positions, output_base, fmt, seed)
    write = partial(write_shard, manifest.root, source_options, plan.folder, output_options, fmt=fmt,
                    fetch_threads=fetch_threads, fetch_timeout_s=fetch_timeout_s)
    return complete_set(plan, manifest.classes, fmt, split_digest, output_options,
                        lambda chunks: [write(chunk=chunk) for chunk in chunks])


def complete_set(plan: ShardPlan, classes: list[str], fmt: ShardFormat, split_digest: str,
                 output_options: dict[str, Any], write_missing: Callable[[list[ShardChunk]], list[ShardWritten]],
                 run_step: Callable[[Callable[[], Any]], Any] = lambda step: step()) -> tuple[ShardIndex, bool]:
    """The plan's set, complete: (its index, reused). A complete set is reused; otherwise the shards
    not in its folder are written by `write_missing`, then the index. `run_step` runs each of the
    other storage steps (the flow retries them: `retried_step`)."""
    existing = run_step(partial(complete_index, plan.folder, output_options, plan.key))
    if existing:
        return existing, True
    found = run_step(partial(written_shards, plan, output_options))
    found |= {w.name: w for w in write_missing([chunk for chunk in plan.chunks if chunk.name not in found])}
    written = [found[chunk.name] for chunk in plan.chunks]
    return run_step(partial(finish_index, plan, written, classes, fmt, split_digest, output_options)), False


def write_shard(source_root: str, source_options: dict[str, Any], folder: str, output_options: dict[str, Any],
                chunk: ShardChunk, fmt: ShardFormat, fetch_threads: int, fetch_timeout_s: float) -> ShardWritten:
    """Fetch, pack and write one shard, then its record (`written_shards` keeps a shard whose record matches it)."""
    source = S3ImageFolder(source_root, chunk.paths, chunk.labels, source_options, transform=None,
                           fetch_threads=fetch_threads, fetch_timeout_s=fetch_timeout_s)
    data, written = pack(source, chunk, fmt)
    write_bytes(child_url(folder, chunk.name), data, output_options)
    write_json(child_url(folder, chunk.record), written.model_dump(), output_options)
    return written


def finish_index(plan: ShardPlan, written: list[ShardWritten], classes: list[str], fmt: ShardFormat,
                 split_digest: str, output_options: dict[str, Any]) -> ShardIndex:
    """The set's index, written last: from then on the set is complete (`complete_index`)."""
    index = ShardIndex(
        key=plan.key, split_digest=split_digest, classes=classes, images_per_shard=fmt.images_per_shard,
        shards=[w.name for w in written], images=[w.images for w in written], bytes=[w.bytes for w in written],
        paths=plan.paths, side=fmt.side, source_bytes=sum(w.source_bytes for w in written),
        resized=sum(w.resized for w in written), decode_cpu_s=round(sum(w.cpu_s for w in written), 3))
    write_json(child_url(plan.folder, INDEX), index.model_dump(), output_options)
    return index


def written_shards(plan: ShardPlan, storage_options: dict[str, Any]) -> dict[str, ShardWritten]:
    """The plan's shards already in its folder, by name: those whose record (written after the shard)
    names the shard's images and size as listed. The folder's key fixes what each shard holds; a
    shard changed or cut short since is written again."""
    fs, path = filesystem(plan.folder, storage_options)
    try:
        sizes = {entry["name"].rsplit("/", 1)[-1]: entry["size"] for entry in fs.ls(path, detail=True)}
    except FileNotFoundError:
        return {}
    found = {}
    for chunk in plan.chunks:
        if chunk.name in sizes and chunk.record in sizes:
            try:
                written = ShardWritten.model_validate(read_json(child_url(plan.folder, chunk.record), storage_options))
            except ValueError:  # a record cut short or of another shape (pydantic's and json's errors): write again
                continue
            if (written.name, written.images, written.bytes) == (chunk.name, len(chunk.paths), sizes[chunk.name]):
                found[chunk.name] = written
    return found


def pack(source: S3ImageFolder, chunk: ShardChunk, fmt: ShardFormat) -> tuple[bytes, ShardWritten]:
    """One tar shard of the chunk's images (`source`): `<n>.<ext>` and `<n>.cls` per image, n counted
    from `chunk.first`; with what packing read and cost.

    An image gone since it was listed is packed empty: training meets it as an image that
    does not decode, leaves it out and names it (prefect_ddp.tasks.training.unreadable), as
    per-image reading would. So is an image that does not decode where the format resizes.
    """
    indices = list(range(len(source)))
    fetched = source.fetch(indices)
    stored = [Stored(data) for data in fetched]
    if fmt.side:
        stored = map_on_cpus(partial(stored_resized, side=fmt.side, quality=fmt.quality), fetched)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, image in zip(indices, stored):
            extension = RESIZED_SUFFIX if image.resized else source.keys[i].rsplit(".", 1)[-1].lower()
            _add_member(tar, f"{chunk.first + i:08d}.{extension}", image.data or b"")
            _add_member(tar, f"{chunk.first + i:08d}.{LABEL_SUFFIX}", str(source.labels[i]).encode())
    data = buffer.getvalue()
    return data, ShardWritten(name=chunk.name, images=len(indices), bytes=len(data),
                              source_bytes=sum(len(image or b"") for image in fetched),
                              resized=sum(image.resized for image in stored), cpu_s=sum(image.cpu_s for image in stored))


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)  # mtime stays 0: the same images give the same bytes
    tar.addfile(info, io.BytesIO(data))


@task(name="shard-set-storage", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient,
      cache_policy=NO_CACHE, persist_result=False)
def retried_step(step: Callable[[], Any]) -> Any:
    """One of the flow's own storage steps of a shard write (the listing, the records, the index),
    retried on transient errors as the shards' own tasks are."""
    return step()


@task(name="write-shard", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient)
def write_shard_on_worker(source: Location, output: Location, folder: str, chunk: ShardChunk, fmt: ShardFormat,
                          fetch_threads: int, fetch_timeout_s: float) -> ShardWritten:
    """One shard, on a Dask worker; retried on its own: a transient fetch or write error costs one shard."""
    return write_shard(source.url, source.storage_options(), folder, output.storage_options(), chunk, fmt,
                       fetch_threads, fetch_timeout_s)


def write_train_shards(runner: DaskTaskRunner, manifest: Manifest, split: Split, source: Location,
                       output_base: Location, training: TrainingConfig) -> ShardIndex:
    """Write (or reuse) the training images' shards across the cluster's workers, one task per shard,
    and say which in a markdown artifact.

    A flow run that failed or crashed halfway leaves whole shards in the set's folder: the
    next run over the same images, split and format writes only the others.
    """
    fmt = shard_format(training)
    plan = plan_shards(manifest, split.train, output_base.url, fmt, split.seed)

    def on_workers(chunks: list[ShardChunk]) -> list[ShardWritten]:
        futures = [runner.submit(write_shard_on_worker, parameters={
            "source": source, "output": output_base, "folder": plan.folder, "chunk": chunk, "fmt": fmt,
            "fetch_threads": training.fetches_in_flight(), "fetch_timeout_s": training.fetch_timeout_s,
        }) for chunk in chunks]
        wait(list(futures))  # a list[PrefectFuture], the one type prefect's wait takes
        raise_if_lost(futures, chunks, lambda chunk: f"Shard {chunk.name} of {len(chunk.paths)} image(s) "
                                                     f"from {chunk.paths[0]!r}")
        return [future.result() for future in futures]

    index, reused = complete_set(plan, manifest.classes, fmt, split.digest(manifest),
                                 output_base.storage_options(), on_workers, retried_step)
    create_markdown_artifact(
        key="train-shards", markdown=shards_markdown(index, reused, plan.folder),
        description="Tar shards of the training images (training.images_per_shard)",
    )
    return index


def shards_markdown(index: ShardIndex, reused: bool, folder: str) -> str:
    """What the set holds, at what size, and what its write cost: bytes in and out, CPU per image."""
    stored = (f"images larger than {index.side} px on their shorter side stored resized to it ({index.resized} of "
              "them, as JPEG)" if index.side else "images stored as they are")
    lines = [f"# Training shards\n\n{'Reused the existing' if reused else 'Wrote'} {len(index.shards)} shards, "
             f"{sum(index.images)} images, {sum(index.bytes) / 1e6:.1f} MB, {index.images_per_shard} images per "
             f"shard, {stored}, in `{folder}`.\n"]
    if index.resized:
        per_image = index.decode_cpu_s / max(index.resized, 1)
        lines.append(f"\nWriting it read {index.source_bytes / 1e6:.1f} MB of originals and stored "
                     f"{sum(index.bytes) / 1e6:.1f} MB; decoding, resizing and encoding took {index.decode_cpu_s:.1f} "
                     f"CPU s, {per_image * 1e3:.0f} ms per resized image ({1 / per_image if per_image else 0:.0f} "
                     "images/s per core).\n")
    return "".join(lines)
