"""Whether a rank reads its images through the byte cache, and how much of its host's disk the cache
may hold: training.cache_gb as set, or, where it is empty (the default), as the run and the host allow.

A loader process spends most of its CPU decoding (bench/RESULTS.md, "The train path per image on one
core"), and every epoch decodes every training image again at its stored size. The byte cache keeps
an image larger than the crop needs as a copy resized to that side (`S3ImageFolder`), so an epoch
after the first decodes the copy: at 64-px crops of 500x375 photos the flow's loader process fed 2.1x
the images it fed from the originals (bench/RESULTS.md, "The flow's later epochs from the byte
cache's resized copies").

So with cache_gb empty a rank keeps resized copies of its training images where all of these hold:

- it trains AUTO_MIN_EPOCHS epochs or more: the first pays for the copies and each later one gains.
  At 64-px crops of 500x375 photos the first epoch fed 238 images/s against 388 without the cache,
  the later ones 856 against 412: the copies pay for themselves from the third epoch on;
- it reads images one by one and decodes them in its loader processes: shards are stored resized
  already, and a rank that decodes on its device is handed the bytes;
- the cache folder (`default_folder`) is on a local disk: a home folder on NFS, CIFS or a FUSE mount
  is shared by a cluster's hosts, whose every write would then wait on one ledger's lock over the
  network, one in memory (tmpfs) would take what the loaders' budget counts on
  (tasks/data/host_budget.py), and a container's root (overlay) may be bounded where it cannot be
  seen (LOCAL_DISKS);
- the folder is one the cache can use: this user's alone (`private_folder`).

It keeps copies only, of images more than AUTO_COPY_SHRINK times the side the crop needs, and of
training images only. On one core here a copy of a 500x375 photo at 96 px (64-px crops) cost 2.1 ms
to make and decoded in 0.19 ms against the original's 1.24; one at 334 px (224-px crops) cost 7.0 ms
and saved a quarter of the original's 1.22-ms decode (bench/RESULTS.md). A smaller image is
fetched every epoch as without the cache: its bytes would save a GET but no decode. Validation reads the
originals, as batch-predict and the served model do, so the metric that picks the model that ships
is measured on the pixels it will be served. The folder may hold up to AUTO_DISK_SHARE of its
disk's free space counting what the folder holds already (its ledger), as each rank finds it when
it starts: a cache that fills stops adding (it never evicts) and its copies are still read. The
ledger counts the entries' bytes; on disk a small copy takes whole blocks (a 6-KB copy at 96 px
about 1.3x its bytes), so the folder takes more of the disk than the share says.

A number set keeps every image read there, originals and copies, training and validation, up to
that many GB; 0 turns the cache off.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data.byte_cache import FOLDER_ENV, ByteCache, default_folder
from prefect_ddp.tasks.private_folder import private_folder

# A cache nobody sized is kept by runs of at least this many epochs (module docstring).
AUTO_MIN_EPOCHS = 3
# A cache nobody sized copies only images more than this many times the side the crop needs.
AUTO_COPY_SHRINK = 2.0
# The part of the cache folder's free disk space that a cache nobody sized may take.
AUTO_DISK_SHARE = 0.1
# Below this a cache nobody sized is not worth a folder: a few thousand copies.
AUTO_MIN_BYTES = 64 * 2**20
# How mountinfo writes a space, tab, newline or backslash in a mount point: "\\040".
OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")
# Filesystems of a local disk (/proc/self/mountinfo's names). Not overlay, a container's root: a
# Kubernetes pod that writes there past its ephemeral-storage limit is evicted, a limit a tenth
# of the node's free space can pass unseen from inside the pod.
LOCAL_DISKS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "jfs", "bcachefs"})


@dataclass(frozen=True)
class CacheChoice:
    """The byte cache a rank reads through: `cache` None for none; `copy_shrink` (None: every image
    read, as fetched or copied; else copies only, of images more than that many times the side) and
    `with_validation` as the module docstring says; `why` for the run's log."""

    cache: ByteCache | None
    copy_shrink: float | None
    with_validation: bool
    why: str

    @property
    def keeps_every_image(self) -> bool:
        """Whether every image read is kept (a number set): then every one larger than the crop
        needs is read as a copy from the second epoch on, and no GET is sent for any."""
        return self.cache is not None and self.copy_shrink is None


