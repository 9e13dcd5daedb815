"""Whole-object reads of images: one GET each, a batch at a time, with retries and a deadline.

Where the source is S3 the GETs of a loader process go through obstore: bench/s3_clients.py
measured them at 0.14-0.22 ms of CPU each against s3fs's 1.1-1.5 ms (bench/RESULTS.md).
obstore does not survive fork, so it starts only where no loader process is forked after it
(`fetch_objects`); any other process reads through s3fs.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from datetime import datetime, timedelta, timezone
from itertools import islice
from typing import Any, NamedTuple

import botocore.session
import obstore
from fsspec import AbstractFileSystem
from fsspec.asyn import AsyncFileSystem, _run_coros_in_chunks, sync
from obstore.exceptions import PermissionDeniedError, UnauthenticatedError
from obstore.store import S3Store
from s3fs import S3FileSystem
from torch.utils.data import get_worker_info

from prefect_ddp.tasks.urls import is_s3

# Failures that come back the same on every attempt: retrying them only delays the message.
PERMANENT_FETCH_ERRORS = (FileNotFoundError, PermissionError)
FETCH_BACKOFF_S = 0.2

# obstore, per request: botocore's default attempts (its legacy mode: 5, the first included)
# where the options name none, as s3fs got them; its read timeout (60 s of silence); and no
# overall limit of its own (its default, 30 s, would cut a slow GET that fetch_timeout_s
# allows: fetch_objects' deadline bounds every call instead).
DEFAULT_REQUEST_ATTEMPTS = 5
OBSTORE_READ_TIMEOUT = timedelta(seconds=60)
OBSTORE_REQUEST_TIMEOUT = timedelta(days=1)
CREDENTIALS_TTL = timedelta(minutes=5)  # botocore renews credentials 10-15 minutes before they expire
# Worker threads of obstore's runtime (tokio's, TOKIO_WORKER_THREADS) in each process that reads with it,
# where the environment names none. Tokio's default is a thread per CPU the process may run on: each
# loader process of a 384-CPU host started 384, some 200,000 on an 8-GPU host. Its GETs wait on the
# network, at 0.14-0.28 ms of CPU each (bench/RESULTS.md): a loader process's few hundred a second
# leave two threads mostly idle.
OBSTORE_RUNTIME_THREADS = 2
# The s3fs options obstore can honour (what Location.storage_options and
# object_read_options produce); any other keeps the reads on s3fs.
OBSTORE_OPTIONS = {"anon", "key", "secret", "token", "endpoint_url", "client_kwargs", "config_kwargs", "max_concurrency"}
OBSTORE_CLIENT_KWARGS = {"region_name", "endpoint_url"}
OBSTORE_CONFIG_KWARGS = {"retries", "max_pool_connections"}
OBSTORE_RETRIES = {"total_max_attempts", "max_attempts"}

logger = logging.getLogger(__name__)
_stores: dict[tuple[str, str, timedelta], S3Store] = {}  # (options as JSON, bucket, request timeout) -> store
_stores_lock = threading.Lock()
# The process that started obstore's runtime (tokio's), inherited by forked children.
_runtime_pid: int | None = None


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
    forks_no_loaders: bool = False,
) -> dict[str, bytes | Exception]:
    """The bytes of each of `paths`, fetched `batch_size` at a time: `{path: bytes or error}`.

    One GET per object, never a HEAD. On S3 the GETs are obstore's (5-9x less CPU than
    s3fs's, bench/RESULTS.md) wherever `obstore_settings` can express `fs`'s options;
    otherwise, and on every other filesystem, fsspec's. Paths are exact: fsspec's `cat` of
    a list expands keys holding `[`, `*` or `?` as glob patterns (docs/architecture.md,
    "Facts: storage clients"), so an image named `x[1].jpg` would vanish or come back as
    `x1.jpg`. Failures other than missing or forbidden objects are retried `attempts` times
    in all, with exponential backoff. Everything, retries included, ends within `timeout_s`:
    paths still unfetched then map to a TimeoutError.

    obstore's runtime does not survive fork (tokio-rs/tokio#4301): a process forked after
    its parent started it would hang in its first GET, so such a process reads with s3fs (and
    says so once in its log), at 5-9x the CPU per GET. So obstore starts only in a process no
    loader process is forked from afterwards: a DataLoader worker process, or a caller that
    says so (`forks_no_loaders`). Any other reads with s3fs: a Dask worker's rank, which forks
    its loaders after reading its own images, a champion's or a shard's in one run and the next
    run's loaders on the same warm worker (bench/RESULTS.md, "A read outside the loaders"). So
    does a rank with no loader processes, at about 1 ms more of its core per image: through
    obstore, it would leave every later gang's loaders on its worker reading with s3fs.

    Args:
        fs: the filesystem: obstore's GETs and a sync filesystem's reads run on this process's read
            threads (`_read_pool`), s3fs's on its event loop.
        paths: paths inside `fs`, without protocol; duplicates are fetched once.
        batch_size: fetches in flight at once.
        attempts: tries per path, the first included.
        timeout_s: limit for the whole call; None waits as long as the fetches take.
        forks_no_loaders: this process forks no DataLoader worker after this call, so obstore
            may serve it here (a benchmark, a test); a DataLoader worker process needs no saying.

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
    read = _reader(fs, forks_no_loaders or get_worker_info() is not None, timeout_s)
    results: dict[str, bytes | Exception] = {}
    pending = list(dict.fromkeys(paths))
    for attempt in range(attempts):
        if attempt and not _sleep_before(deadline, FETCH_BACKOFF_S * 2 ** (attempt - 1)):
            break
        results.update(_fetch_once(fs, read, pending, batch_size, deadline))
        pending = [path for path in pending if _worth_retrying(results[path])]
        if not pending or _passed(deadline):
            break
    if _passed(deadline):
        for path in pending:
            last = results[path]
            assert isinstance(last, Exception)  # pending keeps only paths whose last try failed
            results[path] = _timed_out(timeout_s, last)
    return results


