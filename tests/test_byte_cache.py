"""The local byte cache: later epochs send no GET, the budget holds across the processes of
a host, a rewritten object of another size or from another endpoint is fetched again, a
folder that is read-only, full or not the user's own is a miss, never a failure. Real S3
(moto) behind the counting front, real processes and real (tmpfs) mounts."""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import multiprocessing.synchronize
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.data.byte_cache import LEDGER, ByteCache, default_folder
from prefect_ddp.tasks.data.dataset import (
    S3ImageFolder,
    eval_transform,
    forget_parent_exit_hooks,
    forked_workers,
)
from tests.support.flow_runs import block_copy

KEYS = [f"{cls}/{i:04d}.jpg" for cls in ("circle", "square", "triangle") for i in range(4)]


def image_folder(location: DataLocation, s3_fs, cache: ByteCache) -> S3ImageFolder:
    sizes = [s3_fs.size(f"{location.url[5:]}/{key}") for key in KEYS]
    return S3ImageFolder(location.url, KEYS, [0] * len(KEYS), location.storage_options(), eval_transform(32),
                         sizes=sizes, cache=cache)


def epoch(dataset: S3ImageFolder, num_workers: int) -> torch.Tensor:
    options = forked_workers() if num_workers else {}
    return torch.cat([images for images, _ in DataLoader(dataset, batch_size=5, num_workers=num_workers, **options)])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_later_epochs_read_the_cache_and_send_no_get(image_location, s3_fs, front, tmp_path, num_workers):
    dataset = image_folder(block_copy(image_location, endpoint_url=front.endpoint), s3_fs, ByteCache(10**8, tmp_path))
    first = epoch(dataset, num_workers)
    gets_after_first = sum(front.gets.values())
    assert gets_after_first >= len(KEYS)  # (a GET retried on a loaded machine counts twice)
    second = epoch(dataset, num_workers)
    assert sum(front.gets.values()) == gets_after_first
    assert torch.equal(first, second)


def test_the_cache_stops_adding_at_its_budget(image_location, s3_fs, front, tmp_path):
    sizes = sorted(s3_fs.size(f"{image_location.url[5:]}/{key}") for key in KEYS)
    budget = sum(sizes[:3])  # room for about three images
    dataset = image_folder(block_copy(image_location, endpoint_url=front.endpoint), s3_fs, ByteCache(budget, tmp_path))
    epoch(dataset, 0)
    assert 0 < ByteCache(budget, tmp_path).bytes_on_disk() <= budget
    epoch(dataset, 0)
    assert len(KEYS) < sum(front.gets.values()) < 2 * len(KEYS)  # the cached few were not fetched again


@pytest.mark.unit
def test_an_object_rewritten_with_another_size_is_fetched_again(tmp_path):
    cache = ByteCache(10**6, tmp_path)
    cache.put("s3://b/a.jpg", 3, b"old")
    assert cache.get("s3://b/a.jpg", 3) == b"old"
    assert cache.get("s3://b/a.jpg", 5) is None


@pytest.mark.unit
def test_an_empty_budget_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="max_bytes must be positive; got 0. Use no cache"):
        ByteCache(0)


# --- The budget holds per host, any cache error is a miss, the folder is private, the key
# names the endpoint (issue 18, item 8).

ENTRY = 1_000
BUDGET = 10 * ENTRY


def put_after_the_others_started(folder: Path, process: int, barrier: multiprocessing.synchronize.Barrier) -> None:
    """One writer of the shared-budget test: an entry, then, once all four have one, 19 more.

    Forked from this test process, it drops the Prefect exit hooks it inherited, as a loader
    worker does (else it ends with code 1 when the session has run a flow before).
    """
    forget_parent_exit_hooks(process)
    cache = ByteCache(BUDGET, folder)
    cache.put(f"s3://b/{process}/0.jpg", ENTRY, bytes(ENTRY))
    barrier.wait(timeout=60)
    for n in range(1, 20):
        cache.put(f"s3://b/{process}/{n}.jpg", ENTRY, bytes(ENTRY))