def cache_choice(cfg: TrainingConfig, decodes_in_loaders: bool, folder: Path | None = None) -> CacheChoice:
    """The byte cache for a rank reading with `cfg` (module docstring): as set, or where
    cache_gb is empty, chosen from the run and the disk under `folder` (`default_folder`).

    >>> cache_choice(TrainingConfig(cache_gb=0), True).why
    'training.cache_gb=0: no byte cache'
    >>> cache_choice(TrainingConfig(epochs=1), True).cache is None
    True
    """
    if cfg.cache_gb is not None:
        cache = ByteCache(int(cfg.cache_gb * 1e9), folder) if cfg.cache_gb else None
        said = f"up to {cfg.cache_gb:g} GB in {cache.folder}" if cache else "no byte cache"
        return CacheChoice(cache, copy_shrink=None, with_validation=True,
                           why=f"training.cache_gb={cfg.cache_gb:g}: {said}")
    folder = folder or default_folder()
    off = not_worth_it(cfg, decodes_in_loaders) or not_on_local_disk(folder)
    held = 0 if off else held_bytes(folder)  # counted from the disk where its ledger holds no number
    share = int((free_bytes(folder) + held) * AUTO_DISK_SHARE)
    # The folder is made (by not_private) only where nothing else leaves the cache off.
    off = off or too_small(folder, share) or not_private(folder)
    if off:
        return CacheChoice(None, None, False, f"no byte cache (training.cache_gb empty): {off}")
    room = (f"up to {share / 1e9:.1f} GB of entries, a tenth of its disk's free space counting the "
            f"{held / 1e9:.1f} GB it holds" + (": full, so the copies kept are read and no more made"
                                                if held >= share else ""))
    return CacheChoice(ByteCache(share, folder), copy_shrink=AUTO_COPY_SHRINK, with_validation=False,
                       why=f"training images over {AUTO_COPY_SHRINK:g}x the side the crop needs are kept as copies "
                       f"resized to it in {folder} ({room}), so epochs after the first decode the copies "
                       "(training.cache_gb empty; set a number of GB to keep every image read, 0 to read the "
                       f"originals every epoch, or {FOLDER_ENV} to keep them elsewhere)")


def not_worth_it(cfg: TrainingConfig, decodes_in_loaders: bool) -> str:
    """Why this run would not gain by resized copies, or "" where it would."""
    if cfg.epochs < AUTO_MIN_EPOCHS:
        return (f"{cfg.epochs} epoch(s), fewer than {AUTO_MIN_EPOCHS}: making the copies would cost the first "
                "epoch more than the later ones gain")
    if cfg.images_per_shard:
        return "the shards are stored resized already (training.images_per_shard)"
    if not decodes_in_loaders:
        return "the rank decodes on its device, and its loaders hand it the bytes"
    return ""


def not_on_local_disk(folder: Path) -> str:
    """Why a cache nobody sized stays out of `folder`, or "" where its filesystem is a local disk."""
    kind = filesystem_type(folder)
    if kind in LOCAL_DISKS:
        return ""
    where = f"a filesystem of type {kind}" if kind else "a filesystem this host's mount table does not name"
    return (f"{folder} is on {where}, not a local disk ({', '.join(sorted(LOCAL_DISKS))}); set {FOLDER_ENV} "
            "to a folder on one, or training.cache_gb to use it anyway")


def too_small(folder: Path, share: int) -> str:
    """Why a share of `share` bytes is not worth a cache, or "" where it is."""
    if share >= AUTO_MIN_BYTES:
        return ""
    return f"a tenth of the space {folder}'s disk has free ({share / 2**30:.2f} GiB) holds too few copies to pay"


def held_bytes(folder: Path) -> int:
    """What the cache in `folder` holds (`ByteCache.held_bytes`: by its ledger, else counted); 0 where
    there is no folder yet."""
    return ByteCache(AUTO_MIN_BYTES, folder).held_bytes()


def not_private(folder: Path) -> str:
    """Why the cache could not use `folder`, or "" where it can: the check `ByteCache` makes before
    its first write (`private_folder`, which makes the folder), made here so that a folder it
    would refuse (another user's, one others may write to, a dangling symlink, a read-only disk)
    is said once as the reason for no cache, not warned of by every loader process of every run."""
    try:
        private_folder(folder, fix=f"set {FOLDER_ENV} to a folder of your own")
    except OSError as error:
        return f"{folder} cannot be the cache's folder ({error})"
    return ""


def nearest_existing(path: Path) -> Path:
    """`path`, or the nearest of its parents that exists (the cache folder is made on first use)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem that holds `path` (or would), from /proc/self/mountinfo: that of
    the last mount over the longest mount point above it (a later mount hides an earlier one);
    None where none is found (no /proc: not Linux)."""
    place = os.path.realpath(nearest_existing(path))
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    found: tuple[int, str] | None = None
    for line in lines:
        fields, _, described = line.partition(" - ")  # after " - ": type, source, options
        parts = fields.split()
        if len(parts) < 5 or not described:
            continue
        point = OCTAL_ESCAPE.sub(lambda escape: chr(int(escape.group(1), 8)), parts[4])
        if (place == point or place.startswith(point.rstrip("/") + "/")) and (found is None or len(point) >= found[0]):
            found = (len(point), described.split()[0])
    return found[1] if found else None


def free_bytes(path: Path) -> int:
    """What this user may still write on the filesystem that holds `path` (or would)."""
    stats = os.statvfs(nearest_existing(path))
    return stats.f_bavail * stats.f_frsize