def obstore_settings(storage_options: dict[str, Any]) -> dict[str, Any] | None:
    """`S3Store` arguments (all but the bucket) that read as s3fs does with `storage_options`.

    endpoint_url (plain http allowed for an http endpoint); the region (client_kwargs'
    region_name, else the one botocore is configured with); credentials: key, secret and
    token, `anon` as unsigned requests, none given as botocore's chain (environment,
    ~/.aws, instance role), the same that s3fs would find; attempts per request
    (config_kwargs' retries, else `DEFAULT_REQUEST_ATTEMPTS`). Returns None, leaving the
    reads to s3fs, for options outside these; for an AWS bucket of no known region (botocore
    finds that by following S3's redirect, obstore must be told); and where no credentials
    are given or found (s3fs then says so as before).

    >>> sorted(obstore_settings({"endpoint_url": "http://127.0.0.1:9000", "anon": True}))
    ['client_options', 'config', 'credential_provider', 'retry_config']
    >>> obstore_settings({"endpoint_url": "http://127.0.0.1:9000", "profile": "dev"}) is None
    True
    """
    client_kwargs = storage_options.get("client_kwargs") or {}
    config_kwargs = storage_options.get("config_kwargs") or {}
    retries = config_kwargs.get("retries") or {}
    if (set(storage_options) - OBSTORE_OPTIONS or set(client_kwargs) - OBSTORE_CLIENT_KWARGS
            or set(config_kwargs) - OBSTORE_CONFIG_KWARGS or set(retries) - OBSTORE_RETRIES):
        return None
    session = botocore.session.get_session()
    endpoint = storage_options.get("endpoint_url") or client_kwargs.get("endpoint_url")
    region = client_kwargs.get("region_name") or session.get_config_variable("region")
    anonymous = bool(storage_options.get("anon"))
    credentials = None if anonymous else _credential_provider(storage_options, session)
    if (endpoint is None and region is None) or (credentials is None and not anonymous):
        return None
    config: dict[str, Any] = {"skip_signature": anonymous}
    if endpoint:
        config["endpoint"] = endpoint
    if region:
        config["region"] = region
    attempts = retries.get("total_max_attempts") or retries.get("max_attempts", DEFAULT_REQUEST_ATTEMPTS - 1) + 1
    return {
        "config": config,
        "client_options": {"allow_http": endpoint is not None and endpoint.startswith("http://"),
                           "read_timeout": OBSTORE_READ_TIMEOUT, "timeout": OBSTORE_REQUEST_TIMEOUT},
        "retry_config": {"max_retries": attempts - 1},
        "credential_provider": credentials,
    }