def test_four_processes_on_one_host_keep_to_one_budget(tmp_path):
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(4)
    writers = [context.Process(target=put_after_the_others_started, args=(tmp_path / "cache", n, barrier))
               for n in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=60)
    assert [writer.exitcode for writer in writers] == [0] * 4
    # The budget fits ten entries exactly: all of it is used, and not a byte more.
    assert ByteCache(BUDGET, tmp_path / "cache").bytes_on_disk() == BUDGET


@pytest.mark.unit
def test_a_hit_takes_no_lock_and_a_write_waits_for_it(tmp_path):
    cache = ByteCache(BUDGET, tmp_path)
    cache.put("s3://b/kept.jpg", 4, b"kept")
    with ThreadPoolExecutor(2) as pool, open(tmp_path / LEDGER) as ledger:
        fcntl.flock(ledger, fcntl.LOCK_EX)  # as a writer in another process holds it
        assert pool.submit(ByteCache(BUDGET, tmp_path).get, "s3://b/kept.jpg", 4).result(timeout=5) == b"kept"
        write = pool.submit(ByteCache(BUDGET, tmp_path).put, "s3://b/new.jpg", 3, b"new")
        assert wait([write], timeout=0.5).not_done
        fcntl.flock(ledger, fcntl.LOCK_UN)
        assert write.result(timeout=10) is True


@pytest.mark.unit
def test_an_entry_cut_short_is_a_miss(tmp_path):
    cache = ByteCache(BUDGET, tmp_path)
    cache.put("s3://b/a.jpg", 4, b"full")
    [entry] = tmp_path.glob("*/*")
    entry.write_bytes(b"fu")  # as a crash can leave a file renamed before its bytes reached the disk
    assert cache.get("s3://b/a.jpg", 4) is None


@pytest.mark.unit
def test_a_copy_is_kept_beside_the_original_and_a_copy_cut_short_is_a_miss(tmp_path):
    cache = ByteCache(BUDGET, tmp_path)
    assert cache.put("s3://b/a.jpg", 4, b"full") and cache.put("s3://b/a.jpg", 4, b"copy!", variant="resized to 8")
    assert cache.get("s3://b/a.jpg", 4) == b"full" and cache.get("s3://b/a.jpg", 4, variant="resized to 8") == b"copy!"
    assert cache.get("s3://b/a.jpg", 4, variant="resized to 9") is None
    copy = next(entry for entry in tmp_path.glob("*/*") if entry.read_bytes().endswith(b"copy!"))
    copy.write_bytes(copy.read_bytes()[:-1])
    assert cache.get("s3://b/a.jpg", 4, variant="resized to 8") is None
    assert cache.put("s3://b/a.jpg", 4, b"copy!", variant="resized to 8")  # written again, counted once
    assert cache.get("s3://b/a.jpg", 4, variant="resized to 8") == b"copy!"
    with open(tmp_path / LEDGER) as ledger:  # high by the byte the cut took, never low (the module's rule)
        assert int(ledger.read()) == cache.bytes_on_disk() + 1


@contextmanager
def tmpfs(folder: Path, options: str) -> Iterator[Path]:
    """A real tmpfs mounted at `folder` (root only), unmounted on the way out."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"Could not mount a tmpfs at {folder} ({mounted.stderr.strip()}); this test needs one.")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture
def cache_folder(tmp_path: Path) -> Iterator[Path]:
    """An empty cache folder of the user's, on a filesystem of its own where root can mount one."""
    if os.geteuid() != 0:
        yield tmp_path / "cache"
        return
    with tmpfs(tmp_path / "cache", "size=1m,mode=0700") as folder:
        yield folder


def make_read_only(folder: Path) -> None:
    """Remount the folder read-only as root (chmod does not stop root); as anyone else,
    take away the write permission of it and of everything in it."""
    if os.geteuid() == 0:
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        return
    for path in [folder, *folder.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)


def stray_files(folder: Path) -> list[Path]:
    """Files in the cache's entry folders that are not entries: temporary files left behind."""
    return [path for path in folder.glob("*/*") if not re.fullmatch(r"[0-9a-f]{64}", path.name)]


