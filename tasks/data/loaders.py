"""A rank's data path, built in one place (docs/architecture.md, "The data path's modes").

The recipe asks `rank_data` once per rank and gets everything it reads with: the train and
val loaders, the manifest's images for the reads outside them (rank 0's decode probe, the
champion comparison) and the storage options of the source and the output. Which mode the
loaders read in is decided here alone, from the training config: one GET per image (the
default), through the byte cache (training.cache_gb), from tar shards
(training.images_per_shard), stored resized or as they were (training.shard_side), decoded
on the CPU or handed over encoded (training.decode_on). So the recipe never learns the
modes, and the storage options, which `Location.storage_options` builds afresh on every
call, are derived once for the rank instead of at every read.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from torch.utils.data import DataLoader

from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data.byte_cache import ByteCache
from prefect_ddp.tasks.data.cache_choice import CacheChoice, cache_choice
from prefect_ddp.tasks.data.dataset import S3ImageFolder, eval_transform, forked_workers, train_transform_for
from prefect_ddp.tasks.data.preprocessing import Preprocessing
from prefect_ddp.tasks.data.device_batches import encoded_collate
from prefect_ddp.tasks.data.epoch_ahead import EpochAhead
from prefect_ddp.tasks.data.fetch_ahead import FetchAheadLoader
from prefect_ddp.tasks.data.host_budget import Budget, HostLimits, LoaderLoad, handed_over_bytes, rank_budget
from prefect_ddp.tasks.data.loader_steps import collate_images, loader_steps
from prefect_ddp.tasks.data.loader_leftovers import remove_dead_loader_folders
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.pipe_handover import PipedCollate
from prefect_ddp.tasks.data.positioned_sampler import PositionedSampler
from prefect_ddp.tasks.data.shard_reader import ShardDataset, ShardLoader, open_shards
from prefect_ddp.tasks.data.shard_writer import shard_format
from prefect_ddp.tasks.data.splitting import Split
from prefect_ddp.tasks.gang import RankContext
from prefect_ddp.tasks.location import Location


Feed = Literal["loader", "device"]  # where a rank's images decode: its loader processes or its device


@dataclass(frozen=True)
class ManifestImages:
    """Datasets of a run's manifest with its recipe's fetch settings: the loaders', the decode
    probe's and the champion comparison's, all reading with the rank's one set of source options."""

    manifest: Manifest
    training: TrainingConfig
    options: dict[str, Any] = field(repr=False)  # the source's storage options: they hold its secret
    fetch_threads: int  # images fetched at once per batch, as the rank's budget says (host_budget.rank_budget)

    def dataset(self, positions: list[int], transform: Callable[..., Any] | None,
                cache: ByteCache | None = None, copy_shrink: float | None = None) -> S3ImageFolder:
        """The images at `positions` of the manifest."""
        cfg, m = self.training, self.manifest
        return S3ImageFolder(
            m.root, [m.paths[i] for i in positions], [m.labels[i] for i in positions], self.options,
            transform, fetch_threads=self.fetch_threads, fetch_timeout_s=cfg.fetch_timeout_s,
            sizes=[m.sizes[i] for i in positions], cache=cache, copy_shrink=copy_shrink)


@dataclass(frozen=True)
class RankData:
    """What a rank reads with, as `rank_data` built it."""

    train: DataLoader[Any]
    val: DataLoader[Any]
    images: ManifestImages  # the manifest's images for the reads outside the loaders
    output_options: dict[str, Any] = field(repr=False)  # the output's storage options: checkpoints, model.pt
    # Whether the train loader decodes the stored images on the rank's CPUs: not when they reach
    # it encoded (training.decode_on="device"), from shards stored resized, or through a byte cache
    # sized by the run, which serves a copy of every image larger than the crop needs from the
    # second epoch on. Only then is there a decoding cost for rank 0 to measure
    # (prefect_ddp.tasks.training.decode_cost) after the first epoch. The cache the flow sizes
    # itself copies only images over twice that side (tasks/data/cache_choice.py): the others
    # are decoded as stored every epoch.
    decodes_originals: bool
    loader_workers: LoaderWorkers  # how many loader processes each loader has, and why
    train_epochs: EpochAhead  # the train loader's epochs, the next started while this one validates
    cache: CacheChoice  # the byte cache its loaders read through, and why

    @property
    def source_options(self) -> dict[str, Any]:
        """The source's storage options, the same the images are read with."""
        return self.images.options


