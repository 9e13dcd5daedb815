"""Issue 12: how long indexing lists a 100k-image bucket, one recursive listing or one per class.

A recursive S3 listing is a chain of 1,000-key pages, each request waiting for the one
before; listing each class folder on its own lets those chains overlap. This script
starts a moto S3 server on loopback holding `<prefix>/<class>/<image>.jpg` keys (seeded
in moto's process, bench/seeded_moto.py), then times, alternately:

- sequential: today's listing before issue 12, one `fs.find(root)`;
- per class (list_folder): `prefect_ddp.tasks.data.indexing.list_folder`, one delimiter listing of the
  first level, then the class folders concurrently;
- per class, one at a time: the same listings in a row. moto scans and sorts every
  matching key for each page it serves, so smaller prefixes are cheaper for moto itself;
  this row tells that part of the gain from the part concurrency brings.

With `--front`, the keys are served instead by bench.s3_front, which answers requests
concurrently (as S3 does; moto answers one at a time, which capped issue 12's attempt)
after `--latency-ms`, and the ways are: sequential `fs.find` (the baseline), per class
through s3fs (list_folder before issue 22) and per class through obstore (list_folder now).

All must return the same `{relative path: size}`. moto answers on loopback in
milliseconds where S3 takes tens of them per page; `--latency-ms` makes each S3 request
wait that long in the client first (a timer on the event loop, so concurrent requests
wait together, as they would for S3; with `--front` the front waits instead). Run from
the repository root:

    .venv/bin/python -m bench.listing                       # 20 classes x 5,000 objects
    .venv/bin/python -m bench.listing --latency-ms 30 --classes 100 --per-class 1000
    .venv/bin/python -m bench.listing --front --latency-ms 30   # 100k keys, concurrent front
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from fsspec import AbstractFileSystem
from fsspec.asyn import sync

from bench.s3_endpoints import latency_endpoint
from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.deployments.local_services import (
    MOTO_CREDENTIALS,
    MOTO_REGION,
    child_process,
)
from prefect_ddp.tasks.data.indexing import find_per_folder, list_folder, relative_sizes
from prefect_ddp.tasks.data.storage import filesystem
from prefect_ddp.tasks.gang import free_port

BUCKET = "listing-bench"
PREFIX = "images"
SEED_TIMEOUT_S = 900.0  # moto's backend takes about 1 ms per object put in-process

T = TypeVar("T")


@contextmanager
def seeded_moto(classes: int, per_class: int, log_dir: Path) -> Iterator[str]:
    """A moto S3 server holding `classes x per_class` image keys; yields its endpoint."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    args = [
        sys.executable, "-m", "bench.seeded_moto", "--port", str(port), "--bucket", BUCKET,
        "--prefix", PREFIX, "--classes", str(classes), "--per-class", str(per_class),
    ]
    with child_process(args, f"{endpoint}/moto-api/", log_dir / "moto.log", timeout_s=SEED_TIMEOUT_S):
        yield endpoint


def sequential_listing(location: DataLocation) -> dict[str, int]:
    """The listing as it was before issue 12: one recursive `find` of the root."""
    fs, root = filesystem(location.url, location.storage_options())
    return relative_sizes(root, fs.find(root, detail=True))


def one_folder_at_a_time(location: DataLocation) -> dict[str, int]:
    """list_folder's listings, one class folder after the other."""
    fs, root = filesystem(location.url, location.storage_options())
    return relative_sizes(root, sync(fs.loop, find_per_folder, fs, root, concurrency=1))