def test_a_read_only_folder_serves_what_it_holds_and_adds_nothing(cache_folder, caplog):
    ByteCache(BUDGET, cache_folder).put("s3://b/kept.jpg", 4, b"kept")
    make_read_only(cache_folder)
    cache = ByteCache(BUDGET, cache_folder)
    with caplog.at_level(logging.WARNING, logger="prefect_ddp.tasks.data.byte_cache"):
        assert cache.get("s3://b/kept.jpg", 4) == b"kept"
        assert cache.put("s3://b/new.jpg", 3, b"new") is False
        assert cache.put("s3://b/other.jpg", 5, b"other") is False
        assert cache.get("s3://b/new.jpg", 3) is None
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # once per process, not once per image
    assert str(cache_folder) in warnings[0] and "PREFECT_DDP_CACHE_DIR" in warnings[0]
    assert stray_files(cache_folder) == []


def test_a_full_disk_ends_adding_without_a_failure_or_a_partial_file(tmp_path, caplog):
    if os.geteuid() != 0:
        pytest.skip("Filling a disk needs a tiny tmpfs, and only root can mount one.")
    images = {f"s3://b/{n}.jpg": bytes([n]) * 8_000 for n in range(20)}  # 160 kB into 64 kB
    with tmpfs(tmp_path / "cache", "size=64k,mode=0700") as folder, \
            caplog.at_level(logging.WARNING, logger="prefect_ddp.tasks.data.byte_cache"):
        cache = ByteCache(10**6, folder)
        kept = [cache.put(url, len(data), data) for url, data in images.items()]
        assert True in kept and kept[-1] is False
        assert stray_files(folder) == []
        assert [cache.get(url, len(data)) for url, data in images.items()] == \
            [data if was_kept else None for (url, data), was_kept in zip(images.items(), kept)]
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings


@pytest.mark.unit
def test_the_default_folder_is_the_users_own_cache_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFECT_DDP_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_folder() == tmp_path / "home" / ".cache" / "prefect-ddp" / "images"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_folder() == tmp_path / "xdg" / "prefect-ddp" / "images"
    monkeypatch.setenv("PREFECT_DDP_CACHE_DIR", str(tmp_path / "chosen"))
    assert default_folder() == tmp_path / "chosen"

    assert ByteCache(BUDGET).put("s3://b/a.jpg", 1, b"a") is True
    assert stat.S_IMODE((tmp_path / "chosen").stat().st_mode) == 0o700


@pytest.mark.unit
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1733])
def test_a_folder_others_can_write_to_is_not_used(tmp_path, caplog, mode):
    folder = tmp_path / "cache"
    ByteCache(BUDGET, folder).put("s3://b/a.jpg", 7, b"planted")  # as another user could have
    folder.chmod(mode)
    cache = ByteCache(BUDGET, folder)
    with caplog.at_level(logging.WARNING, logger="prefect_ddp.tasks.data.byte_cache"):
        assert cache.get("s3://b/a.jpg", 7) is None
        assert cache.put("s3://b/b.jpg", 1, b"b") is False
    assert cache.bytes_on_disk() == 7
    assert re.search(rf"{re.escape(str(folder))} is owned by uid {os.geteuid()} with mode {oct(mode)}.*"
                     rf"Fix: chmod 700 {re.escape(str(folder))}", caplog.text)


@pytest.mark.unit
def test_a_folder_of_another_user_is_not_used(tmp_path, caplog):
    if os.geteuid() != 0:
        pytest.skip("Only root can give a folder to another user.")
    folder = tmp_path / "cache"
    ByteCache(BUDGET, folder).put("s3://b/a.jpg", 7, b"planted")
    os.chown(folder, 65534, 65534)
    cache = ByteCache(BUDGET, folder)
    with caplog.at_level(logging.WARNING, logger="prefect_ddp.tasks.data.byte_cache"):
        assert cache.get("s3://b/a.jpg", 7) is None
        assert cache.put("s3://b/b.jpg", 1, b"b") is False
    assert re.search(rf"{re.escape(str(folder))} is owned by uid 65534 .*set PREFECT_DDP_CACHE_DIR", caplog.text)


@pytest.mark.unit
def test_the_same_url_and_size_from_two_endpoints_are_two_entries(tmp_path):
    first = ByteCache(BUDGET, tmp_path).for_storage({"endpoint_url": "http://first:9000"})
    second = ByteCache(BUDGET, tmp_path).for_storage({"client_kwargs": {"endpoint_url": "http://second:9000"}})
    first.put("s3://b/a.jpg", 5, b"first")
    assert second.get("s3://b/a.jpg", 5) is None
    second.put("s3://b/a.jpg", 5, b"other")
    assert (first.get("s3://b/a.jpg", 5), second.get("s3://b/a.jpg", 5)) == (b"first", b"other")