def rank_data(ctx: RankContext, source: Location, output: Location, manifest: Manifest, split: Split,
              cfg: TrainingConfig, preprocessing: Preprocessing, decode_on: Feed | None = None) -> RankData:
    """What rank `ctx` reads with: train batches from a PositionedSampler (or tar shards), val
    sharded rank::world_size, unpadded; built once per rank, its storage options with it.

    DistributedSampler pads the val shard with repeats to even it out, which would count
    some images twice; a plain stride covers every val image exactly once. With
    training.images_per_shard the train set is read from the shards that the flow's
    write-shards step wrote (below `output`); that dataset batches itself and gives every rank
    the same number of steps (prefect_ddp.tasks.data.shard_reader). `decode_on`: where images
    decode, as training.decode_on="auto" chose it (tasks/training/feed_choice.py); None: as the
    config says, the loaders for "auto" until then.
    """
    # decode_on="device": the loaders hand over encoded images (no transform); the rank
    # decodes and transforms them (the recipe's batch_inputs).
    # Otherwise they decode and run the transform's uint8 steps, and the rank converts and
    # normalises the batch on its device (prefect_ddp.tasks.data.loader_steps).
    on_device = (decode_on or cfg.decode_on) == "device"
    train_tf = None if on_device else loader_steps(train_transform_for(cfg, preprocessing))
    val_tf = None if on_device else loader_steps(eval_transform(cfg.image_size, preprocessing))
    pinned = ctx.device.startswith("cuda")
    load = LoaderLoad.of(cfg, manifest.sizes, None if val_tf is None else handed_over_bytes(val_tf, cfg.image_size),
                         pinned)
    budget = rank_budget(cfg, HostLimits.of_this_host(ctx.local_world_size), load)
    chosen = loader_workers(budget)
    workers = chosen.workers
    images = ManifestImages(manifest, cfg, source.storage_options(), budget.fetches_in_flight)
    output_options = output.storage_options()
    cached = cache_choice(cfg, decodes_in_loaders=train_tf is not None)
    collate_fn = batch_collate(on_device, piped=budget.handover == "pipe")
    val_set = images.dataset(split.val, val_tf, cached.cache if cached.with_validation else None)
    loader_options: dict[str, Any] = {"num_workers": workers, "pin_memory": pinned}
    if workers:
        require_non_daemonic(workers)
        remove_dead_loader_folders()  # of a run's loader processes killed before, on this host
        loader_options |= {**forked_workers(), "persistent_workers": True}
    val_shard = list(range(len(val_set)))[ctx.rank :: ctx.world_size]
    val_loader = FetchAheadLoader(val_set, val_shard, cfg.batch_size, collate_fn=collate_fn, **loader_options)
    if cfg.images_per_shard:
        fmt = shard_format(cfg)
        folder, index = open_shards(output.url, output_options, manifest, split, fmt)
        shards = ShardDataset(folder, index, output_options, train_tf, cfg.batch_size, ctx.rank,
                              ctx.world_size, workers, split.seed, cfg.fetch_timeout_s, collate_fn)
        train_loader: DataLoader[Any] = ShardLoader(shards, **loader_options)
        stored_resized = bool(fmt.side)
    else:
        train_set = images.dataset(split.train, train_tf, cached.cache, cached.copy_shrink)
        # DistributedSampler's order, from a global position on: a gang re-formed mid-epoch on
        # another number of ranks goes on where the old one stopped. It leaves out a last batch
        # of one image (it breaks BatchNorm in training mode) on every rank alike.
        sampler = PositionedSampler(len(train_set), ctx.world_size, ctx.rank, split.seed, cfg.batch_size)
        train_loader = FetchAheadLoader(train_set, sampler, cfg.batch_size, collate_fn=collate_fn, **loader_options)
        stored_resized = cached.keeps_every_image  # from the second epoch on, the copies the cache kept
    return RankData(train_loader, val_loader, images, output_options,
                    decodes_originals=not on_device and not stored_resized, loader_workers=chosen,
                    train_epochs=EpochAhead(train_loader), cache=cached)


def batch_collate(encoded: bool, piped: bool) -> Callable[[Any], Any]:
    """The loaders' collate: encoded images (decode_on="device") or the loaders' uint8 images; batches
    that cross the loader processes' pipes where `piped` (prefect_ddp.tasks.data.pipe_handover), in
    /dev/shm otherwise."""
    if not piped:
        return encoded_collate if encoded else collate_images
    return PipedCollate(encoded_collate if encoded else partial(collate_images, shared=False))


@dataclass(frozen=True)
class LoaderWorkers:
    """How many loader processes a rank starts, and why: the run says both (docs/running.md)."""

    workers: int
    why: str  # how the number came about, and each limit of the host that cut it or the images fetched at once
    cpus: int  # the rank's share of its host's CPUs, which the workers' default follows
    warnings: tuple[str, ...] = ()  # the host's limits that the run's own settings are past: rank 0 warns of each


def loader_workers(budget: Budget) -> LoaderWorkers:
    """The loader processes of a rank's `budget` (prefect_ddp.tasks.data.host_budget.rank_budget), and why:
    training.num_workers where it is set, else one per CPU of the rank's share of its host less one, at
    most MAX_DEFAULT_LOADER_WORKERS, within what the host's limits leave the rank.

    >>> limits = HostLimits(cpus=4, affinity=16, ranks=4, memory_bytes=2**36, shm_bytes=2**35, open_files=1024)
    >>> load = LoaderLoad.of(TrainingConfig(), [100_000] * 1000, 3 * 224 * 224 * 4, pinned=False)
    >>> chosen = loader_workers(rank_budget(TrainingConfig(), limits, load))
    >>> chosen.workers, chosen.why[:60]
    (3, "training.num_workers empty: this rank's share of its host is")
    """
    return LoaderWorkers(budget.loader_processes, "; ".join((budget.why, *budget.cuts)), budget.cpus, budget.warnings)


def require_non_daemonic(num_workers: int) -> None:
    """Fail with the fix, not multiprocessing's 'daemonic processes are not allowed to have children'."""
    if multiprocessing.current_process().daemon:
        raise RuntimeError(
            f"training.num_workers={num_workers} needs DataLoader worker processes, but this Dask "
            "worker is a daemonic process and cannot start any. Start the cluster's workers with "
            "DASK_DISTRIBUTED__WORKER__DAEMON=False (clusters this project creates do), or set "
            "training.num_workers=0."
        )
