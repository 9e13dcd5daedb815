"""Check the data before any rank starts: the source answers, and the images decode.

Decoding is the slow part, so it is cut into chunks mapped over the Dask workers rather
than done by the flow's process. Corrupt or unreadable files are reported and left out of
the manifest; they never reach training.
"""

from __future__ import annotations

import io
import statistics
from collections.abc import Sequence

from PIL import Image
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.futures import wait
from prefect_dask import DaskTaskRunner
from pydantic import BaseModel

from blocks.data_location import DataLocation
from tasks.manifest import Manifest
from tasks.reporting import markdown_table
from tasks.retries import retry_transient
from tasks.storage import filesystem

CHUNK_SIZE = 256


class DecodeResult(BaseModel):
    """What one image decoded to: its size, or why it could not be read."""

    position: int
    width: int = 0
    height: int = 0
    error: str | None = None


@task(name="validate-source", retries=3, retry_delay_seconds=[2, 10, 30], retry_condition_fn=retry_transient)
def validate_source(location: DataLocation) -> None:
    """Fail early, with a message a person can act on, when the url cannot be read."""
    try:
        fs, root = filesystem(location.url, location.storage_options())
        found = fs.exists(root) and bool(fs.ls(root, detail=False))
    except PermissionError as exc:
        raise PermissionError(
            f"Access to {location.url!r} was denied ({exc}). Check the data-location block's "
            "credentials, or set anonymous=true for a public bucket."
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
    if not found:
        raise FileNotFoundError(
            f"{location.url!r} is empty or does not exist: expected an image folder "
            "<url>/<class>/<image>.jpg."
        )


def decode_check(data: bytes) -> tuple[int, int]:
    """Fully decode an image (verify() alone misses truncated JPEGs); return (w, h)."""
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return image.size


@task(name="decode-check", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient)
def decode_chunk(location: DataLocation, keys: list[str], positions: list[int]) -> list[DecodeResult]:
    """Fetch and decode one chunk of images on a Dask worker."""
    fs, root = filesystem(location.url, location.storage_options())
    paths = [f"{root}/{key}" for key in keys]
    fetched = fs.cat(paths, on_error="return")
    results = []
    for position, path in zip(positions, paths):
        data = fetched.get(path)
        try:
            if isinstance(data, BaseException) or data is None:
                raise OSError(f"fetch failed: {data!r}")
            width, height = decode_check(data)
            results.append(DecodeResult(position=position, width=width, height=height))
        except Exception as exc:  # any decoder error means: exclude this file
            results.append(DecodeResult(position=position, error=f"{type(exc).__name__}: {exc}"))
    return results


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


def chunked(items: Sequence[int], size: int) -> list[list[int]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def validate_dataset(
    runner: DaskTaskRunner,
    location: DataLocation,
    manifest: Manifest,
    per_class: int | None = None,
) -> Manifest:
    """Decode-check images across the cluster; return the manifest without the bad ones."""
    positions = sample_positions(manifest, per_class)
    futures = [
        runner.submit(
            decode_chunk,
            parameters={
                "location": location,
                "keys": [manifest.paths[i] for i in chunk],
                "positions": chunk,
            },
        )
        for chunk in chunked(positions, CHUNK_SIZE)
    ]
    wait(futures)
    results = [r for future in futures for r in future.result()]
    bad = [r for r in results if r.error]
    good = [r for r in results if not r.error]
    clean = manifest.without({r.position for r in bad})
    _report(manifest, clean, good, bad)
    if not clean.paths:
        raise ValueError(
            f"None of the {len(results)} images checked under {manifest.root!r} could be "
            f"decoded; first error: {bad[0].error}"
        )
    if bad:
        get_run_logger().warning(
            "Excluded %d unreadable image(s) of %d checked, e.g. %s",
            len(bad), len(results), manifest.paths[bad[0].position],
        )
    return clean


def _report(manifest: Manifest, clean: Manifest, good: list[DecodeResult], bad: list[DecodeResult]) -> None:
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
            f"**{len(bad)} excluded**.\n\n"
            f"Image sizes (w x h): min {min(widths)} x {min(heights)}, median "
            f"{statistics.median(widths):.0f} x {statistics.median(heights):.0f}, "
            f"max {max(widths)} x {max(heights)}.\n\n"
            "## Images per class (after exclusion)\n\n"
            + markdown_table(["class", "images"], [[k, v] for k, v in counts.items()])
            + ("\n## Excluded files\n\n" + markdown_table(["key", "error"], bad_rows) if bad else "")
        ),
    )
