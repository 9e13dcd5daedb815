"""Reading and writing through fsspec, so s3://, file:// and plain paths behave alike.

Outputs are written under a prefix that the user chose; `child_url` keeps every name the
project derives (run names, file names) inside it.
"""

from __future__ import annotations

import io
import json
import posixpath
import re
import uuid
from typing import Any

import fsspec
import torch
from fsspec import AbstractFileSystem


def filesystem(url: str, storage_options: dict[str, Any]) -> tuple[AbstractFileSystem, str]:
    """Return the filesystem for `url` and the path inside it, without a trailing slash."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    return fs, path.rstrip("/")


def child_url(base: str, *parts: str) -> str:
    """Join `parts` below `base`, refusing any part that would step outside of it.

    Args:
        base: the output prefix the user chose.
        parts: single path segments (run names, file names).

    >>> child_url("s3://b/out", "run-1", "model.pt")
    's3://b/out/run-1/model.pt'
    """
    for part in parts:
        if not part or part in (".", "..") or "/" in part or "\\" in part or "\x00" in part:
            raise ValueError(
                f"Path segment {part!r} is not allowed below {base!r}: use a plain name "
                "without '/', '\\\\', '.' or '..'."
            )
    return posixpath.join(base.rstrip("/"), *parts)


def safe_segment(name: str) -> str:
    """`name` as one harmless path segment: a flow run renamed 'a/../b' becomes 'a-..-b'."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-")
    return cleaned or "run"


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
    fs.pipe_file(tmp, data)
    fs.mv(tmp, path)


def read_bytes(url: str, storage_options: dict[str, Any]) -> bytes:
    fs, path = filesystem(url, storage_options)
    return fs.cat_file(path)


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
    return fs.exists(path)
