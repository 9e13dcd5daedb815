"""Tar shards of the training images: one sequential GET per shard instead of one per image.

Per-image mode (the default) sends one GET per image per epoch; where latency or request
cost dominates (small images, large sets, DESIGN 5) the `training.images_per_shard` option
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
  when training leaves it out (tasks.dataset, tasks.unreadable).
- KEY digests the source root, the training images (paths, sizes, labels), the classes and
  the shard size, so a later run over the same data and split reuses the shards, and a
  changed image (another size) or another split gets new ones. A set without its index, or
  whose index does not match its folder or its shards, is written again.
- Equal steps on every rank: DDP hangs in a collective when one rank runs out of batches
  before the others. So samples, not shards, are split between ranks (as MosaicML
  Streaming does): each epoch's shard order, reshuffled and the same on every rank, lays
  the N training images out in one sequence; rank r takes its positions [r*q, (r+1)*q),
  q = N // world less one where a batch of one would be left (`epoch_quota`), and hands
  its batches to its loader workers in contiguous runs (`worker_spans`). Every rank yields
  ceil(q / batch) batches whatever the shard sizes and its loader workers.
- Left out each epoch: the sequence's last N - world*q images, that is N mod world, plus
  world where a rank's share would end in a batch of one image: at most 2*world - 1, fewer
  than world x batch size (world - 1 at batch size 1); they change as the shard order is
  reshuffled.
- A shard that straddles two workers' parts is fetched whole by both, each skipping the
  members outside its part: at most world x loader workers - 1 extra GETs an epoch.
- Memory: a loader worker holds the shard it reads, the next 1-4 (at most 64 MB of them,
  at least one) and a shuffle buffer of `images_per_shard` images, all as encoded bytes.
"""

from __future__ import annotations

import hashlib
import io
import math
import multiprocessing
import random
import tarfile
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from itertools import islice
from typing import Any

import torch
from prefect import task
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info
from torch.utils.data.dataloader import _InfiniteConstantSampler

from blocks.data_location import DataLocation
from tasks.dataset import FETCH_ATTEMPTS, FetchTimeout, S3ImageFolder, blank_image, open_rgb, prepare, with_stand_ins
from tasks.device_batches import EncodedBatch, encoded_collate
from tasks.manifest import Manifest
from tasks.retries import retry_transient
from tasks.splitting import Split
from tasks.storage import (
    ProcessFilesystem,
    child_url,
    fetch_objects,
    filesystem,
    object_read_options,
    read_json,
    write_bytes,
    write_json,
)

SHARDS_FOLDER = "shards"
INDEX = "index.json"
LABEL_SUFFIX = "cls"
TAR_BLOCK = 512
MAX_AHEAD = 4
AHEAD_BYTES = 64 * 2**20


def epoch_quota(images: int, world_size: int, batch_size: int) -> int:
    """The images each rank trains on per epoch: an equal share, never ending in a batch of one.

    BatchNorm cannot train on a batch of one image, so a share that would end in one is one
    image shorter (at batch size 1 every batch is one image, and none is taken off).

    >>> epoch_quota(1010, 2, 32), epoch_quota(23, 2, 2), epoch_quota(21, 5, 1)
    (505, 10, 4)
    """
    quota = images // world_size
    return quota - 1 if batch_size > 1 and quota % batch_size == 1 else quota


