"""Check the data before any rank starts: the source answers, and the images decode.

Decoding is the slow part, so it is cut into chunks mapped over the Dask workers rather
than done by the flow's process. Images that fail to decode or are missing are reported
and left out of the manifest, so they never reach training; when more than
`data.max_unreadable_fraction` of them are, the run stops instead. A failed fetch
(throttling, a dropped connection) is retried, never taken for a corrupt image. Images it
did not check (`data.validate_sample`) or that change later are left out by training when
it meets them, and counted with these (prefect_ddp.tasks.training.unreadable).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fsspec import AbstractFileSystem
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.futures import wait
from prefect_dask import DaskTaskRunner
from prefect_dask.task_runners import PrefectDaskFuture

from prefect_ddp.tasks.config import DataConfig
from prefect_ddp.tasks.data.check_memory import CheckMemory, DecodeResult
from prefect_ddp.tasks.data.cpu_share import map_on_cpus
from prefect_ddp.tasks.data.dataset import SHOWN_KEYS, FetchTimeout
from prefect_ddp.tasks.data.decoding import decode_upright
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.object_reads import fetch_objects, object_read_options
from prefect_ddp.tasks.data.storage import filesystem
from prefect_ddp.tasks.gang import crash_unfinished_task_runs
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.reporting import markdown_table
from prefect_ddp.tasks.retries import retry_transient
from prefect_ddp.tasks.urls import is_s3

# Images per decode-check task. Each chunk decodes on every core its worker may use (decode_chunk), so a
# worker of one thread keeps its cores busy on one chunk: on 16 cores, 16 images a thread.
CHUNK_SIZE = 256
FETCH_CONCURRENCY = 32
FETCH_ATTEMPTS = 4
DEFAULT_MAX_UNREADABLE = DataConfig.model_fields["max_unreadable_fraction"].default
LOST_CHUNK = "Its Dask workers died while running it and Dask stopped rerunning it (KilledWorker)."


@task(name="validate-source", retries=1, retry_delay_seconds=[5], retry_condition_fn=retry_transient)
def validate_source(location: Location) -> None:
    """Fail early, with a message a person can act on, when the url cannot be read.

    One Prefect retry, 5 s later, not more: botocore already retries each request (5
    attempts over 8 s on average, 15 s at most, by default), so an unreachable endpoint
    fails within about 20 s (35 s at worst), where three retries after 2, 10 and 30 s
    took over a minute.
    """
    try:
        fs, root = filesystem(location.url, location.storage_options())
        # As it is now: fsspec reuses one s3fs per set of options in a process, and s3fs answers
        # `exists` from a listing of a parent it made before (a prefix uploaded since then is
        # "empty"; docs/architecture.md, "Facts: storage clients").
        fs.invalidate_cache(root)
        if fs.exists(root) and fs.ls(root, detail=False):
            return
        empty = _empty_source_error(fs, location)
    except PermissionError as exc:
        raise PermissionError(
            f"Access to {location.url!r} was denied ({exc}). Check the credentials of "
            f"{_block_name(location)}, or set anonymous=true for a public bucket."
        ) from exc
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"{location.url!r} does not exist ({exc}). Check the bucket and prefix."
        ) from exc
    except Exception as exc:  # network trouble (botocore's are not OSErrors): worth retrying
        raise ConnectionError(
            f"Cannot reach {location.url!r} ({exc!r}). Check endpoint_url "
            f"({location.endpoint_url or 'AWS default'}), region and the network."
        ) from exc
    raise empty


def _empty_source_error(fs: AbstractFileSystem, location: Location) -> FileNotFoundError:
    """Why `location` holds nothing: its bucket is not there, or the prefix (or local folder) is empty."""
    bucket = location.url.split("://", 1)[1].split("/", 1)[0] if is_s3(location.url) else None
    if bucket and not fs.exists(bucket):  # s3fs answers False, never raises, here
        return FileNotFoundError(
            f"Bucket {bucket!r} of {location.url!r} was not found at "
            f"{location.endpoint_url or 'AWS'}. Check the bucket name in the url, or the "
            f"endpoint_url of {_block_name(location)}."
        )
    return FileNotFoundError(
        f"{location.url!r} is empty or does not exist: expected an image folder "
        "URL/CLASS/IMAGE.jpg. Check the prefix."
    )


def _block_name(location: Location) -> str:
    name = getattr(location, "_block_document_name", None)
    which = f"data-location block {name!r}" if name else "the data-location block"
    key = f" (aws_access_key_id {location.aws_access_key_id!r})" if location.aws_access_key_id else ""
    return which + key


# decode-check asks `open_rgb` for the smallest decode: a JPEG at 1/8 of its sides, for which
# libjpeg still reads and entropy-decodes every byte, so a truncated or corrupt file fails as
# it would at any size training decodes it.
CHECK_SIDE = 1

Chunk = TypeVar("Chunk")


def decode_check(data: bytes) -> tuple[int, int]:
    """Decode an image as training will (`open_rgb`, to 8-bit RGB); return its stored (w, h), upright."""
    return decode_upright(data, CHECK_SIDE)[1]


def decode_result(position: int, data: bytes | FileNotFoundError) -> DecodeResult:
    """What training would get from these bytes: an image's size, or why it is left out."""
    if isinstance(data, FileNotFoundError):
        return _excluded(position, data)
    try:
        width, height = decode_check(data)
    except Exception as exc:  # any decoder error means: exclude this file
        return _excluded(position, exc)
    return DecodeResult(position=position, width=width, height=height)