@pytest.mark.unit
def test_an_etag_where_known_is_part_of_the_key(tmp_path):
    cache = ByteCache(BUDGET, tmp_path)
    cache.put("s3://b/a.jpg", 3, b"old", etag='"1"')
    assert cache.get("s3://b/a.jpg", 3, etag='"1"') == b"old"
    assert cache.get("s3://b/a.jpg", 3, etag='"2"') is None


def test_a_dataset_on_another_endpoint_does_not_read_the_first_ones_images(image_location, s3_fs, front, tmp_path):
    epoch(image_folder(image_location, s3_fs, ByteCache(10**8, tmp_path)), 0)
    epoch(image_folder(block_copy(image_location, endpoint_url=front.endpoint), s3_fs, ByteCache(10**8, tmp_path)), 0)
    assert sum(front.gets.values()) >= len(KEYS)


# --- Entries are trusted only where this user wrote them: a folder made private later (the fix
# the warning above gives) still holds what others wrote while it was open (issue 46, item 4).

URL = "s3://b/a.jpg"
GENUINE, PLANTED = b"genuine", b"planted"  # the bucket's image, and another user's of its size


def cache_with_an_entry(folder: Path) -> tuple[ByteCache, Path]:
    """A cache holding GENUINE for URL, and the path of its entry, for a test to plant in its place."""
    cache = ByteCache(BUDGET, folder)
    assert cache.put(URL, len(GENUINE), GENUINE)
    [entry] = folder.glob("*/*")
    return cache, entry


def untrusted_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.levelno == logging.WARNING and "wrote or can write" in record.getMessage()]


@pytest.mark.unit
def test_an_entry_others_can_write_to_is_a_miss_and_put_replaces_it(tmp_path, caplog):
    cache, entry = cache_with_an_entry(tmp_path)
    entry.write_bytes(PLANTED)
    entry.chmod(0o666)  # anyone could have written it
    with caplog.at_level(logging.WARNING, logger="prefect_ddp.tasks.data.byte_cache"):
        assert cache.get(URL, len(GENUINE)) is None
        assert cache.get(URL, len(GENUINE)) is None
        assert cache.put(URL, len(GENUINE), GENUINE) is True  # not taken for one another process fetched
    assert cache.get(URL, len(GENUINE)) == GENUINE
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    [warning] = untrusted_warnings(caplog)  # once per process, not once per image
    assert f"{entry} is -rw-rw-rw-, owned by uid {os.geteuid()}" in warning
    assert f"mv {tmp_path} {tmp_path}.untrusted" in warning and "PREFECT_DDP_CACHE_DIR" in warning


@pytest.mark.unit
def test_a_symlink_in_place_of_an_entry_is_a_miss_and_put_does_not_follow_it(tmp_path):
    cache, entry = cache_with_an_entry(tmp_path / "cache")
    elsewhere = tmp_path / "elsewhere.jpg"
    elsewhere.write_bytes(PLANTED)
    entry.unlink()
    entry.symlink_to(elsewhere)
    assert cache.get(URL, len(GENUINE)) is None
    assert cache.put(URL, len(GENUINE), GENUINE) is True
    assert cache.get(URL, len(GENUINE)) == GENUINE
    assert not entry.is_symlink() and elsewhere.read_bytes() == PLANTED


@pytest.mark.unit
def test_a_fifo_in_place_of_an_entry_is_a_miss_without_waiting_for_a_writer(tmp_path):
    cache, entry = cache_with_an_entry(tmp_path)
    entry.unlink()
    os.mkfifo(entry)
    with ThreadPoolExecutor(1) as pool:
        read = pool.submit(cache.get, URL, len(GENUINE))
        try:
            assert read.result(timeout=5) is None
        finally:
            if not read.done():  # a read that waits for a writer: be it, so that the test ends
                os.close(os.open(entry, os.O_WRONLY | os.O_NONBLOCK))
    assert cache.put(URL, len(GENUINE), GENUINE) is True
    assert cache.get(URL, len(GENUINE)) == GENUINE


