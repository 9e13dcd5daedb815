"""Reading tar shards (tasks/data/shard_writer.py) in training: equal steps on every rank, few GETs.

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

import math
import multiprocessing
import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from itertools import islice
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    default_collate,
    get_worker_info,
)
from torch.utils.data.dataloader import _InfiniteConstantSampler

from prefect_ddp.tasks.data.dataset import (
    FETCH_ATTEMPTS,
    FetchTimeout,
    blank_image,
    prepare,
    with_stand_ins,
)
from prefect_ddp.tasks.data.device_batches import EncodedBatch, encoded_collate
from prefect_ddp.tasks.data.loader_steps import LoaderSteps, collate_images
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.object_reads import fetch_objects, object_read_options
from prefect_ddp.tasks.data.shard_writer import (
    LABEL_SUFFIX,
    ShardFormat,
    ShardIndex,
    complete_index,
    shard_folder,
)
from prefect_ddp.tasks.data.splitting import Split
from prefect_ddp.tasks.data.storage import (
    ProcessFilesystem,
)

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
                             "written by prefect_ddp.tasks.data.shard_writer.pack. Delete the shard set; the next run writes it again.")
        name = header[:100].rstrip(b"\0")
        size = int(header[124:136].strip(b"\0 ") or b"0", 8)
        body = data[offset + TAR_BLOCK : offset + TAR_BLOCK + size]
        offset += TAR_BLOCK + -(-size // TAR_BLOCK) * TAR_BLOCK
        if name.endswith(b"." + LABEL_SUFFIX.encode()):
            yield int(name.split(b".", 1)[0]), image, int(body)
        else:
            image = body


class ShardDataset(IterableDataset[tuple[torch.Tensor | EncodedBatch, torch.Tensor]]):
    """Batches of (images, labels) from shards: the same number of batches on every rank.

    Yields whole batches (use `ShardLoader`, or a DataLoader with batch_size=None), so
    `len()` is exactly this rank's batches per epoch and progress reports stay true.

    Args:
        folder: the shard set's folder URL; index: its `ShardIndex`.
        storage_options: fsspec options for the folder.
        transform: applied to each decoded 8-bit RGB PIL image; None yields encoded images
            for a rank that decodes on its device (prefect_ddp.tasks.data.device_batches).
        batch_size: images per batch; the rank's last batch may be smaller, never 1 image
            (BatchNorm cannot train on one: `epoch_quota`).
        rank, world_size: this rank and the gang's size.
        loader_workers: the DataLoader's num_workers (0 counts as 1: the main process); ranks
            may differ, as their batches do not depend on it.
        seed: with the epoch (`set_epoch`), seeds the shard order and the shuffle buffer.
        fetch_timeout_s: limit for one shard's GET, retries included.
        collate: makes a batch of (image, label) samples; default: the one for `transform`'s
            images (a rank whose batches cross its loader processes' pipes gives its own).

    >>> # loader = ShardLoader(ShardDataset(folder, index, {}, transform, 32, rank, world, 2))
    """

    def __init__(
        self, folder: str, index: ShardIndex, storage_options: dict[str, Any], transform: Callable[..., Any] | None,
        batch_size: int, rank: int, world_size: int, loader_workers: int, seed: int = 0,
        fetch_timeout_s: float = 60, collate: Callable[[Any], tuple[torch.Tensor | EncodedBatch, torch.Tensor]] | None = None,
    ) -> None:
        require_images_for_every_rank(index, world_size, batch_size)
        self.folder = folder
        self.index = index
        # Shards fetched ahead of the one being read: with small shards one GET's latency
        # outlasts decoding a shard (32 images of 64 px: 13 ms against 30 ms here), so
        # several are in flight, up to AHEAD_BYTES of them; s3fs's connection pool holds them all.
        self.ahead = max(1, min(MAX_AHEAD, AHEAD_BYTES // max(index.bytes)))
        self.storage_options = {**object_read_options(folder, storage_options, self.ahead), "skip_instance_cache": True}
        self.transform = transform
        # The loaders' uint8 images stack channels-last; another transform's output as torch stacks it.
        self.collate: Callable[[Any], tuple[torch.Tensor | EncodedBatch, torch.Tensor]] = collate or (
            encoded_collate if transform is None else collate_images if isinstance(transform, LoaderSteps)
            else default_collate)
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.loader_workers = max(1, loader_workers)
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
        its batch as a stand-in labelled `unreadable_label(n)` (prefect_ddp.tasks.data.dataset)."""
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


class ShardLoader(DataLoader[tuple[torch.Tensor | EncodedBatch, torch.Tensor]]):
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
    def sampler(self, placeholder: Iterable[Any]) -> None:
        # Set once, by DataLoader.__init__, with the placeholder it made (typed as DataLoader's attribute).
        assert isinstance(self.dataset, ShardDataset)  # __init__ takes nothing else
        self._epoch_sampler = _EpochSampler(self.dataset)


def open_shards(
    output_url: str, storage_options: dict[str, Any], manifest: Manifest, split: Split, fmt: ShardFormat,
) -> tuple[str, ShardIndex]:
    """(folder, index) of the training set's shards for the run folder `output_url`.

    The flow's write-shards step wrote them below the run folder's parent (the output
    prefix); a set missing or not matching this split fails here, naming the folder.
    """
    folder = shard_folder(output_url.rstrip("/").rsplit("/", 1)[0], manifest, split.train, fmt, split.seed)
    index = complete_index(folder, storage_options, folder.rsplit("/", 1)[-1])
    if index is None:
        raise FileNotFoundError(
            f"No complete shard set for this split and format at {folder} (training.images_per_shard="
            f"{fmt.images_per_shard}, shard_side={fmt.side}). The flow's write-shards step writes it before training; run the "
            "flow, or set training.images_per_shard to empty for per-image reading."
        )
    return folder, index

