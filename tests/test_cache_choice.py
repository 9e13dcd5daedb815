"""The byte cache a rank reads through when training.cache_gb is empty: resized copies of its
training images, on a local disk, where later epochs read them (tasks/data/cache_choice.py)."""

from __future__ import annotations

import io
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.deployments.sample_data import shapes_dataset
from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data import cache_choice as choice_module
from prefect_ddp.tasks.data.byte_cache import ByteCache
from prefect_ddp.tasks.data.cache_choice import (
    AUTO_COPY_SHRINK,
    AUTO_DISK_SHARE,
    AUTO_MIN_BYTES,
    LOCAL_DISKS,
    cache_choice,
    filesystem_type,
)
from prefect_ddp.tasks.data.dataset import S3ImageFolder, decode_side, train_transform
from prefect_ddp.tasks.data.loaders import RankData, rank_data
from prefect_ddp.tasks.data.splitting import stratified_split
from prefect_ddp.tasks.training.job import TrainJob
from prefect_ddp.tasks.training.recipe import train_classifier
from tests.support.image_folders import local_image_folder
from tests.test_training import CTX

BIG_SIDE = 128  # the photos' side: over twice what a 32-px crop needs (decode_side(32) = 48)


def on_disk(monkeypatch: pytest.MonkeyPatch, kind: str | None, free: int = 10**12) -> None:
    """The cache folder's filesystem as `kind` with `free` bytes free: this host's own may be either."""
    monkeypatch.setattr(choice_module, "filesystem_type", lambda folder: kind)
    monkeypatch.setattr(choice_module, "free_bytes", lambda folder: free)


@pytest.mark.unit
def test_a_run_of_several_epochs_keeps_copies_of_its_training_images_on_a_local_disk(tmp_path, monkeypatch):
    on_disk(monkeypatch, "ext4", free=500 * 10**9)
    chosen = cache_choice(TrainingConfig(epochs=3), decodes_in_loaders=True, folder=tmp_path)
    assert chosen.cache is not None and chosen.cache.max_bytes == int(500 * 10**9 * AUTO_DISK_SHARE)
    assert chosen.copy_shrink == AUTO_COPY_SHRINK == 2 and not chosen.with_validation
    assert (f"kept as copies resized to it in {tmp_path} (up to 50.0 GB of entries, a tenth of its disk's free "
            "space counting the 0.0 GB it holds), so epochs after the first decode the copies") in chosen.why
    assert "0 to read the originals every epoch" in chosen.why


@pytest.mark.unit
@pytest.mark.parametrize(("cfg", "in_loaders", "kind", "free", "why"), [
    (TrainingConfig(epochs=1), True, "ext4", 10**12, "1 epoch(s), fewer than 3: making the copies would cost"),
    (TrainingConfig(epochs=2), True, "ext4", 10**12, "2 epoch(s), fewer than 3"),
    (TrainingConfig(epochs=3, images_per_shard=64), True, "ext4", 10**12, "shards are stored resized already"),
    (TrainingConfig(epochs=3), False, "ext4", 10**12, "the rank decodes on its device"),
    (TrainingConfig(epochs=3), True, "nfs4", 10**12, "on a filesystem of type nfs4, not a local disk"),
    (TrainingConfig(epochs=3), True, "tmpfs", 10**12, "on a filesystem of type tmpfs, not a local disk"),
    (TrainingConfig(epochs=3), True, "fuse.s3fs", 10**12, "of type fuse.s3fs"),
    (TrainingConfig(epochs=3), True, None, 10**12, "a filesystem this host's mount table does not name"),
    (TrainingConfig(epochs=3), True, "overlay", 10**12, "on a filesystem of type overlay, not a local disk"),
    (TrainingConfig(epochs=3), True, "xfs", 300 * 2**20, "a tenth of the space"),
])
def test_a_run_that_would_not_gain_by_copies_keeps_none_and_says_why(tmp_path, monkeypatch, cfg, in_loaders, kind,
                                                                    free, why):
    on_disk(monkeypatch, kind, free)
    chosen = cache_choice(cfg, decodes_in_loaders=in_loaders, folder=tmp_path)
    assert chosen.cache is None
    assert chosen.why.startswith("no byte cache (training.cache_gb empty): ") and why in chosen.why


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["under a file", "others may write", "a dangling symlink"])
def test_a_folder_the_cache_would_refuse_keeps_no_cache_and_says_why_once(tmp_path, monkeypatch, caplog, kind):
    on_disk(monkeypatch, "ext4")
    folder = tmp_path / "cache"
    if kind == "under a file":
        (tmp_path / "a-file").write_bytes(b"")
        folder = tmp_path / "a-file" / "cache"
    elif kind == "others may write":
        folder.mkdir(mode=0o775)
        folder.chmod(0o775)
    else:
        folder.symlink_to(tmp_path / "gone")
    with caplog.at_level(logging.WARNING):
        chosen = cache_choice(TrainingConfig(epochs=3), decodes_in_loaders=True, folder=folder)
    assert chosen.cache is None and f"{folder} cannot be the cache's folder (" in chosen.why
    assert not caplog.records  # the reason for no cache, not a warning