def _excluded(position: int, error: Exception) -> DecodeResult:
    return DecodeResult(position=position, error=f"{type(error).__name__}: {error}")


@task(name="decode-check", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient)
def decode_chunk(location: Location, keys: list[str], positions: list[int]) -> list[DecodeResult]:
    """Fetch and decode one chunk of images on a Dask worker, decoding on every core the worker may
    use, not on the one thread a GPU cluster's worker has (prefect_ddp.tasks.data.cpu_share).

    Only images that fail to decode or are missing are left out. A fetch that still fails
    after retries (throttling, a reset connection) says nothing about the image, so it
    raises: Prefect retries the chunk, and if that fails too the run stops, naming it.
    """
    options = object_read_options(location.url, location.storage_options(), FETCH_CONCURRENCY)
    fs, root = filesystem(location.url, options)
    paths = [f"{root}/{key}" for key in keys]
    # Through s3fs, as every read outside a loader process: this Dask worker forks the ranks'
    # DataLoader workers later (prefect_ddp.tasks.data.object_reads.fetch_objects).
    fetched = fetch_objects(fs, paths, FETCH_CONCURRENCY, FETCH_ATTEMPTS)
    found = raise_fetch_failures(location, fetched)
    checks = [(position, found[path]) for position, path in zip(positions, paths)]
    return map_on_cpus(lambda check: decode_result(*check), checks)


def raise_fetch_failures(location: Location, fetched: dict[str, bytes | Exception],
                         timeout_s: float | None = None) -> dict[str, bytes | FileNotFoundError]:
    """Raise for images that failed for another reason than being gone: they are not known to
    be unreadable, so they are never left out; the task is retried (or fails) instead.
    Returns `fetched` with nothing else left: each image's bytes, or its FileNotFoundError."""
    found: dict[str, bytes | FileNotFoundError] = {}
    failed: dict[str, Exception] = {}
    for path, result in fetched.items():
        if isinstance(result, Exception) and not isinstance(result, FileNotFoundError):
            failed[path] = result
        else:
            found[path] = result
    if not failed:
        return found
    path, error = next(iter(failed.items()))
    if isinstance(error, PermissionError):
        raise PermissionError(
            f"Access to {len(failed)} image(s) under {location.url!r} was denied, e.g. {path} "
            f"({error}). Check the credentials of {_block_name(location)} and the objects' policy."
        )
    if timeout_s is not None and isinstance(error, TimeoutError):  # FetchTimeout: Prefect takes the builtin for its own
        raise FetchTimeout(
            f"Could not fetch {len(failed)} image(s) under {location.url!r} within {timeout_s:g} s, e.g. {path}. "
            "The storage endpoint stalled or is too slow; the task is retried."
        )
    raise ConnectionError(
        f"Could not fetch {len(failed)} of {len(fetched)} image(s) under {location.url!r} after "
        f"{FETCH_ATTEMPTS} attempts, e.g. {path}: {error!r}. They are not known to be corrupt, "
        "so they are not left out; check the storage endpoint and rerun."
    )