def _credential_provider(
    storage_options: dict[str, Any], session: botocore.session.Session
) -> Callable[[], dict[str, Any]] | None:
    """obstore's credentials, always from a provider: given a key alone, obstore would add
    the environment's AWS_* values to it (a session token to a key that has none), where
    botocore takes the explicit key and secret as they are. None: none given or found."""
    if storage_options.get("key"):
        static = {"access_key_id": storage_options["key"], "secret_access_key": storage_options.get("secret"),
                  "token": storage_options.get("token"), "expires_at": None}
        return lambda: static
    credentials = session.get_credentials()
    if credentials is None:
        return None

    def renewed() -> dict[str, Any]:
        frozen = credentials.get_frozen_credentials()  # renews them when they near their expiry
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                "token": frozen.token, "expires_at": datetime.now(timezone.utc) + CREDENTIALS_TTL}

    return renewed


@functools.lru_cache(maxsize=64)
def _settings(options_json: str) -> dict[str, Any] | None:
    """`obstore_settings`, once per process and options: looking up credentials takes a while."""
    return obstore_settings(json.loads(options_json))


def _reader(fs: AbstractFileSystem, obstore_may_start: bool, timeout_s: float | None) -> Read:
    """How `_fetch_once` reads one path of `fs`: obstore's blocking GET, run on this process's
    read threads, where it may start here; s3fs's on its event loop; `cat_file` in threads for
    a filesystem that is not async.

    obstore's blocking API from threads costs less CPU per GET than its async one driven by
    fsspec's event loop: 0.28 against 0.45-0.52 ms here (bench/RESULTS.md, "A loader process's
    CPU beyond the transform"), each wake-up of the loop being a Python round trip."""
    if not isinstance(fs, AsyncFileSystem):
        return Read(threaded=fs.cat_file)
    options_json = _obstore_options(fs) if obstore_may_start else None
    if options_json is None:
        return Read(on_loop=fs._cat_file)
    timeout = OBSTORE_REQUEST_TIMEOUT if timeout_s is None else timedelta(seconds=timeout_s)

    def read(path: str) -> bytes:
        bucket, _, key = fs._strip_protocol(path).partition("/")
        if not _obstore_can_name(key):
            cat: bytes = fs.cat_file(path)
            return cat
        try:
            return bytes(obstore.get(_store(options_json, bucket, timeout), key).bytes())
        except (PermissionDeniedError, UnauthenticatedError) as exc:  # as s3fs maps a 403
            raise PermissionError(str(exc)) from exc

    return Read(threaded=read)


def obstore_store(fs: AbstractFileSystem, bucket: str) -> S3Store | None:
    """obstore's store for `bucket`, reading as `fs` reads; None where s3fs must serve: not
    S3, options obstore cannot honour, or a process forked after obstore started. For the
    flow's listing, in the flow's own process, which forks no loaders: its ranks run on the
    cluster's workers (`fetch_objects` says why that matters)."""
    options_json = _obstore_options(fs)
    return None if options_json is None else _store(options_json, bucket)


def _obstore_options(fs: AbstractFileSystem) -> str | None:
    """`fs`'s options as the key of `_store`'s cache, where obstore can serve them; else None."""
    if not isinstance(fs, S3FileSystem) or not _obstore_runs_here():
        return None
    options_json = json.dumps(fs.storage_options, sort_keys=True, default=repr)
    return options_json if _settings(options_json) is not None else None


def _obstore_runs_here() -> bool:
    """False in a process forked after its parent started obstore's runtime, which hangs there."""
    if _runtime_pid in (None, os.getpid()):
        return True
    _log_inherited_runtime()
    return False


@functools.cache
def _log_inherited_runtime() -> None:
    logger.info(
        "Process %d was forked after its parent (%d) started obstore, whose runtime does not "
        "survive fork (tokio-rs/tokio#4301): it reads S3 with s3fs, at about 1 ms more CPU per "
        "GET. Fork DataLoader workers before the parent reads S3, or start them with "
        "'forkserver'.", os.getpid(), _runtime_pid,
    )


def _obstore_can_name(key: str) -> bool:
    """Whether obstore addresses `key` as it is: it drops empty segments ('a//b', a leading
    or trailing '/') and refuses '.', '..' and control characters."""
    return all(
        segment and segment not in (".", "..") and not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in segment)
        for segment in key.split("/")
    )