@pytest.mark.unit
def test_the_share_counts_what_the_folder_holds_and_a_full_cache_is_still_read(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    assert ByteCache(10**9, folder).put("s3://bucket/a.jpg", 10**6, b"x" * 10**6)  # the ledger: 1 MB held
    on_disk(monkeypatch, "ext4", free=9 * 10**6 + AUTO_MIN_BYTES * 10)
    chosen = cache_choice(TrainingConfig(epochs=3), decodes_in_loaders=True, folder=folder)
    assert chosen.cache is not None and chosen.cache.max_bytes == int((10**6 + 9 * 10**6 + AUTO_MIN_BYTES * 10) * AUTO_DISK_SHARE)
    assert ByteCache(1, folder).held_bytes() == 10**6
    monkeypatch.setattr(ByteCache, "held_bytes", lambda self: 10**12)  # a cache that took its tenth
    full = cache_choice(TrainingConfig(epochs=3), decodes_in_loaders=True, folder=folder)
    assert full.cache is not None and "full, so the copies kept are read and no more made" in full.why


@pytest.mark.unit
def test_a_choice_that_keeps_no_cache_makes_no_folder(tmp_path, monkeypatch):
    on_disk(monkeypatch, "ext4", free=AUTO_MIN_BYTES)  # a tenth of it: too small
    folder = tmp_path / "not" / "made"
    assert cache_choice(TrainingConfig(epochs=3), decodes_in_loaders=True, folder=folder).cache is None
    assert not (tmp_path / "not").exists()


@pytest.mark.unit
def test_what_a_folder_holds_is_its_ledgers_else_counted_and_nothing_in_a_ledger_planted(tmp_path):
    folder = tmp_path / "cache"
    assert ByteCache(10**9, folder).put("s3://bucket/a.jpg", 3000, b"x" * 3000)
    (folder / "used-bytes").write_bytes(b"")  # an earlier version's folder: no number in its ledger
    assert ByteCache(1, folder).held_bytes() == 3000
    (folder / "used-bytes").unlink()
    assert ByteCache(1, folder).held_bytes() == 3000
    (tmp_path / "elsewhere").write_bytes(b"9" * 20)
    (folder / "used-bytes").symlink_to(tmp_path / "elsewhere")  # planted: put would not add to it either
    assert ByteCache(1, folder).held_bytes() == 0
    assert ByteCache(1, tmp_path / "none-yet").held_bytes() == 0


LAST_MOUNT_WINS = "from pathlib import Path; from {module} import filesystem_type; print(filesystem_type(Path('{path}')))"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) for a mount namespace of its own")
def test_the_last_mount_over_a_folder_names_its_filesystem(tmp_path):
    place = tmp_path / "stacked"
    place.mkdir()
    script = (f"mount -t tmpfs tmpfs {place} && mount -t ramfs ramfs {place} && mkdir {place}/sub && exec "
              f"{sys.executable} -c \"{LAST_MOUNT_WINS.format(module=choice_module.__name__, path=place / 'sub' / 'x')}\"")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ramfs"


@pytest.mark.unit
def test_a_cache_size_set_keeps_every_image_read_wherever_the_folder_is(tmp_path, monkeypatch):
    on_disk(monkeypatch, "nfs4", free=0)
    chosen = cache_choice(TrainingConfig(epochs=1, cache_gb=2.5), decodes_in_loaders=True, folder=tmp_path)
    assert chosen.cache is not None and chosen.cache.max_bytes == 2_500_000_000
    assert chosen.copy_shrink is None and chosen.with_validation
    assert chosen.why == f"training.cache_gb=2.5: up to 2.5 GB in {tmp_path}"
    off = cache_choice(TrainingConfig(epochs=5, cache_gb=0), decodes_in_loaders=True, folder=tmp_path)
    assert off.cache is None and off.why == "training.cache_gb=0: no byte cache"


@pytest.mark.unit
def test_the_filesystem_is_read_from_this_hosts_mount_table(tmp_path):
    assert filesystem_type(Path("/proc/self")) == "proc"
    assert filesystem_type(tmp_path / "not" / "made" / "yet") == filesystem_type(tmp_path)  # the folder is made later
    shm = Path("/dev/shm")
    if shm.is_dir():
        assert filesystem_type(shm) == "tmpfs"


