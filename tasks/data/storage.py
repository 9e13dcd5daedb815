"""Reading and writing through fsspec, so s3://, file:// and plain paths behave alike.

Outputs are written under a prefix that the user chose (names below it: tasks/urls.py).
Whole-object reads of images go through tasks/data/object_reads.py; listing, writes and
other filesystems stay here, on fsspec.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import posixpath
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
import torch
from fsspec import AbstractFileSystem


# Writes of one object on a store that keeps less than it was sent (`write_bytes`).
PUT_TRIES = 3
# A part of a file read or written with progress (`read_bytes_reporting`, `write_bytes`); a
# multipart upload's part on S3 (at least 5 MiB there).
READ_PART_BYTES = WRITE_PART_BYTES = 8 << 20


def filesystem(url: str, storage_options: dict[str, Any]) -> tuple[AbstractFileSystem, str]:
    """Return the filesystem for `url` and the path inside it, without a trailing slash."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    return fs, path.rstrip("/")


class ProcessFilesystem:
    """The filesystem of `url`, made again in each process that asks for it.

    Datasets hold one of these instead of a filesystem: a client made before a DataLoader
    forks would share its event loop and sockets with the children.
    """

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.url = url
        self.storage_options = storage_options
        self._made: tuple[int, AbstractFileSystem, str] | None = None

    def get(self) -> tuple[AbstractFileSystem, str]:
        """(filesystem, the path of `url` in it), made in this process."""
        if self._made is None or self._made[0] != os.getpid():
            self._made = (os.getpid(), *filesystem(self.url, self.storage_options))
        return self._made[1], self._made[2]


def write_bytes(url: str, data: bytes, storage_options: dict[str, Any],
                on_part: Callable[[], None] | None = None) -> None:
    """Write `data` so that readers see the old object or the whole new one, never a part.

    S3 makes a PUT visible only once complete; on a filesystem we write a temporary
    sibling and rename it over the target. A store may still keep less than it was sent
    and say it kept it (tests/support/faulty_s3.py, "cut"): on S3 the stored size is read
    back, one HEAD, and a short object written again. `on_part`: called after each
    WRITE_PART_BYTES sent (`_send`), so that a rank writing a large checkpoint shows progress
    while its bytes go, and one whose write is stuck shows none (tasks/gang/progress.py).
    """
    fs, path = filesystem(url, storage_options)
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if "s3" in fs.protocol:
        _put_whole(fs, url, path, data, on_part)
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        _send(fs, tmp, data, on_part)
        fs.mv(tmp, path)
    except BaseException:
        # A write cut short (a full disk) must not leave its part behind, filling the disk more.
        with contextlib.suppress(OSError):
            fs.rm_file(tmp)
        raise


def _send(fs: AbstractFileSystem, path: str, data: bytes, on_part: Callable[[], None] | None) -> None:
    """`data` to `path` in one call, or, with `on_part`, in parts of WRITE_PART_BYTES (a multipart
    upload on S3, visible whole only once completed), calling `on_part` after each."""
    if on_part is None:
        fs.pipe_file(path, data)
        return
    file = fs.open(path, "wb", block_size=WRITE_PART_BYTES)
    try:
        for start in range(0, len(data), WRITE_PART_BYTES):
            file.write(data[start:start + WRITE_PART_BYTES])  # a full part is uploaded here
            on_part()
    except BaseException:
        if "s3" in fs.protocol:
            file.discard()  # closing would complete the upload with the parts sent
        else:
            file.close()  # its temporary file is removed by write_bytes
        raise
    file.close()


def _put_whole(fs: AbstractFileSystem, url: str, path: str, data: bytes,
               on_part: Callable[[], None] | None) -> None:
    """PUT `data` until the store holds all of it, at most PUT_TRIES times. A multipart upload
    (`on_part`) with a part the store kept short fails when it is completed (the part is below
    S3's minimum, or its checksum differs): that too is sent again. A single PUT's errors are
    the client's to retry, and raised."""
    for tried in range(1, PUT_TRIES + 1):
        try:
            _send(fs, path, data, on_part)
        except OSError:
            if on_part is None or tried == PUT_TRIES:
                raise  # the store's own error, as the caller's retry rules know it
            continue  # a multipart upload whose completion was refused: sent again whole
        fs.invalidate_cache(path)
        if (stored := fs.info(path)["size"]) == len(data):
            return
    raise OSError(f"{url}: the store kept {stored} of the {len(data)} bytes written, {PUT_TRIES} times in a "
                  "row. Check the storage service (or the proxy in front of it) for cut-short uploads.")


def read_bytes(url: str, storage_options: dict[str, Any]) -> bytes:
    fs, path = filesystem(url, storage_options)
    data: bytes = fs.cat_file(path)
    return data


def read_bytes_reporting(url: str, storage_options: dict[str, Any], on_progress: Callable[[], None]) -> bytes:
    """`read_bytes` in parts of READ_PART_BYTES, calling `on_progress` after each: a rank reading
    a large file (a kept model of gigabytes) shows progress while it arrives (tasks/gang/progress.py)."""
    fs, path = filesystem(url, storage_options)
    parts = []
    with fs.open(path, "rb", block_size=READ_PART_BYTES) as file:
        while part := file.read(READ_PART_BYTES):
            parts.append(part)
            on_progress()
    return b"".join(parts)


def write_json(url: str, obj: Any, storage_options: dict[str, Any]) -> None:
    write_bytes(url, json.dumps(obj, indent=2, sort_keys=True).encode(), storage_options)


def read_json(url: str, storage_options: dict[str, Any]) -> Any:
    return json.loads(read_bytes(url, storage_options))


def save_torch(url: str, obj: Any, storage_options: dict[str, Any], on_part: Callable[[], None] | None = None) -> None:
    """torch.save `obj` to `url` (`write_bytes`, with its `on_part`)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_bytes(url, buffer.getvalue(), storage_options, on_part)


# What loading a file that is there but cut short or garbled raises, as opposed to the store's
# own errors (OSError and botocore's, retried where transient): torch's zip reader and
# load_state_dict (RuntimeError), its unpickler (UnpicklingError, EOFError, KeyError), json and
# pydantic (ValueError).
GARBLED: tuple[type[Exception], ...] = (RuntimeError, EOFError, KeyError, pickle.UnpicklingError, ValueError)


def garbled_text(error: BaseException) -> str:
    """An error of GARBLED as one short line for a log or report (torch's run to paragraphs)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first[:200]}" if first else type(error).__name__


def load_torch(url: str, storage_options: dict[str, Any]) -> Any:
    """Load tensors saved by `save_torch`; weights_only because the bytes come from storage."""
    return torch_from_bytes(read_bytes(url, storage_options))


def torch_from_bytes(data: bytes) -> Any:
    """Tensors from the bytes of a file `save_torch` wrote, read from storage (weights_only)."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def exists(url: str, storage_options: dict[str, Any]) -> bool:
    fs, path = filesystem(url, storage_options)
    found: bool = fs.exists(path)
    return found


def remove_tree(url: str, storage_options: dict[str, Any]) -> None:
    """Delete `url` and everything below it; nothing to delete is no error."""
    fs, path = filesystem(url, storage_options)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
