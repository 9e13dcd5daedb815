"""Fetched image bytes kept on the worker host's local disk, so later epochs send no GET.

Every epoch reads every training image again; from S3 that is one GET per image per
epoch, and the latency of object storage. The cache keeps the bytes as fetched (not the
decoded tensors: those are larger than the JPEGs, and augmentation differs per epoch) in
a folder on local disk that every rank and loader worker on the host shares.

- Private: the user's own cache folder (`default_folder`), created with mode 0700. A folder
  that another user owns, or that group or others may write to, is not used: whoever can
  write there could plant images that training would take for the bucket's. The cache is
  then off in that process, with a warning that names the folder and the fix. Its contents are
  checked too, as a folder made private later (`chmod 700`) still holds what others wrote while
  it was open: an entry, an entry's subfolder or the ledger that only this user can have
  written (this user's, writable by no one else, not a symlink) is used; any other is never
  read, written through or taken for an entry. Such an entry is a miss, replaced by `put`
  where its subfolder is this user's; such a subfolder or ledger keeps `put` from adding
  there. One warning per process names the folder and the fix (move it away).
- Keyed on the storage endpoint, the object's URL, its size from the manifest and its ETag
  where the caller knows one: the same bucket and key on another endpoint (a MinIO beside
  AWS) is another object. An object rewritten in place with the same size, where no ETag
  is given, is not fetched again (the listing holds no checksum), so delete the folder
  after rewriting images in place (the whole folder: its total goes with it).
- Bounded per host: the folder holds at most `max_bytes` of images, whichever processes
  wrote them. Writers keep the total in a ledger file in the folder and update it under an
  exclusive `flock`, so no two of them can take the same room; reads take no lock. It
  fills up and then stops adding (no eviction: a training set that does not fit is read
  from S3 in the part that did not fit).
- Copies instead of originals: a caller may keep a copy it made of an object (`variant`
  names how: a camera original resized to the side training needs, `S3ImageFolder`) under
  the object's key and the variant's name. Such an entry carries its own length in front,
  as its size is not the object's, so an entry cut short is still a miss.
- Never a failure: any error of the cache (a read-only folder, a full disk, a permission
  error) is a miss. `put` then returns False, leaves no temporary file behind and logs one
  warning per process. Entries are written to a temporary file renamed into place, so a
  reader never sees a partial file; an entry of another size than its key's (cut short by
  a crash before the disk had it) is a miss too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect_ddp.tasks.private_folder import private_folder

FOLDER_ENV = "PREFECT_DDP_CACHE_DIR"
# The folder's running total of entry bytes. At the top of the folder, where no entry is
# (entries live one folder down), so counting the entries never counts it.
LEDGER = "used-bytes"
LEDGER_DIGITS = 20  # fixed width: one pwrite replaces the whole number
LENGTH_BYTES = 8  # in front of a variant's entry: its own length

logger = logging.getLogger(__name__)
_warned: set[tuple[Path, str]] = set()  # (folder, kind of trouble) already logged by this process


class _Untrusted(OSError):
    """A file or folder in the cache that someone other than this user wrote or can write:
    it could hold images planted to be taken for the bucket's, or lead a write elsewhere."""