@pytest.mark.unit
@pytest.mark.parametrize("subfolder", ["writable by others", "a symlink"])
def test_an_entry_in_a_subfolder_not_the_users_alone_is_a_miss_and_put_adds_nothing_there(tmp_path, caplog,
                                                                                           subfolder):
    cache, entry = cache_with_an_entry(tmp_path / "cache")
    entry.write_bytes(PLANTED)
    if subfolder == "writable by others":
        entry.parent.chmod(0o777)  # anyone could have replaced the entry
    else:
        entry.parent.rename(tmp_path / "elsewhere")
        entry.parent.symlink_to(tmp_path / "elsewhere")
    with caplog.at_level(logging.WARNING, logger="prefect_ddp.tasks.data.byte_cache"):
        assert cache.get(URL, len(GENUINE)) is None
        assert cache.put(URL, len(GENUINE), GENUINE) is False
    assert entry.read_bytes() == PLANTED and [path.name for path in entry.parent.iterdir()] == [entry.name]
    [warning] = untrusted_warnings(caplog)
    assert str(entry.parent) in warning


@pytest.mark.unit
@pytest.mark.parametrize("target", ["a file", "no file yet"])
def test_a_symlink_in_place_of_the_ledger_is_not_written_through(tmp_path, caplog, target):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    if target == "a file":
        elsewhere.write_text("another file of the user's")
    (folder / LEDGER).symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="prefect_ddp.tasks.data.byte_cache"):
        assert ByteCache(BUDGET, folder).put(URL, len(GENUINE), GENUINE) is False
    if target == "a file":
        assert elsewhere.read_text() == "another file of the user's"
    else:
        assert not elsewhere.exists()
    [warning] = untrusted_warnings(caplog)
    assert f"{folder / LEDGER} is a symlink" in warning


OTHER_UID = 65534  # nobody


@pytest.mark.unit
@pytest.mark.skipif(os.geteuid() != 0, reason="Only root can write a file as another user.")
def test_an_image_another_user_planted_in_a_subfolder_of_its_own_is_a_miss(tmp_path, caplog):
    folder = tmp_path / "cache"
    _, entry = cache_with_an_entry(folder)  # only to learn where the entry goes
    shutil.rmtree(entry.parent)
    folder.chmod(0o777)  # the user's folder, open to others: refused, with the advice "chmod 700"
    entry.parent.mkdir()  # another user plants an image where training will look for it
    entry.write_bytes(PLANTED)
    for path in (entry.parent, entry):
        os.chown(path, OTHER_UID, OTHER_UID)
    folder.chmod(0o700)  # the user follows the advice
    cache = ByteCache(BUDGET, folder)
    with caplog.at_level(logging.WARNING, logger="prefect_ddp.tasks.data.byte_cache"):
        assert cache.get(URL, len(GENUINE)) is None
        assert cache.put(URL, len(GENUINE), GENUINE) is False  # not into another user's subfolder
    assert entry.read_bytes() == PLANTED
    [warning] = untrusted_warnings(caplog)
    assert f"{entry.parent} is drwx" in warning and f"owned by uid {OTHER_UID}" in warning


@pytest.mark.unit
@pytest.mark.skipif(os.geteuid() != 0, reason="Only root can write a file as another user.")
def test_an_image_another_user_planted_in_the_users_subfolder_is_a_miss_and_put_replaces_it(tmp_path):
    folder = tmp_path / "cache"
    _, entry = cache_with_an_entry(folder)
    for path in (folder, entry.parent):
        path.chmod(0o777)  # as `chmod -R a+rwX` on the cache would
    entry.unlink()  # another user replaces the image
    entry.write_bytes(PLANTED)
    os.chown(entry, OTHER_UID, OTHER_UID)
    for path in (folder, entry.parent):
        path.chmod(0o700)  # `chmod -R 700`: the other user's entry is not the user's to change
    cache = ByteCache(BUDGET, folder)
    assert cache.get(URL, len(GENUINE)) is None
    assert cache.put(URL, len(GENUINE), GENUINE) is True
    assert cache.get(URL, len(GENUINE)) == GENUINE and entry.stat().st_uid == os.geteuid()