def _store(options_json: str, bucket: str, timeout: timedelta = OBSTORE_REQUEST_TIMEOUT) -> S3Store:
    """This process's store for `bucket` with these options, each request ended by obstore after
    `timeout`, made on first use.

    Made lazily, in the process that uses it: a store made before a fork is no use after it.
    """
    global _runtime_pid
    with _stores_lock:
        if (options_json, bucket, timeout) not in _stores:
            settings = _settings(options_json)
            assert settings is not None  # options_json comes from _obstore_options, which checked it
            os.environ.setdefault("TOKIO_WORKER_THREADS", str(OBSTORE_RUNTIME_THREADS))  # read as the runtime starts
            client_options = {**settings["client_options"], "timeout": timeout}
            _stores[options_json, bucket, timeout] = S3Store(bucket, **{**settings, "client_options": client_options})
            _runtime_pid = os.getpid()
        return _stores[options_json, bucket, timeout]


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


class Read(NamedTuple):
    """One path's read: a coroutine function for `fs`'s event loop, or a blocking one for threads."""

    on_loop: Callable[[str], Awaitable[bytes]] | None = None
    threaded: Callable[[str], bytes] | None = None


def _fetch_once(
    fs: AbstractFileSystem, read: Read, paths: list[str], batch_size: int, deadline: float | None,
) -> dict[str, bytes | Exception]:
    if read.on_loop is not None:
        fetched: dict[str, bytes | Exception] = sync(fs.loop, _read_on_loop, read.on_loop, paths, batch_size, deadline)
        return fetched
    assert read.threaded is not None  # a Read holds one or the other (`_reader`)
    return _read_in_threads(read.threaded, paths, batch_size, deadline)


async def _read_on_loop(
    read: Callable[[str], Awaitable[bytes]], paths: list[str], batch_size: int, deadline: float | None
) -> dict[str, bytes | Exception]:
    async def one(path: str) -> bytes:
        if deadline is None:
            return await read(path)
        return await asyncio.wait_for(read(path), deadline - time.monotonic())

    results = await _run_coros_in_chunks(
        [one(path) for path in paths], batch_size=batch_size, return_exceptions=True, nofiles=True
    )
    return dict(zip(paths, results))


# Threads of a process's reads at most: they are started only as reads wait for one (each call
# keeps its own `batch_size` in flight), so this only bounds a process that is asked for more.
MAX_READ_THREADS = 1024
_read_threads: tuple[int, ThreadPoolExecutor] | None = None  # (the process that made them, the pool)


def _read_pool() -> ThreadPoolExecutor:
    """This process's read threads, shared by every call: making a pool per batch cost more CPU
    than the GETs it ran (0.70 against 0.28 ms a GET here). A forked child makes its own: the
    threads of its parent's pool do not exist in it."""
    global _read_threads
    with _stores_lock:
        if _read_threads is None or _read_threads[0] != os.getpid():
            _read_threads = (os.getpid(), ThreadPoolExecutor(MAX_READ_THREADS, thread_name_prefix="object-read"))
        return _read_threads[1]


def _read_in_threads(
    read: Callable[[str], bytes], paths: list[str], batch_size: int, deadline: float | None
) -> dict[str, bytes | Exception]:
    """`read` of each path on the process's read threads, `batch_size` in flight, until `deadline`.

    A thread cannot be stopped: a read still running at the deadline is left to finish on its
    own (its thread is not idle, so later calls start others), and paths not yet started never are."""
    pool, waiting = _read_pool(), iter(paths)
    futures: dict[str, Future[bytes]] = {}
    running: set[Future[bytes]] = set()
    while not _passed(deadline):
        for path in islice(waiting, batch_size - len(running)):
            futures[path] = pool.submit(read, path)
            running.add(futures[path])
        if not running:
            break
        left = None if deadline is None else deadline - time.monotonic()
        running = wait(running, timeout=None if left is None else max(0.0, left), return_when=FIRST_COMPLETED)[1]
    return {path: _outcome(futures[path]) if path in futures else
            TimeoutError("not started before the time limit: the fetches before it took it all") for path in paths}


def _outcome(future: Future[bytes]) -> bytes | Exception:
    """The bytes or the fetch's error; `result()` raises anything that is not an Exception
    (a KeyboardInterrupt or SystemExit in the thread) rather than returning it as an answer.
    A fetch still running at the deadline timed out."""
    if not future.done():
        return TimeoutError("still fetching")
    error = future.exception()
    return error if isinstance(error, Exception) else future.result()
