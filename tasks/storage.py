"""Reading and writing through fsspec, so s3://, file:// and plain paths behave alike.

Outputs are written under a prefix that the user chose; `child_url` keeps every name the
project derives (run names, file names) inside it.
"""

from __future__ import annotations

import asyncio
import io
import json
import posixpath
import re
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import fsspec
import torch
from fsspec import AbstractFileSystem
from fsspec.asyn import AsyncFileSystem, _run_coros_in_chunks, sync

# Failures that come back the same on every attempt: retrying them only delays the message.
PERMANENT_FETCH_ERRORS = (FileNotFoundError, PermissionError)
FETCH_BACKOFF_S = 0.2


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


def is_s3(url: str) -> bool:
    return url.startswith(("s3://", "s3a://"))


def object_read_options(url: str, storage_options: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """`storage_options` for reading whole objects, `concurrency` at a time, one GET each.

    For S3, `max_concurrency=1` stops s3fs's `_cat_file` from sending a HEAD to size the
    object before its GET (it splits big objects into ranged GETs otherwise), and botocore's
    connection pool (10 by default) is raised to `concurrency`, which it would silently cap.
    Anything already in `config_kwargs` (retries, timeouts) is kept.

    >>> object_read_options("s3://b/p", {"config_kwargs": {"retries": {"max_attempts": 2}}}, 32)
    {'config_kwargs': {'retries': {'max_attempts': 2}, 'max_pool_connections': 32}, 'max_concurrency': 1}
    """
    if not is_s3(url):
        return dict(storage_options)
    config = dict(storage_options.get("config_kwargs") or {})
    config["max_pool_connections"] = max(config.get("max_pool_connections", 0), concurrency)
    return {**storage_options, "config_kwargs": config, "max_concurrency": 1}


def fetch_objects(
    fs: AbstractFileSystem,
    paths: Sequence[str],
    batch_size: int,
    attempts: int = 1,
    timeout_s: float | None = None,
) -> dict[str, bytes | Exception]:
    """The bytes of each of `paths`, fetched `batch_size` at a time: `{path: bytes or error}`.

    Paths are exact: fsspec's `cat` of a list expands keys holding `[`, `*` or `?` as glob
    patterns (DESIGN 9), so an image named `x[1].jpg` would vanish or come back as `x1.jpg`.
    Failures other than missing or forbidden objects are retried `attempts` times in all,
    with exponential backoff. Everything, retries included, ends within `timeout_s`: paths
    still unfetched then map to a TimeoutError.

    Args:
        fs: the filesystem; an async one (s3fs) fetches on its event loop, a sync one in threads.
        paths: paths inside `fs`, without protocol; duplicates are fetched once.
        batch_size: fetches in flight at once.
        attempts: tries per path, the first included.
        timeout_s: limit for the whole call; None waits as long as the fetches take.

    >>> import fsspec
    >>> fs = fsspec.filesystem("memory")
    >>> fs.pipe({"/d/x[1].jpg": b"one", "/d/x1.jpg": b"other"})
    >>> fetch_objects(fs, ["/d/x[1].jpg"], batch_size=4)
    {'/d/x[1].jpg': b'one'}
    """
    if attempts < 1 or batch_size < 1:
        raise ValueError(
            f"fetch_objects got attempts={attempts} and batch_size={batch_size}; both must be "
            "at least 1."
        )
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    results: dict[str, bytes | Exception] = {}
    pending = list(dict.fromkeys(paths))
    for attempt in range(attempts):
        if attempt and not _sleep_before(deadline, FETCH_BACKOFF_S * 2 ** (attempt - 1)):
            break
        results.update(_fetch_once(fs, pending, batch_size, deadline))
        pending = [path for path in pending if _worth_retrying(results[path])]
        if not pending or _passed(deadline):
            break
    if _passed(deadline):
        for path in pending:
            results[path] = _timed_out(timeout_s, results[path])
    return results


def _passed(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _sleep_before(deadline: float | None, seconds: float) -> bool:
    """Sleep `seconds`, or until the deadline; False when the deadline leaves no time."""
    left = seconds if deadline is None else min(seconds, deadline - time.monotonic())
    if left <= 0:
        return False
    time.sleep(left)
    return not _passed(deadline)


def _worth_retrying(result: bytes | Exception) -> bool:
    return isinstance(result, Exception) and not isinstance(result, PERMANENT_FETCH_ERRORS)


def _timed_out(timeout_s: float | None, last: Exception) -> TimeoutError:
    return TimeoutError(f"not fetched within the {timeout_s:g} s limit (last try: {last!r})")


def _fetch_once(
    fs: AbstractFileSystem, paths: list[str], batch_size: int, deadline: float | None
) -> dict[str, bytes | Exception]:
    if isinstance(fs, AsyncFileSystem):
        return sync(fs.loop, _cat_on_loop, fs, paths, batch_size, deadline)
    return _cat_in_threads(fs, paths, batch_size, deadline)


async def _cat_on_loop(
    fs: AsyncFileSystem, paths: list[str], batch_size: int, deadline: float | None
) -> dict[str, bytes | Exception]:
    async def cat(path: str) -> bytes:
        if deadline is None:
            return await fs._cat_file(path)
        return await asyncio.wait_for(fs._cat_file(path), deadline - time.monotonic())

    results = await _run_coros_in_chunks(
        [cat(path) for path in paths], batch_size=batch_size, return_exceptions=True, nofiles=True
    )
    return dict(zip(paths, results))


def _cat_in_threads(
    fs: AbstractFileSystem, paths: list[str], batch_size: int, deadline: float | None
) -> dict[str, bytes | Exception]:
    # A thread cannot be stopped: past the deadline it is left to finish on its own.
    pool = ThreadPoolExecutor(max_workers=max(1, min(batch_size, len(paths))))
    futures = {path: pool.submit(fs.cat_file, path) for path in paths}
    wait(futures.values(), timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
    pool.shutdown(wait=False, cancel_futures=True)
    return {path: _outcome(future) for path, future in futures.items()}


def _outcome(future: Future) -> bytes | Exception:
    if not future.done():
        return TimeoutError("still fetching")
    error = future.exception()
    return error if error is not None else future.result()
