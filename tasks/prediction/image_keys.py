"""The images a batch-predict run scores: listed once, kept in the run's folder as keys.json.

Unlike training's index, class folders are optional: an image directly under the prefix is
scored with no true class, and one in a folder is scored with that folder (its first
segment) as its true class, whether or not the model knows the class. A rerun of the same
flow run reads keys.json instead of listing again, so its chunks hold the same keys as the
first attempt's even when the bucket changed in between.
"""

from __future__ import annotations

from prefect import task

from prefect_ddp.tasks.data.indexing import list_folder
from prefect_ddp.tasks.data.manifest import IMAGE_EXTENSIONS
from prefect_ddp.tasks.data.storage import exists, read_json, write_json
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.retries import retry_transient
from prefect_ddp.tasks.urls import child_url

KEYS_FILE = "keys.json"


def image_keys(listing: dict[str, int]) -> list[str]:
    """The image keys of a listing (`{path relative to the root: size}`), sorted.

    >>> image_keys({"b/2.PNG": 5, "README.txt": 3, "a.jpg": 4, "b/": 0})
    ['a.jpg', 'b/2.PNG']
    """
    return sorted(key for key in listing if key.lower().endswith(IMAGE_EXTENSIONS))


def true_class(key: str) -> str | None:
    """The folder an image sits in below the root (its first segment); None directly under it.

    >>> true_class("daisy/2024/1.jpg"), true_class("1.jpg")
    ('daisy', None)
    """
    return key.split("/", 1)[0] if "/" in key else None


@task(name="list-images", retries=3, retry_delay_seconds=[2, 10, 30], retry_condition_fn=retry_transient)
def list_images(source: Location, out: Location) -> list[str]:
    """Every image key below `source`, from the run's keys.json when an earlier attempt wrote it."""
    keys_url = child_url(out.url, KEYS_FILE)
    options = out.storage_options()
    if exists(keys_url, options):
        keys = read_json(keys_url, options)["keys"]
        run_logger().info("Scoring the %d images this run listed before (%s)", len(keys), keys_url)
        return keys
    listing = list_folder(source)
    keys = image_keys(listing)
    if not keys:
        raise ValueError(
            f"No images found under {source.url!r}: found {len(listing)} objects, none with an image "
            f"extension ({', '.join(IMAGE_EXTENSIONS)}). Point data_url (or the data block's url) at a "
            "folder of images: URL/IMAGE.jpg, or URL/CLASS/IMAGE.jpg to get the accuracy."
        )
    write_json(keys_url, {"source": source.url, "keys": keys, "skipped_non_image": len(listing) - len(keys)},
               options)
    run_logger().info("Listed %d images under %s (%d other objects skipped)", len(keys), source.url,
                      len(listing) - len(keys))
    return keys
