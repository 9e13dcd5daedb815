"""List an image folder once and turn it into a manifest, like torchvision's ImageFolder.

Classes are the first folder below the root, sorted, numbered from 0 (ImageFolder's
class_to_idx). Only image extensions count, in any case; files directly under the root
belong to no class and are skipped, and both kinds of skip are reported.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.asyn import _run_coros_in_chunks, sync
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.context import TaskRunContext

from prefect_ddp.tasks.data.manifest import IMAGE_EXTENSIONS, Manifest
from prefect_ddp.tasks.data.object_listing import list_with_obstore, relative_sizes
from prefect_ddp.tasks.data.storage import filesystem
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.reporting import markdown_table
from prefect_ddp.tasks.retries import retry_transient
from prefect_ddp.tasks.urls import is_s3

MIN_CLASSES = 2
# Class folders listed at once. botocore's connection pool holds 10 connections by default
# (docs/architecture.md, "Facts: storage clients"), so more would only queue inside it.
LISTING_CONCURRENCY = 10


def build_manifest(root: str, listing: dict[str, int], versions: dict[str, str] | None = None) -> Manifest:
    """Turn `{path relative to root: size}` (and each path's version, where known) into a
    manifest; raise when nothing is usable."""
    entries: list[tuple[str, str, int]] = []
    non_image = outside = 0
    for key, size in sorted(listing.items()):
        if not key.lower().endswith(IMAGE_EXTENSIONS):
            non_image += 1
        elif "/" not in key:
            outside += 1
        else:
            entries.append((key.split("/", 1)[0], key, size))
    classes = sorted({cls for cls, _, _ in entries})
    if not entries:
        raise ValueError(
            f"No images found under {root!r}: expected <root>/<class>/<image> with an "
            f"extension in {', '.join(IMAGE_EXTENSIONS)}; found {len(listing)} objects "
            f"({non_image} not images, {outside} directly under the root). "
            "Check the url and that the prefix holds one folder per class."
        )
    if len(classes) < MIN_CLASSES:
        raise ValueError(
            f"Found images of only one class ({classes[0]!r}) under {root!r}: a classifier "
            f"needs at least {MIN_CLASSES} class folders, <root>/<class>/<image>."
        )
    class_to_idx = {name: i for i, name in enumerate(classes)}
    return Manifest(
        root=root,
        classes=classes,
        paths=[key for _, key, _ in entries],
        sizes=[size for _, _, size in entries],
        labels=[class_to_idx[cls] for cls, _, _ in entries],
        versions=[versions.get(key, "") for _, key, _ in entries] if versions else [],
        skipped_non_image=non_image,
        skipped_outside_class=outside,
    )


def list_folder(location: Location, versions: dict[str, str] | None = None) -> dict[str, int]:
    """`{path relative to root: size in bytes}` for every object below the location; each one's
    version (ETag, else modification time) into `versions` when given.

    On S3 each class folder is listed concurrently: one recursive listing is a chain of
    1,000-key pages, each waiting for the one before, so 100k images are 100 round trips
    in a row; listed per class they overlap. Through obstore where it can serve the
    options (tasks/data/object_listing.py), since s3fs's parsing of the pages (about 74 us
    per key, one thread) bounds any concurrency; else s3fs, per class (bench/RESULTS.md,
    "Listing"). Local folders keep one `find`. The result is the same every way.
    """
    fs, root = filesystem(location.url, location.storage_options())
    if not is_s3(location.url):
        return relative_sizes(root, fs.find(root, detail=True), versions)
    listed = list_with_obstore(fs, root, LISTING_CONCURRENCY, versions)
    if listed is not None:
        return listed
    return relative_sizes(root, sync(fs.loop, find_per_folder, fs, root), versions)


async def find_per_folder(
    fs: AbstractFileSystem, root: str, concurrency: int = LISTING_CONCURRENCY,
) -> dict[str, dict[str, Any]]:
    """What `fs.find(root, detail=True)` returns, from one listing per first-level folder.

    The first level comes from one delimiter listing; files found there (outside any
    class) are kept so that build_manifest skips and counts them as before. Folders are
    listed `concurrency` at a time. A single huge class is still one chain of pages: the
    gain grows with the number of classes.
    """
    # _lsdir, not _ls: _ls serves a cached first level (s3fs keeps delimiter listings
    # in its instance cache) and turns an empty prefix into FileNotFoundError, where
    # find returns nothing and build_manifest explains.
    first_level = await fs._lsdir(root, refresh=True)
    found = {info["name"]: info for info in first_level if info["type"] != "directory"}
    folders = [info["name"] for info in first_level if info["type"] == "directory"]
    listings = await _run_coros_in_chunks(
        [fs._find(folder, detail=True) for folder in folders], batch_size=concurrency
    )
    for listing in listings:
        found.update(listing)
    return found


def _listing_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    # Keyed on where the data is, not on the credentials used to read it.
    location: Location = parameters["location"]
    where = f"{location.url}|{location.endpoint_url}|{location.region_name}"
    return "image-index-" + hashlib.sha256(where.encode()).hexdigest()[:24]


@task(
    name="index",
    retries=3,
    retry_delay_seconds=[2, 10, 30],
    retry_condition_fn=retry_transient,
    cache_key_fn=_listing_cache_key,
    cache_expiration=timedelta(minutes=60),
    # JSON, not pickle: a cached manifest is read back from storage.
    result_serializer="json",
)
def index_images(location: Location) -> Manifest:
    """List the image folder once and leave an index summary artifact."""
    versions: dict[str, str] = {}
    manifest = build_manifest(location.url, list_folder(location, versions), versions)
    counts = manifest.class_counts()
    create_markdown_artifact(
        key="image-index",
        description=f"Index of {location.url}",
        markdown=(
            f"# Index of `{location.url}`\n\n"
            f"{len(manifest)} images in {len(manifest.classes)} classes, "
            f"{sum(manifest.sizes) / 1e6:.1f} MB. Skipped: {manifest.skipped_non_image} "
            f"non-image files, {manifest.skipped_outside_class} files outside class folders.\n\n"
            + markdown_table(
                ["class", "index", "images"],
                [[name, i, counts[name]] for i, name in enumerate(manifest.classes)],
            )
        ),
    )
    return manifest
