"""Listing an S3 image folder through obstore: each class folder at once, pages parsed in Rust.

s3fs spends about 74 us of one thread's CPU per listed key (botocore's XML parsing and
s3fs's info dicts), so 100k keys cost 7.4 s however many folders are listed at once
(bench/RESULTS.md, "Listing"). obstore parses pages in Rust, outside the GIL.

It must return exactly what `fs.find(root, detail=True)` gives (`list_folder`'s contract),
and obstore sees keys differently in two ways, both handled by giving the folder back to
s3fs rather than guessing:

- a key it cannot name (a `.` or `..` segment, an empty segment as in `a//b.jpg`) fails the
  whole listing with InvalidPathError, where s3fs lists it;
- a folder marker (`cls/`, the key the S3 console writes for "Create folder") comes back
  without its slash, where s3fs lists it as the file `cls/`. A folder's own marker is the
  one key equal to the prefix being listed, so its slash is put back; any other zero-byte
  key inside a folder may be a file or a deeper folder's marker, and only s3fs can tell.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import obstore
from fsspec import AbstractFileSystem
from obstore.exceptions import BaseError as ObstoreError

from prefect_ddp.tasks.data.object_reads import obstore_store

if TYPE_CHECKING:
    from obstore import ObjectMeta  # a TypedDict of obstore's stubs, not importable at runtime

logger = logging.getLogger(__name__)


class AskS3fs(Exception):
    """This listing (or folder) is one obstore cannot give exactly as s3fs does."""


def list_with_obstore(fs: AbstractFileSystem, root: str, concurrency: int,
                      versions: dict[str, str] | None = None) -> dict[str, int] | None:
    """`{path relative to root: size}` for every object below `root` (bucket/prefix, as s3fs
    names it), each first-level folder listed in its own thread; None where obstore cannot
    serve `fs` at all. Folders obstore cannot list exactly are listed by s3fs. `versions`, when
    given, receives each object's version (`object_version`) under the same path."""
    bucket, _, prefix = root.partition("/")
    store = obstore_store(fs, bucket)
    if store is None:
        return None
    try:
        top = obstore.list_with_delimiter(store, prefix or None)
        sizes = exact_sizes(prefix, top["objects"], versions=versions)
    except (AskS3fs, ObstoreError) as exc:
        logger.info("Listing s3://%s with s3fs: %s", root, exc)
        return None
    folders = [folder for folder in top["common_prefixes"] if folder != prefix]
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="listing") as threads:
        for listed in threads.map(lambda folder: folder_sizes(fs, store, bucket, prefix, folder, versions), folders):
            sizes.update(listed)
    return sizes


def folder_sizes(fs: AbstractFileSystem, store: Any, bucket: str, root_prefix: str, folder: str,
                 versions: dict[str, str] | None = None) -> dict[str, int]:
    """One first-level folder's objects, relative to the root; by s3fs where obstore cannot."""
    try:
        return exact_sizes(root_prefix, obstore.list(store, folder).collect(), folder, versions)
    except (AskS3fs, ObstoreError) as exc:
        logger.info("Listing s3://%s/%s with s3fs: %s", bucket, folder, exc)
        return relative_sizes(f"{bucket}/{root_prefix}".rstrip("/"), fs.find(f"{bucket}/{folder}", detail=True),
                              versions)


def object_version(info: Mapping[str, Any]) -> str:
    """What changes when an object is rewritten: its ETag on S3 (s3fs's `ETag`, obstore's `e_tag`),
    else its modification time (a local file's `mtime`, obstore's `last_modified`); "" unknown."""
    version = info.get("ETag") or info.get("e_tag") or info.get("mtime") or info.get("last_modified")
    return str(version) if version else ""


def relative_sizes(root: str, found: dict[str, dict[str, Any]],
                   versions: dict[str, str] | None = None) -> dict[str, int]:
    """Files of a `find(root, detail=True)` answer as `{path relative to root: size}`; their versions
    (`object_version`) into `versions` when given."""
    prefix = root + "/"
    files = {path[len(prefix):]: info for path, info in found.items()
             if path.startswith(prefix) and info.get("type") != "directory"}
    if versions is not None:
        versions.update({path: object_version(info) for path, info in files.items()})
    return {path: int(info.get("size") or 0) for path, info in files.items()}


def exact_sizes(root_prefix: str, objects: Sequence[ObjectMeta], folder: str | None = None,
                versions: dict[str, str] | None = None) -> dict[str, int]:
    """Objects of the root's first level (`folder` None) or of one folder, as
    `{path relative to root: size}`, markers named as s3fs names them; AskS3fs where a
    zero-byte key inside a folder could be a file or another folder's marker."""
    start = len(root_prefix) + 1 if root_prefix else 0
    sizes = {}
    for meta in objects:
        path, size = meta["path"], int(meta["size"])
        if folder is None and root_prefix and path == root_prefix:
            key = ""  # the root's own marker (`root/`): s3fs lists it, relative to itself
        elif path == folder:
            key = path[start:] + "/"  # the folder's own marker, its slash put back
        elif folder is not None and size == 0:
            raise AskS3fs(f"{path!r} is empty: a file, or a folder marker obstore shows without its slash")
        else:
            key = path[start:]
        sizes[key] = size
        if versions is not None:
            versions[key] = object_version(meta)
    return sizes
