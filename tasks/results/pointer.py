"""A small JSON document changed by compare-and-swap: read, decide, write only if unchanged.

Several writers deciding on one document (two runs of a deployment promoting their models
at once) must not both win: each reads the document, decides what it should become, and
writes that only if nobody wrote it in between; whoever was overtaken reads again and
decides again. On S3 the condition is the object's ETag (a conditional PUT: `If-Match`,
or `If-None-Match: *` while there is none, answered 412 when it no longer holds); in a
local folder, an exclusive lock on a file beside the document, held from the read to the
rename that replaces it.

    >>> import tempfile
    >>> url = tempfile.mkdtemp() + "/latest.json"
    >>> update_json(url, {}, lambda current: {"n": 1} if current is None else None)
    (None, {'n': 1})
    >>> update_json(url, {}, lambda current: {"n": current["n"] + 1})
    ({'n': 1}, {'n': 2})
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fsspec.asyn import sync

from prefect_ddp.tasks.data.storage import filesystem, garbled_text, write_bytes
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.urls import is_local_url, is_s3

Document = dict[str, Any]
# Who loses a race reads and decides again; this many overtakings in a row is no race.
MAX_ROUNDS = 20
LOST_RACE_CODES = {"PreconditionFailed", "ConditionalRequestConflict"}


class PointerConflict(RuntimeError):
    """The document kept changing under this writer."""


def read_json_document(url: str, storage_options: dict[str, Any]) -> Document | None:
    """The document as it is now, or None when there is none."""
    return _read_s3(url, storage_options)[0] if is_s3(url) else _read_local(url)


def update_json(url: str, storage_options: dict[str, Any],
                change: Callable[[Document | None], Document | None]) -> tuple[Document | None, Document | None]:
    """Apply `change` to the document at `url` atomically; returns (what it saw, what it wrote).

    `change(current)` gets the document (None when there is none) and returns the new one,
    or None to leave it as it is; it may run several times (once per lost race), so it
    must not act on anything but its return value. Raises PointerConflict after
    MAX_ROUNDS lost races, and ValueError for storage that offers no atomic swap.
    """
    if is_s3(url):
        return _update_s3(url, storage_options, change)
    if not is_local_url(url):
        raise ValueError(
            f"{url!r} is neither on S3 nor a local folder; a kept model's pointer needs one of them "
            "(S3's conditional writes, or a lock file). Use an s3:// or local output.url."
        )
    return _update_local(url, change)


def _local_path(url: str) -> str:
    return url.removeprefix("file://")


def _read_local(url: str) -> Document | None:
    try:
        with open(_local_path(url), "rb") as file:
            return _decoded(url, file.read())
    except FileNotFoundError:
        return None


@contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock on `path`.lock, held by this process for the block."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _update_local(url: str, change: Callable[[Document | None], Document | None]) -> tuple[Document | None, Document | None]:
    path = _local_path(url)
    with _locked(path):
        current = _read_local(url)
        new = change(current)
        if new is not None:
            write_bytes(path, _encode(new), {})  # a temporary sibling renamed over the document
        return current, new


def _encode(document: Document) -> bytes:
    return json.dumps(document, indent=2, sort_keys=True).encode()


def _bucket_key(url: str, storage_options: dict[str, Any]):
    fs, path = filesystem(url, storage_options)
    bucket, _, key = path.partition("/")
    return fs, bucket, key


def _read_s3(url: str, storage_options: dict[str, Any]) -> tuple[Document | None, str | None]:
    """(document, its ETag), from one GET, so the two always belong together."""
    data, etag = _get_s3(url, storage_options)
    return (None if data is None else _decoded(url, data)), etag


def _get_s3(url: str, storage_options: dict[str, Any]) -> tuple[bytes | None, str | None]:
    """(the document's bytes, its ETag); (None, None) when there is none."""
    fs, bucket, key = _bucket_key(url, storage_options)

    async def get() -> tuple[bytes, str]:
        response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        return await response["Body"].read(), response["ETag"]

    try:
        return sync(fs.loop, get)
    except FileNotFoundError:
        return None, None


def _decoded(url: str, data: bytes) -> Document | None:
    """The document in `data`; None, said, when it cannot be read (cut short or garbled): as if
    there were none, so that the next write replaces it instead of every reader failing on it."""
    try:
        document = json.loads(data)
        if not isinstance(document, dict):
            raise ValueError(f"not a JSON object: {type(document).__name__}")
    except ValueError as error:
        run_logger().warning("%s cannot be read (%s): taken as absent, and the next write replaces it. A pointer "
                             "to a kept model names its version folder; the folders are still there.",
                             url, garbled_text(error))
        return None
    return document


def _update_s3(url: str, storage_options: dict[str, Any],
               change: Callable[[Document | None], Document | None]) -> tuple[Document | None, Document | None]:
    fs, bucket, key = _bucket_key(url, storage_options)
    replaced: Document | None = None  # what this writer's last PUT, kept short by the store, replaced
    for _ in range(MAX_ROUNDS):
        current, etag = _read_s3(url, storage_options)
        if current is None and etag and replaced is not None:  # our own write, cut: decide against what it replaced
            current = replaced
        new = change(current)
        if new is None:
            return current, None
        condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        try:
            fs.call_s3("put_object", Bucket=bucket, Key=key, Body=_encode(new),
                       ContentType="application/json", **condition)
        except OSError as error:
            if not _lost_race(error):
                raise
            if _landed(url, storage_options, new):
                return current, new
            continue
        if _landed(url, storage_options, new):
            return current, new
        replaced = current  # a store may keep part of it and answer 200, or a rival wrote since
    raise PointerConflict(
        f"{url} changed {MAX_ROUNDS} times while this run tried to update it; another writer keeps "
        "overtaking it, or the store does not keep what is written there. Retry later."
    )


def _landed(url: str, storage_options: dict[str, Any], written: Document) -> bool:
    """Whether the document is now `written`: a lost race that this writer itself won.

    A PUT whose reply is lost (the connection dropped after S3 stored it) is sent again by
    botocore, and S3 answers the repeat 412: the condition no longer holds, because the first
    PUT changed the document. Taken for a rival's write, a promotion decided again against its
    own new pointer and removed the version it had just kept (issue 46)."""
    return _get_s3(url, storage_options)[0] == _encode(written)


def _lost_race(error: OSError) -> bool:
    """Whether S3 refused the write because the document changed since it was read."""
    cause = error.__cause__
    code = getattr(cause, "response", {}).get("Error", {}).get("Code")
    return code in LOST_RACE_CODES