def sample_positions(manifest: Manifest, per_class: int | None) -> list[int]:
    """Every position, or the first `per_class` of each class (in key order)."""
    if per_class is None:
        return list(range(len(manifest)))
    taken: dict[int, int] = {}
    chosen = []
    for position, label in enumerate(manifest.labels):
        if taken.get(label, 0) < per_class:
            taken[label] = taken.get(label, 0) + 1
            chosen.append(position)
    return chosen


def chunked(items: Sequence[Chunk], size: int) -> list[list[Chunk]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def validate_dataset(
    runner: DaskTaskRunner,
    location: Location,
    manifest: Manifest,
    per_class: int | None = None,
    max_unreadable_fraction: float = DEFAULT_MAX_UNREADABLE,
    memory: CheckMemory | None = None,
) -> Manifest:
    """Decode-check images across the cluster; return the manifest without the bad ones (and without
    the listing's versions, which only this check uses).

    Images whose verdicts `memory` keeps (same key, size and version) are not checked again
    (prefect_ddp.tasks.data.check_memory). Raises ValueError, before any rank starts, when no
    image can be read or more than `max_unreadable_fraction` of those checked cannot.
    """
    positions = sample_positions(manifest, per_class)
    remembered, unknown = memory.recall(manifest, positions) if memory else ([], positions)
    chunks = chunked(unknown, CHUNK_SIZE)
    futures = [
        runner.submit(
            decode_chunk,
            parameters={
                "location": location,
                "keys": [manifest.paths[i] for i in chunk],
                "positions": chunk,
            },
        )
        for chunk in chunks
    ]
    checked = gather_chunks(futures, chunks, manifest)
    if memory:
        memory.remember(manifest, checked)
    results = remembered + checked
    bad = [r for r in results if r.error]
    good = [r for r in results if not r.error]
    clean = manifest.without({r.position for r in bad}).versionless()
    _report(manifest, clean, good, bad, len(remembered))
    check_unreadable(manifest, len(results), bad, max_unreadable_fraction)
    if bad:
        get_run_logger().warning(
            "Excluded %d unreadable image(s) of %d checked, e.g. %s",
            len(bad), len(results), manifest.paths[bad[0].position],
        )
    return clean


def gather_chunks(
    futures: list[PrefectDaskFuture[list[DecodeResult]]], chunks: list[list[int]], manifest: Manifest
) -> list[DecodeResult]:
    """Every chunk's results, once all have ended.

    Dask reruns a chunk whose worker died on another worker, under the same task run. When
    it gives up (KilledWorker: every worker that tried died), the task run would stay
    RUNNING, as its worker never reports again: it is marked Crashed and the run stops.
    """
    wait(list(futures))  # a list[PrefectFuture], the one type prefect's wait takes
    raise_if_lost(futures, chunks, lambda chunk: f"Decode-check of {len(chunk)} image(s) from {manifest.paths[chunk[0]]!r}")
    return [r for future in futures for r in future.result()]


def raise_if_lost(futures: Sequence[PrefectDaskFuture[Any]], chunks: Sequence[Chunk], what: Callable[[Chunk], str]) -> None:
    """Fail, naming the first, when Dask gave up on chunks whose workers died (KilledWorker).

    Their task runs would stay RUNNING, as their worker never reports again: they are
    marked Crashed first. `what(chunk)` says what the chunk was, e.g. "Decode-check of 256
    image(s) from 'a/1.jpg'".
    """
    lost = [(future, chunk) for future, chunk in zip(futures, chunks) if future.wrapped_future.status != "finished"]
    if not lost:
        return
    crash_unfinished_task_runs([future for future, _ in lost], LOST_CHUNK)
    future, chunk = lost[0]
    error = future.wrapped_future.exception()
    raise RuntimeError(
        f"{what(chunk)} did not finish on the Dask cluster ({type(error).__name__}: {error}); {len(lost)} chunk(s) "
        "did not. When its workers died while running it, a file that crashes the decoder or exhausts a "
        "worker's memory (a decompression bomb, a huge TIFF) is the usual cause: check the worker logs, "
        "then remove the file or give the workers more memory."
    ) from error


def check_unreadable(manifest: Manifest, checked: int, bad: list[DecodeResult], limit: float) -> None:
    """Stop before training when nothing, or too large a share of the images, can be read."""
    verdict = unreadable_verdict(manifest.root, checked, {manifest.paths[r.position]: r.error or "" for r in bad},
                                 limit, "data.max_unreadable_fraction", "train on the rest")
    if verdict:
        raise ValueError(verdict)


def unreadable_verdict(root: str, checked: int, bad: dict[str, str], limit: float, setting: str,
                       goal: str) -> str | None:
    """Why a run stops, when none or more than `limit` of the `checked` images under `root` could be read; else None.

    A few bad files are normal in a real bucket and are left out; many mean a wrong url,
    a broken export or the wrong credentials, and a model trained on the rest (or the
    predictions of the rest) would mislead. Training and batch-predict share this rule.

    Args:
        root: the folder the images are under.
        checked: the images read or tried.
        bad: {key: why it could not be read}, the first few named in the message.
        limit: the largest share of `checked` that may be bad.
        setting: the parameter holding `limit`, as the user sets it.
        goal: what raising the limit lets the run do, e.g. "train on the rest".

    >>> unreadable_verdict("s3://b/p", 10, {"a/1.jpg": "OSError"}, 0.1, "max_unreadable_fraction", "score the rest")
    >>> unreadable_verdict("s3://b/p", 10, {"a/1.jpg": "OSError", "a/2.jpg": "OSError"}, 0.1, "limit", "go")[:50]
    "2 of the 10 images checked under 's3://b/p' (20.0%"
    """
    if not bad:
        return None
    first = ", ".join(list(bad)[:SHOWN_KEYS])
    first_error = next(iter(bad.values()))
    if len(bad) == checked:
        return (
            f"None of the {checked} images checked under {root!r} could be read: all "
            f"{checked} failed to decode or are missing, e.g. {first} (first error: "
            f"{first_error}). Check that the url points at an image folder of valid images."
        )
    share = len(bad) / checked
    if share <= limit:
        return None
    return (
        f"{len(bad)} of the {checked} images checked under {root!r} ({share:.1%}) "
        f"could not be read, more than {setting}={limit:g} allows; e.g. "
        f"{first} (first error: {first_error}). Fix or remove those files, or raise "
        f"{setting} to {goal}."
    )


def _report(manifest: Manifest, clean: Manifest, good: list[DecodeResult], bad: list[DecodeResult],
            remembered: int) -> None:
    widths = [r.width for r in good] or [0]
    heights = [r.height for r in good] or [0]
    counts = clean.class_counts()
    bad_rows = [[manifest.paths[r.position], r.error] for r in bad[:50]]
    create_markdown_artifact(
        key="dataset-validation",
        description=f"Decode check of {manifest.root}",
        markdown=(
            f"# Dataset validation: `{manifest.root}`\n\n"
            f"Checked {len(good) + len(bad)} of {len(manifest)} images: {len(good)} decoded, "
            f"**{len(bad)} excluded**. {remembered} of them unchanged since a run before, whose verdicts "
            "were kept (decode-checks/ below the output).\n\n"
            f"Image sizes (w x h): min {min(widths)} x {min(heights)}, median "
            f"{statistics.median(widths):.0f} x {statistics.median(heights):.0f}, "
            f"max {max(widths)} x {max(heights)}.\n\n"
            "## Images per class (after exclusion)\n\n"
            + markdown_table(["class", "images"], [[k, v] for k, v in counts.items()])
            + ("\n## Excluded files\n\n" + markdown_table(["key", "error"], bad_rows) if bad else "")
        ),
    )