@contextmanager
def added_latency(fs: AbstractFileSystem, latency_s: float) -> Iterator[None]:
    """Every S3 request of `fs` waits `latency_s` before it is sent, as if S3 were far away."""
    call = fs._call_s3

    async def delayed(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(latency_s)
        return await call(*args, **kwargs)

    fs._call_s3 = delayed
    try:
        yield
    finally:
        del fs._call_s3  # the class's method again


def timed(fn: Callable[[], T]) -> tuple[float, float, T]:
    """Wall seconds, this process's CPU seconds (parsing the pages), and what `fn` returned."""
    started, cpu_started = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - started, time.process_time() - cpu_started, result


def warmed_up(location: DataLocation) -> AbstractFileSystem:
    """The filesystem every way lists with (fsspec caches instances), its S3 client made,
    so that the first timed listing does not pay for it alone."""
    fs, root = filesystem(location.url, location.storage_options())
    fs.ls(root.split("/", 1)[0], refresh=True)
    return fs


def per_class_with_s3fs(location: DataLocation) -> dict[str, int]:
    """list_folder before obstore listed: each class folder through s3fs, 10 at a time."""
    fs, root = filesystem(location.url, location.storage_options())
    return relative_sizes(root, sync(fs.loop, find_per_folder, fs, root))


MOTO_WAYS: dict[str, Callable[[DataLocation], dict[str, int]]] = {
    "sequential fs.find": sequential_listing,
    "per class (list_folder)": list_folder,
    "per class, one at a time": one_folder_at_a_time,
}
FRONT_WAYS: dict[str, Callable[[DataLocation], dict[str, int]]] = {
    "sequential fs.find": sequential_listing,
    "per class, s3fs, 10 at a time (list_folder before)": per_class_with_s3fs,
    "per class, obstore, 10 at a time (list_folder now)": list_folder,
}


def compare(location: DataLocation, repeats: int, expected: int,
            ways: dict[str, Callable[[DataLocation], dict[str, int]]]) -> dict[str, list[tuple[float, float]]]:
    """Seconds per listing for each way, taking turns so that all see the same machine."""
    seconds: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in range(repeats):
        listings = {}
        for name, way in ways.items():
            took, cpu, listings[name] = timed(partial(way, location))
            seconds[name].append((took, cpu))
            print(f"  {name}: {took:.2f} s ({cpu:.2f} s client CPU), {len(listings[name])} keys", flush=True)
        first = listings["sequential fs.find"]
        if len(first) != expected or any(listing != first for listing in listings.values()):
            raise AssertionError(f"Listings differ or are incomplete: {[len(v) for v in listings.values()]} keys, expected {expected}")
    return seconds


def report(seconds: dict[str, list[tuple[float, float]]], keys: int, classes: int, latency_ms: float,
           server: str) -> str:
    """A markdown table: median wall and client CPU seconds, speed-up over the sequential listing."""
    walls = {name: [wall for wall, _ in runs] for name, runs in seconds.items()}
    medians = {name: statistics.median(values) for name, values in walls.items()}
    baseline = medians["sequential fs.find"]
    rows = [
        f"| {name} | {medians[name]:.2f} | {', '.join(f'{v:.2f}' for v in walls[name])} | "
        f"{statistics.median(cpu for _, cpu in seconds[name]):.2f} | {baseline / medians[name]:.1f}x |"
        for name in seconds
    ]
    return "\n".join([
        f"{keys:,} keys in {classes} classes on {server}, {latency_ms:g} ms added per request, "
        f"median of {len(next(iter(seconds.values())))}:", "",
        "| listing | median s | runs s | client CPU s | speed-up |", "|---|---|---|---|---|", *rows,
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=20)
    parser.add_argument("--per-class", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=0.0, help="added before each S3 request")
    parser.add_argument("--front", action="store_true",
                        help="list bench.s3_front (answers concurrently, --latency-ms per response) instead of moto")
    args = parser.parse_args()
    keys = args.classes * args.per_class
    log_dir = Path(tempfile.mkdtemp(prefix="bench-listing-"))
    if args.front:
        with latency_endpoint(log_dir, BUCKET, None, args.latency_ms, (PREFIX, args.classes, args.per_class)) as front:
            location = DataLocation(url=f"s3://{BUCKET}/{PREFIX}", endpoint_url=front.url,
                                    region_name=MOTO_REGION, **MOTO_CREDENTIALS)
            warmed_up(location)
            seconds = compare(location, args.repeats, keys, FRONT_WAYS)
    else:
        started = time.perf_counter()
        with seeded_moto(args.classes, args.per_class, log_dir) as endpoint:
            print(f"moto seeded with {keys:,} keys in {time.perf_counter() - started:.0f} s", flush=True)
            location = DataLocation(
                url=f"s3://{BUCKET}/{PREFIX}", endpoint_url=endpoint, region_name=MOTO_REGION, **MOTO_CREDENTIALS
            )
            with added_latency(warmed_up(location), args.latency_ms / 1000):
                seconds = compare(location, args.repeats, keys, MOTO_WAYS)
    print(report(seconds, keys, args.classes, args.latency_ms, "bench.s3_front" if args.front else "moto"))


if __name__ == "__main__":
    main()