def default_folder() -> Path:
    """The user's own cache folder on this host: $PREFECT_DDP_CACHE_DIR, else
    $XDG_CACHE_HOME/prefect-ddp/images, else ~/.cache/prefect-ddp/images.

    Not the temp folder: there every user shares one folder under a name anyone can guess,
    so a second user cannot write to it and any user can plant images in it.
    """
    if os.environ.get(FOLDER_ENV):
        return Path(os.environ[FOLDER_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prefect-ddp" / "images"


class ByteCache:
    """Image bytes by (endpoint, URL, size, ETag) below `folder`, at most `max_bytes` in all.

    Args:
        max_bytes: what the folder may hold, whichever processes of the host wrote it.
        folder: where; `default_folder()` when not given.
        endpoint: the storage endpoint the objects come from, part of every key;
            `for_storage` sets it from a dataset's storage options.

    >>> cache = ByteCache(10**6, tempfile.mkdtemp())
    >>> cache.put("s3://bucket/a.jpg", 3, b"abc"), cache.get("s3://bucket/a.jpg", 3)
    (True, b'abc')
    """

    def __init__(self, max_bytes: int, folder: Path | str | None = None, endpoint: str = "") -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive; got {max_bytes}. Use no cache instead of an empty one.")
        self.folder = Path(folder) if folder else default_folder()
        self.max_bytes = max_bytes
        self.endpoint = endpoint
        self._private: bool | None = None  # whether the folder is the user's alone: checked on first use

    def for_storage(self, storage_options: dict[str, Any]) -> ByteCache:
        """This cache keyed on the endpoint `storage_options` name: `endpoint_url` at the top
        or under `client_kwargs`, as s3fs takes either; none (AWS, a local path) keys as ""."""
        client_kwargs = storage_options.get("client_kwargs") or {}
        endpoint = storage_options.get("endpoint_url") or client_kwargs.get("endpoint_url") or ""
        return ByteCache(self.max_bytes, self.folder, endpoint)

    def get(self, url: str, size: int | None, etag: str | None = None, variant: str = "") -> bytes | None:
        """The kept bytes (of the `variant` copy, where one is named), or None where they are not
        kept or cannot be read: a miss, never an error."""
        if not self._usable():
            return None
        try:
            data = _read_own(self._path(url, size, etag, variant))
        except FileNotFoundError:
            return None
        except _Untrusted as error:
            self._warn_untrusted(error)
            return None
        except OSError as error:
            self._warn_once("read", f"Could not read the image cache in {self.folder} ({error}); such images "
                            f"are fetched from storage instead. Make the folder readable, or set {FOLDER_ENV} "
                            "to another folder of your own.")
            return None
        if variant:
            return _unframed(data)
        return data if size is None or len(data) == size else None

    def put(self, url: str, size: int | None, data: bytes, etag: str | None = None, variant: str = "") -> bool:
        """Keep `data` unless that would pass the budget or the cache cannot be written;
        returns whether it is kept. Bytes of another size than `size` are not kept: the
        object changed after it was listed, and the key would name the old one. With a
        `variant`, `data` is that copy of the object and `size` still the object's: the
        caller checked the object it copied against it."""
        if not self._usable() or (not variant and size is not None and len(data) != size):
            return False
        entry = _framed(data) if variant else data
        try:
            with self._ledger() as ledger:
                return self._add(ledger, self._path(url, size, etag, variant), entry)
        except _Untrusted as error:
            self._warn_untrusted(error)
            return False
        except OSError as error:
            self._warn_once("write", f"Could not add images to the cache in {self.folder} ({error}); images "
                            "not cached are fetched from storage every epoch. Free space there or make it "
                            f"writable, set {FOLDER_ENV} to another folder of your own, or set "
                            "training.cache_gb=0 to turn the cache off.")
            return False

    def held_bytes(self) -> int:
        """What the folder holds, as `put` would count it: by its ledger, read without the writers'
        lock (a glance: a write under way may be counted or not), else counted from the disk (a
        folder an earlier version filled, or whose ledger holds no number yet); 0 where the
        ledger is not this user's alone (`put` adds nothing there either)."""
        try:
            ledger = _open_own(self.folder / LEDGER, os.O_RDONLY, stat.S_IFREG)
        except _Untrusted:
            return 0
        except OSError:  # no ledger (nor, perhaps, a folder) yet
            return self.bytes_on_disk()
        try:
            return self._total(ledger)
        finally:
            os.close(ledger)

    def bytes_on_disk(self) -> int:
        """What the entries take on disk, counted file by file (the ledger keeps this total
        without counting; a folder without a ledger is counted once). Symlinks are not
        followed: one planted there takes no room, whatever it points to."""
        if not self.folder.exists():
            return 0
        return sum(entry.stat(follow_symlinks=False).st_size
                   for sub in os.scandir(self.folder) if sub.is_dir(follow_symlinks=False)
                   for entry in os.scandir(sub.path) if entry.is_file(follow_symlinks=False))

    def _path(self, url: str, size: int | None, etag: str | None, variant: str) -> Path:
        key: list[Any] = [self.endpoint, url, size, etag, *([variant] if variant else [])]  # originals keyed as before
        digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()
        return self.folder / digest[:2] / digest

    def _usable(self) -> bool:
        if self._private is None:
            self._private = self._claim_folder()
        return self._private

    def _claim_folder(self) -> bool:
        """Create the folder (mode 0700), or check that the one there is the user's and
        writable by no one else; warn and return False where it is not."""
        try:
            private_folder(self.folder, fix=f"set {FOLDER_ENV} to a folder of your own, or set "
                           "training.cache_gb=0 to turn the cache off")
        except OSError as error:
            self._warn_once("folder", f"Not caching images: {error}")
            return False
        return True

    @contextlib.contextmanager
    def _ledger(self) -> Iterator[int]:
        """The ledger's file descriptor, locked against every other writer on the host
        (flock: the lock goes with the open file, so it also holds between two caches of
        one process). Only a ledger of this user's alone (`_open_own`): through a symlink
        planted in its place, the total would be written into a file of the planter's choosing."""
        ledger = _open_own(self.folder / LEDGER, os.O_RDWR | os.O_CREAT, stat.S_IFREG)
        try:
            fcntl.flock(ledger, fcntl.LOCK_EX)
            yield ledger
        finally:
            os.close(ledger)  # and with it the lock

    def _add(self, ledger: int, path: Path, data: bytes) -> bool:
        """Write the entry if it fits the ledger's total, holding the ledger's lock; only into
        a subfolder of this user's alone (else `_Untrusted`)."""
        used = self._total(ledger)
        _own_subfolder(path.parent)
        try:
            kept: os.stat_result | None = path.lstat()  # not stat(): a symlink planted there is not followed
        except FileNotFoundError:
            kept = None
        if kept is not None:
            ours = _ours(kept, stat.S_IFREG)
            if ours and kept.st_size == len(data):  # another process fetched it meanwhile
                return True
            # Cut short (a crash before the disk had it), or planted by someone else: `get`
            # misses it, so it is written again.
            path.unlink()
            # Ours was counted when it was written. A planted one may never have been: its size stays
            # in the total, which may then be high, never low.
            if ours:
                used = max(0, used - kept.st_size)
                _set_total(ledger, used)
        if used + len(data) > self.max_bytes:
            return False
        # Counted before it is written: a process killed mid-write leaves the total high, never low.
        _set_total(ledger, used + len(data))
        try:
            _write_entry(path, data)
        except OSError:
            _set_total(ledger, used)
            raise
        return True

    def _total(self, ledger: int) -> int:
        """The ledger's total; counted from the disk where it holds none yet (a new folder,
        or one an earlier version filled) or not a number."""
        text = os.pread(ledger, LEDGER_DIGITS, 0)
        return int(text) if len(text) == LEDGER_DIGITS and text.isdigit() else self.bytes_on_disk()

    def _warn_once(self, kind: str, message: str) -> None:
        """Log `message` the first time this process meets this kind of trouble with this
        folder: once, not once per image."""
        if (self.folder, kind) not in _warned:
            _warned.add((self.folder, kind))
            logger.warning(message)

    def _warn_untrusted(self, error: _Untrusted) -> None:
        self._warn_once("untrusted", f"Not using files in the image cache {self.folder} that someone other than "
                        f"this user (uid {os.geteuid()}) wrote or can write: {error}. Another user may have put "
                        "them there while the folder was open to others, as images for training to take for "
                        "the bucket's; those images are fetched from storage instead. Fix: move the folder "
                        f"away (mv {self.folder} {self.folder}.untrusted; it is made again, private, on next "
                        "use) and have its owner or root delete it, or set "
                        f"{FOLDER_ENV} to a new folder.")


def _framed(data: bytes) -> bytes:
    return len(data).to_bytes(LENGTH_BYTES, "big") + data


def _unframed(entry: bytes) -> bytes | None:
    """A variant's bytes; None for an entry cut short (or of another shape)."""
    length = int.from_bytes(entry[:LENGTH_BYTES], "big")
    return entry[LENGTH_BYTES:] if len(entry) == LENGTH_BYTES + length else None


def _set_total(ledger: int, total: int) -> None:
    os.pwrite(ledger, f"{total:0{LEDGER_DIGITS}d}".encode(), 0)


def _ours(info: os.stat_result, kind: int) -> bool:
    """Whether `info` (of an lstat or fstat) is of a file of `kind` (stat.S_IFREG, S_IFDIR)
    that only this user can have written: this user's, writable by no one else, and a file of
    one name only (a hard link elsewhere is a name through which it may change)."""
    return (stat.S_IFMT(info.st_mode) == kind and info.st_uid == os.geteuid()
            and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            and (kind != stat.S_IFREG or info.st_nlink == 1))


def _open_own(path: Path, flags: int, kind: int, folder: int | None = None) -> int:
    """`path` opened (by its name in the open `folder`, where one is given) and checked to be
    `_ours` on the open file, so nothing can swap it between check and use. O_NOFOLLOW: a
    symlink planted there would lead elsewhere. O_NONBLOCK: a FIFO planted there fails the
    check instead of hanging the open. Raises _Untrusted where it is not ours."""
    try:
        handle = os.open(path.name if folder is not None else path,
                         flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600, dir_fd=folder)
    except OSError as error:
        if error.errno == errno.ELOOP:  # what O_NOFOLLOW answers for a symlink
            raise _Untrusted(f"{path} is a symlink") from error
        raise
    info = os.fstat(handle)
    if not _ours(info, kind):
        os.close(handle)
        raise _Untrusted(f"{path} is {stat.filemode(info.st_mode)}, owned by uid {info.st_uid}")
    return handle


def _read_own(path: Path) -> bytes:
    """The entry's bytes, where both it and its subfolder are this user's alone; raises
    _Untrusted, before reading a byte, where either is not."""
    folder = _open_own(path.parent, os.O_RDONLY, stat.S_IFDIR)
    try:
        entry = _open_own(path, os.O_RDONLY, stat.S_IFREG, folder)
    finally:
        os.close(folder)
    with os.fdopen(entry, "rb") as file:
        return file.read()


def _own_subfolder(folder: Path) -> None:
    """Make the entries' subfolder (mode 0700) where there is none, and check that it is this
    user's alone: where it is, no one else can swap what is written into it by its path
    (the cache's folder is checked to be the user's alone in `_claim_folder`)."""
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    os.close(_open_own(folder, os.O_RDONLY, stat.S_IFDIR))


def _write_entry(path: Path, data: bytes) -> None:
    """Write a temporary sibling and rename it into place: readers see the whole entry or
    none, and a write that fails (a full disk) leaves nothing behind."""
    handle, temporary = tempfile.mkstemp(dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
