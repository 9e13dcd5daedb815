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
import posixpath
import uuid
from typing import Any

import fsspec
import torch
from fsspec import AbstractFileSystem


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


def write_bytes(url: str, data: bytes, storage_options: dict[str, Any]) -> None:
    """Write `data` so that readers see the old object or the whole new one, never a part.

    S3 makes a PUT visible only once complete; on a filesystem we write a temporary
    sibling and rename it over the target.
    """
    fs, path = filesystem(url, storage_options)
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if "s3" in fs.protocol:
        fs.pipe_file(path, data)
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
    except BaseException:
        # A write cut short (a full disk) must not leave its part behind, filling the disk more.
        with contextlib.suppress(OSError):
            fs.rm_file(tmp)
        raise


def read_bytes(url: str, storage_options: dict[str, Any]) -> bytes:
    fs, path = filesystem(url, storage_options)
    data: bytes = fs.cat_file(path)
    return data


def write_json(url: str, obj: Any, storage_options: dict[str, Any]) -> None:
    write_bytes(url, json.dumps(obj, indent=2, sort_keys=True).encode(), storage_options)


def read_json(url: str, storage_options: dict[str, Any]) -> Any:
    return json.loads(read_bytes(url, storage_options))


def save_torch(url: str, obj: Any, storage_options: dict[str, Any]) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_bytes(url, buffer.getvalue(), storage_options)


def load_torch(url: str, storage_options: dict[str, Any]) -> Any:
    """Load tensors saved by `save_torch`; weights_only because the bytes come from storage."""
    return torch.load(io.BytesIO(read_bytes(url, storage_options)), weights_only=True, map_location="cpu")


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