def worker_spans(images: int, world_size: int, rank: int, loader_workers: int, batch_size: int) -> list[range]:
    """Each of `rank`'s loader workers' positions in an epoch's sequence of `images` images.

    The rank's `epoch_quota` positions are cut into batches, and the workers take them in
    contiguous runs, as even as whole batches allow: only the rank's last batch may be
    short, and a worker reads no more shards than its run overlaps.

    >>> worker_spans(23, 2, 1, 2, 2)
    [range(10, 14), range(14, 20)]
    """
    quota = epoch_quota(images, world_size, batch_size)
    batches = math.ceil(quota / batch_size)
    edges = [rank * quota + min(quota, batch_size * (batches * worker // loader_workers))
             for worker in range(loader_workers + 1)]
    return [range(start, stop) for start, stop in zip(edges, edges[1:])]


def shard_pieces(images: Sequence[int], order: Sequence[int], span: range) -> list[tuple[int, int, int]]:
    """(shard, first member, end member) of each shard that `span` overlaps, in `order`.

    `span` is a range of positions in the sequence that the shards' images make when laid
    out in `order`; `images[i]` is how many shard i holds.

    >>> shard_pieces([500, 500, 10], [2, 0, 1], range(5, 515))
    [(2, 5, 10), (0, 0, 500), (1, 0, 5)]
    """
    pieces, start = [], 0
    for shard in order:
        stop = start + images[shard]
        first, end = max(span.start, start), min(span.stop, stop)
        if first < end:
            pieces.append((shard, first - start, end - start))
        start = stop
    return pieces


class ShardIndex(BaseModel):
    """What a complete shard set holds; `shards[i]` is a file name in the set's folder.

    `paths[n]` is the image key (relative to the source root) of sample n, the member
    `<n>.<ext>`: a sample that does not decode in training is named by it (tasks.unreadable).
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
    does not decode, leaves it out and names it (tasks.unreadable), as per-image reading would.
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


def read_samples(data: bytes) -> Iterator[tuple[int, bytes, int]]:
    """(sample number, image bytes, label) for each image of a shard that `pack` wrote, in order.

    Parsed here rather than by tarfile, which spent about 45 us on each member's header
    here, a fifth of what decoding a 64 px JPEG costs. `pack` writes plain USTAR: a 512-byte
    header per member (name, octal size), the data padded to 512 bytes, zero blocks at the end.
    """
    image = b""
    offset = 0
    while offset + TAR_BLOCK <= len(data) and data[offset]:
        header = data[offset : offset + TAR_BLOCK]
        if header[257:262] != b"ustar" or header[156:157] not in (b"0", b"\0"):
            raise ValueError(f"Shard member at byte {offset} is not a plain USTAR file: this shard was not "
                             "written by tasks.shards.pack. Delete the shard set; the next run writes it again.")
        name = header[:100].rstrip(b"\0")
        size = int(header[124:136].strip(b"\0 ") or b"0", 8)
        body = data[offset + TAR_BLOCK : offset + TAR_BLOCK + size]
        offset += TAR_BLOCK + -(-size // TAR_BLOCK) * TAR_BLOCK
        if name.endswith(b"." + LABEL_SUFFIX.encode()):
            yield int(name.split(b".", 1)[0]), image, int(body)
        else:
            image = body


class ShardDataset(IterableDataset):
    """Batches of (images, labels) from shards: the same number of batches on every rank.

    Yields whole batches (use `ShardLoader`, or a DataLoader with batch_size=None), so
    `len()` is exactly this rank's batches per epoch and progress reports stay true.

    Args:
        folder: the shard set's folder URL; index: its `ShardIndex`.
        storage_options: fsspec options for the folder.
        transform: applied to each decoded 8-bit RGB PIL image; None yields encoded images
            for a rank that decodes on its device (tasks.device_batches).
        batch_size: images per batch; the rank's last batch may be smaller, never 1 image
            (BatchNorm cannot train on one: `epoch_quota`).
        rank, world_size: this rank and the gang's size.
        loader_workers: the DataLoader's num_workers (0 counts as 1: the main process); ranks
            may differ, as their batches do not depend on it.
        seed: with the epoch (`set_epoch`), seeds the shard order and the shuffle buffer.
        fetch_timeout_s: limit for one shard's GET, retries included.

    >>> # loader = ShardLoader(ShardDataset(folder, index, {}, transform, 32, rank, world, 2))
    """

    def __init__(
        self, folder: str, index: ShardIndex, storage_options: dict[str, Any], transform: Callable | None,
        batch_size: int, rank: int, world_size: int, loader_workers: int, seed: int = 0,
        fetch_timeout_s: float = 60,
    ) -> None:
        require_images_for_every_rank(index, world_size, batch_size)
        self.folder = folder
        self.index = index
        self.storage_options = {**object_read_options(folder, storage_options, 1), "skip_instance_cache": True}
        self.transform = transform
        self.collate = default_collate if transform else encoded_collate
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.loader_workers = max(1, loader_workers)
        # Shards fetched ahead of the one being read: with small shards one GET's latency
        # outlasts decoding a shard (32 images of 64 px: 13 ms against 30 ms here), so
        # several are in flight, up to AHEAD_BYTES of them.
        self.ahead = max(1, min(MAX_AHEAD, AHEAD_BYTES // max(index.bytes)))
        self.seed = seed
        self.fetch_timeout_s = fetch_timeout_s
        # Shared memory: persistent loader workers were forked before set_epoch is called.
        self._epoch = multiprocessing.get_context("fork").RawValue("q", 0)
        self._files = ProcessFilesystem(folder, self.storage_options)

    def set_epoch(self, epoch: int) -> None:
        self._epoch.value = epoch

    def plan(self, epoch: int) -> list[list[tuple[int, int, int]]]:
        """(shard, first member, end member) pieces that each of this rank's loader workers reads in `epoch`.

        The shard order is reshuffled every epoch, the same on every rank (same seed), and
        lays out the sequence of images that `worker_spans` splits.
        """
        order = list(range(len(self.index.shards)))
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        spans = worker_spans(sum(self.index.images), self.world_size, self.rank, self.loader_workers, self.batch_size)
        return [shard_pieces(self.index.images, order, span) for span in spans]

    def __len__(self) -> int:
        return math.ceil(epoch_quota(sum(self.index.images), self.world_size, self.batch_size) / self.batch_size)

    @property
    def keys(self) -> list[str]:
        """Each sample's image key, by its number: `unreadable_label(n)` names `keys[n]`."""
        return self.index.paths

    def __iter__(self) -> Iterator[tuple[torch.Tensor | EncodedBatch, torch.Tensor]]:
        """This worker's batches of the epoch; an image that does not decode keeps its place in
        its batch as a stand-in labelled `unreadable_label(n)` (tasks.dataset)."""
        info = get_worker_info()
        worker = info.id if info else 0
        epoch = self._epoch.value
        rng = random.Random(f"{self.seed}-{epoch}-{self.rank}-{worker}")
        blank = partial(blank_image, self.transform)
        batch = []
        for number, data, label in shuffled(self._samples(self.plan(epoch)[worker]), self.index.images_per_shard, rng):
            batch.append(prepare(data, label, number, self.transform))
            if len(batch) == self.batch_size:
                yield self.collate(with_stand_ins(batch, blank))
                batch = []
        if batch:
            yield self.collate(with_stand_ins(batch, blank))

    def _samples(self, pieces: list[tuple[int, int, int]]) -> Iterator[tuple[int, bytes, int]]:
        """The images of `pieces` (`plan`), in order, the next `self.ahead` shards fetched meanwhile."""
        if not pieces:
            return
        self._files.get()  # the client is made here, before the fetching threads share it
        with ThreadPoolExecutor(max_workers=self.ahead) as prefetcher:
            fetches = deque(prefetcher.submit(self._fetch, shard) for shard, _, _ in pieces[: self.ahead])
            for position, (_, first, end) in enumerate(pieces):
                data = fetches.popleft().result()
                if position + self.ahead < len(pieces):
                    fetches.append(prefetcher.submit(self._fetch, pieces[position + self.ahead][0]))
                yield from islice(read_samples(data), first, end)

    def _fetch(self, shard: int) -> bytes:
        """A whole shard, with one GET (retried on transient errors, bounded by fetch_timeout_s)."""
        fs, folder = self._files.get()
        path = f"{folder}/{self.index.shards[shard]}"
        result = fetch_objects(fs, [path], 1, FETCH_ATTEMPTS, self.fetch_timeout_s)[path]
        if isinstance(result, TimeoutError):
            raise FetchTimeout(
                f"Could not fetch shard {path} ({self.index.bytes[shard]} bytes) within fetch_timeout_s="
                f"{self.fetch_timeout_s:g} s. The storage endpoint stalled or is too slow: check it, "
                "or raise training.fetch_timeout_s or lower training.images_per_shard."
            )
        if isinstance(result, Exception):
            raise OSError(f"Could not fetch shard {path} after {FETCH_ATTEMPTS} attempts: {result!r}. "
                          "If the shard set was deleted, the next run's write-shards step writes it again.")
        return result


def require_images_for_every_rank(index: ShardIndex, world_size: int, batch_size: int) -> None:
    """A rank with no image would take no step; ranks share shards, so only the images count."""
    if epoch_quota(sum(index.images), world_size, batch_size) < 1:
        raise ValueError(
            f"{sum(index.images)} training images in {len(index.shards)} shard(s) for {world_size} ranks at batch "
            f"size {batch_size}: a rank would have none to train on. Every rank needs at least 2 images (1 at "
            "batch size 1): add images or use fewer ranks."
        )


def shuffled(samples: Iterator[Any], buffer_size: int, rng: random.Random) -> Iterator[Any]:
    """`samples` in a random order, holding at most `buffer_size` of them (webdataset's shuffle).

    >>> sorted(shuffled(iter(range(5)), 2, random.Random(0)))
    [0, 1, 2, 3, 4]
    """
    buffer: list[Any] = []
    for sample in samples:
        if len(buffer) < buffer_size:
            buffer.append(sample)
            continue
        slot = rng.randrange(buffer_size)
        yield buffer[slot]
        buffer[slot] = sample
    rng.shuffle(buffer)
    yield from buffer


class _EpochSampler(_InfiniteConstantSampler):
    """The iterable's placeholder sampler, with `set_epoch` passed on to the dataset."""

    def __init__(self, dataset: ShardDataset) -> None:
        super().__init__()
        self.dataset = dataset

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)


class ShardLoader(DataLoader):
    """A DataLoader of a ShardDataset's batches whose `sampler.set_epoch` reaches the dataset.

    The training loop calls `loader.sampler.set_epoch(epoch)`, as DistributedSampler wants;
    a DataLoader of an IterableDataset refuses any sampler and holds a placeholder without
    it, so this one holds a placeholder that passes the epoch on.
    """

    def __init__(self, dataset: ShardDataset, **options: Any) -> None:
        super().__init__(dataset, batch_size=None, **options)

    @property
    def sampler(self) -> _EpochSampler:
        return self._epoch_sampler

    @sampler.setter
    def sampler(self, placeholder: _InfiniteConstantSampler) -> None:
        # Set once, by DataLoader.__init__, with the placeholder it made.
        self._epoch_sampler = _EpochSampler(self.dataset)


def open_shards(
    output_url: str, storage_options: dict[str, Any], manifest: Manifest, split: Split, images_per_shard: int,
) -> tuple[str, ShardIndex]:
    """(folder, index) of the training set's shards for the run folder `output_url`.

    The flow's write-shards step wrote them below the run folder's parent (the output
    prefix); a set missing or not matching this split fails here, naming the folder.
    """
    folder = shard_folder(output_url.rstrip("/").rsplit("/", 1)[0], manifest, split.train, images_per_shard)
    index = complete_index(folder, storage_options, folder.rsplit("/", 1)[-1])
    if index is None:
        raise FileNotFoundError(
            f"No complete shard set for this split at {folder} (training.images_per_shard="
            f"{images_per_shard}). The flow's write-shards step writes it before training; run the "
            "flow, or set training.images_per_shard to empty for per-image reading."
        )
    return folder, index


@task(name="write-shards", retries=2, retry_delay_seconds=10, retry_condition_fn=retry_transient)
def write_train_shards(
    manifest: Manifest, split: Split, source: DataLocation, output_base: DataLocation, images_per_shard: int,
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