def jpeg(side: int, seed: int) -> bytes:
    """A JPEG of `side` x `side` px."""
    return next(iter(shapes_dataset(1, size=side, seed=seed).values()))


@pytest.mark.unit
def test_copies_only_of_images_over_twice_the_side_needed_and_nothing_of_the_others(tmp_path):
    side = decode_side(32)  # 48
    images = {"big.jpg": jpeg(2 * side + 1, 1), "twice.jpg": jpeg(2 * side, 2), "small.jpg": jpeg(32, 3)}
    (tmp_path / "photos").mkdir()
    for key, data in images.items():
        (tmp_path / "photos" / key).write_bytes(data)
    cache = ByteCache(10**8, tmp_path / "cache")

    def dataset() -> S3ImageFolder:
        return S3ImageFolder(str(tmp_path / "photos"), list(images), [0, 1, 2], {}, train_transform(32),
                             sizes=[len(data) for data in images.values()], cache=cache, copy_shrink=AUTO_COPY_SHRINK)

    first = dataset().fetch([0, 1, 2])
    assert first[1:] == [images["twice.jpg"], images["small.jpg"]] and first[0] != images["big.jpg"]
    assert min(Image.open(io.BytesIO(first[0])).size) == side  # the copy trains from the first epoch
    assert len(list((tmp_path / "cache").glob("*/*"))) == 1  # the copy alone: no other image's bytes
    (tmp_path / "photos" / "big.jpg").unlink()  # a later epoch reads the copy, not the bucket
    assert dataset().fetch([0, 1, 2]) == first


def photo_job(tmp_path: Path, epochs: int, cache_gb: float | None = None) -> TrainJob:
    """A run over 128-px photos at a 32-px crop: every image over twice the side training needs."""
    root = tmp_path / "images"
    manifest = local_image_folder(root, per_class=4, size=BIG_SIDE)
    return TrainJob(
        source=DataLocation(url=str(root)), output=DataLocation(url=str(tmp_path / "run")),
        manifest=manifest, split=stratified_split(manifest, 0.25, 0),
        model=ModelConfig(backbone="mobilenet_v3_small"),
        training=TrainingConfig(epochs=epochs, batch_size=4, image_size=32, num_workers=0, cache_gb=cache_gb),
    )


@pytest.mark.unit
def test_rank_zero_probes_the_decode_unless_a_cache_copies_every_image_larger_than_the_crop_needs(tmp_path,
                                                                                                 monkeypatch):
    monkeypatch.setenv("PREFECT_DDP_CACHE_DIR", str(tmp_path / "cache"))
    on_disk(monkeypatch, "ext4")  # whatever this host's temporary folder is on
    job = photo_job(tmp_path, epochs=3)

    def data(cache_gb: float | None) -> RankData:
        cfg = job.training.model_copy(update={"cache_gb": cache_gb})
        return rank_data(CTX, job.source, job.output, job.manifest, job.split, cfg, job.preprocessing)

    # The flow's own cache leaves images under twice the side as stored: the loaders may still decode originals.
    assert data(None).cache.copy_shrink == AUTO_COPY_SHRINK and data(None).decodes_originals
    assert not data(1.0).decodes_originals  # a size set: every image larger than the crop needs, copied
    assert data(0).decodes_originals


# Not `unit` (it starts nothing): the recipe twice over, 5-15 s on 2 busy cores.
def test_a_run_with_the_default_cache_trains_later_epochs_on_copies_of_its_training_images_only(tmp_path, monkeypatch,
                                                                                              caplog):
    folder = tmp_path / "cache"
    monkeypatch.setenv("PREFECT_DDP_CACHE_DIR", str(folder))
    job = photo_job(tmp_path, epochs=3)
    with caplog.at_level(logging.INFO):
        train_classifier(CTX, job)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Byte cache of rank 0: ")]
    entries = list(folder.glob("*/*"))
    if filesystem_type(folder) in LOCAL_DISKS:
        assert said and "are kept as copies resized to it" in said[0]
        # Each training image once (one a epoch is left out: a lone last batch breaks BatchNorm), no
        # validation image: 9 and 3 here.
        assert len(job.split.train) - 1 <= len(entries) <= len(job.split.train)
        stored = [Image.open(io.BytesIO(entry.read_bytes()[8:])) for entry in entries]  # after the entry's length
        assert {min(image.size) for image in stored} == {decode_side(32)}
    else:  # this host's temporary folder is no local disk: the default leaves it alone, and says so
        assert said and "not a local disk" in said[0] and not entries
    two_epochs = photo_job(tmp_path / "again", epochs=2)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train_classifier(CTX, two_epochs)
    assert "Byte cache of rank 0: no byte cache (training.cache_gb empty): 2 epoch(s), fewer than 3" in caplog.text
    assert len(list(folder.glob("*/*"))) == len(entries)
