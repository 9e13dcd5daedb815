"""Data-path benchmark (issue 12): images/s, HTTP requests and CPU time per image, by reader.

Readers, each behind the recipe's FetchAheadLoader (batch 32, the training's eval transform, no shuffle):
- torchvision's ImageFolder on local disk: the baseline; every ratio is taken against it,
  measured in the same run on the same JPEGs;
- our S3ImageFolder (tasks/data/dataset.py): one GET per image, a batch fetched concurrently;
- dask-pytorch-ddp 0.2.2's S3ImageFolder: a new boto3 resource, a HEAD and a GET per image
  (docs/architecture.md, "Data: per-image reads"). It is installed into bench/.cache on
  first use, never into the project's environment; where it cannot be installed its rows
  are skipped and the output says why;
- our S3ImageFolder with the byte cache (tasks/data/byte_cache.py, `training.cache_gb`), filled
  by an epoch before the timing: the epochs after the first, which send no GET;
- our ShardDataset (tasks/data/shard_writer.py and shard_reader.py, `training.images_per_shard`): tar shards written once
  (before the servers start, as the flow's write-shards step would), each read with one GET.
  The last two run through the latency front only: they are about later epochs and latency.

The S3 readers read through moto on loopback and through bench.s3_front, which waits
30 ms (`--latency-ms`) before each response, as real S3 takes tens of milliseconds, and
which, unlike moto, does not cap near 250 GETs/s (docs/architecture.md, "Facts: moto").
Two image sets: 64 px shapes and photo-sized 500x375 JPEGs. DataLoader workers: 0 and 2,
forked and persistent as tasks/data/loaders.py makes them for the recipe.

Each measurement starts with a warm-up epoch of one batch per worker (it forks the workers
and creates the S3 clients), then times `--repeats` epochs and keeps the fastest. CPU time
is the client's: this process and its DataLoader workers. The server's CPU is shown in a
column of its own: on two cores it competes with the client for the same CPU.

    .venv/bin/python -m bench.data_path          # about 5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import boto3
import numpy as np
import psutil
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.datasets import ImageFolder

from bench.outside import install_beside
from bench.s3_endpoints import S3Endpoint, latency_endpoint, moto_endpoint
from prefect_ddp.deployments.local_services import MOTO_CREDENTIALS, MOTO_REGION
from prefect_ddp.deployments.sample_data import CLASSES, draw_shape, shapes_dataset
from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data.byte_cache import ByteCache
from prefect_ddp.tasks.data.dataset import S3ImageFolder, eval_transform, forked_workers
from prefect_ddp.tasks.data.fetch_ahead import FetchAheadLoader
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.shard_reader import ShardDataset, ShardLoader
from prefect_ddp.tasks.data.shard_writer import ShardFormat, ShardIndex, write_shards

BUCKET = "bench"
BATCH_SIZE = 32
DPD_REQUIREMENT = "dask-pytorch-ddp==0.2.2"
PHOTO_SIZE = (500, 375)
# Grain on the flat shapes, so a 500x375 JPEG weighs what a photo does (about 90 KB), not 8 KB.
PHOTO_GRAIN = 18.0
# Other processes using more than this many cores during an epoch mark its row as disturbed.
NOISE_CORES = 0.1
LOCAL, OURS, DPD = "ImageFolder (local disk)", "S3ImageFolder (ours)", "dask-pytorch-ddp 0.2.2"
CACHED, SHARDS = "S3ImageFolder, later epoch from byte cache", "ShardDataset (tar shards)"
FRONT_ONLY = (CACHED, SHARDS)
# Targets as shares of local disk's images/s: issue 12's for the cache and shards, issue
# 22's for per-image reads (the first epoch), by image set.
TARGETS = {CACHED: 0.9, SHARDS: 0.8}
PER_IMAGE_TARGETS = {"small": 0.5, "photo": 0.8}


# --- the images --------------------------------------------------------------------------

@dataclass(frozen=True)
class ImageSet:
    """One set of JPEGs: its folder and S3 prefix, and the crop the transform makes."""

    name: str
    shape: str
    crop: int
    make: Callable[[int], dict[str, bytes]]  # images per class -> {"<class>/<n>.jpg": bytes}


def photo_dataset(per_class: int, seed: int = 0) -> dict[str, bytes]:
    """500x375 JPEGs: the sample shapes with grain, so they decode and weigh like photos."""
    rng, grain = random.Random(seed), np.random.default_rng(seed)
    files = {}
    for shape, colour in CLASSES.items():
        for n in range(per_class):
            image = draw_shape(shape, colour, PHOTO_SIZE[0], rng).crop((0, 0, *PHOTO_SIZE))
            noise = grain.normal(0, PHOTO_GRAIN, (PHOTO_SIZE[1], PHOTO_SIZE[0], 3))
            pixels = np.asarray(image, dtype=np.float32) + noise
            buffer = io.BytesIO()
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
            files[f"{shape}/{n:04d}.jpg"] = buffer.getvalue()
    return files


def write_files(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


# --- the readers ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """Where a reader finds one image set: its local copy and, for S3 readers, an endpoint."""

    folder: Path
    prefix: str
    transform: Callable
    endpoint: str | None = None
    workers: int = 0  # the DataLoader's, which a ShardDataset plans its shards by


def read_local(source: Source) -> Dataset:
    return ImageFolder(str(source.folder), transform=source.transform)


def s3_options(endpoint: str | None) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": MOTO_CREDENTIALS["aws_access_key_id"],
            "secret": MOTO_CREDENTIALS["aws_secret_access_key"], "client_kwargs": {"region_name": MOTO_REGION}}


def listing_manifest(folder: Path, root: str) -> Manifest:
    """ImageFolder's own listing as a manifest: the same images, order and labels as the baseline."""
    listing = ImageFolder(str(folder))
    paths = [Path(path).relative_to(folder).as_posix() for path, _ in listing.samples]
    return Manifest(root=root, classes=listing.classes, paths=paths,
                    sizes=[(folder / path).stat().st_size for path in paths], labels=listing.targets)


def read_ours(source: Source, fetch_threads: int, cache: ByteCache | None = None) -> S3ImageFolder:
    m = listing_manifest(source.folder, f"s3://{BUCKET}/{source.prefix}")
    return S3ImageFolder(m.root, m.paths, m.labels, s3_options(source.endpoint), source.transform,
                         fetch_threads=fetch_threads, sizes=m.sizes, cache=cache)


def read_cached(source: Source, fetch_threads: int, cache_folder: Path) -> S3ImageFolder:
    """Ours with a byte cache already holding every image, so what is timed is a later epoch.

    Filled from the files the server serves, not by fetching: a fetch here would send every
    image's GET through s3fs, the reader of a process that is not a loader's
    (prefect_ddp.tasks.data.object_reads.fetch_objects), and take as long.
    """
    dataset = read_ours(source, fetch_threads, ByteCache(10**12, cache_folder / source.prefix))
    for key, size in zip(dataset.keys, dataset.sizes):
        dataset.cache.put(f"{dataset.root}/{key}", size, (source.folder / key).read_bytes())
    return dataset


def write_set_shards(folder: Path, image_set: str, served: Path, images_per_shard: int) -> tuple[str, ShardIndex]:
    """Shards of every image of `folder`, written below `served`; their prefix there, and their index."""
    manifest = listing_manifest(folder, str(folder))
    index, _ = write_shards(manifest, range(len(manifest)), {}, str(served / f"{image_set}-shards"), {},
                            ShardFormat(images_per_shard=images_per_shard), "bench")
    written = next((served / f"{image_set}-shards").rglob("index.json")).parent
    return written.relative_to(served).as_posix(), index


def read_shards(source: Source, shards: dict[str, tuple[str, ShardIndex]]) -> ShardDataset:
    prefix, index = shards[source.prefix]
    return ShardDataset(f"s3://{BUCKET}/{prefix}", index, s3_options(source.endpoint), source.transform,
                        BATCH_SIZE, rank=0, world_size=1, loader_workers=source.workers)


def read_dpd(module: ModuleType, source: Source) -> Dataset:
    # It takes no endpoint: boto3 finds it in AWS_ENDPOINT_URL_S3 (see `boto_environment`).
    return module.S3ImageFolder(BUCKET, f"{source.prefix}/", transform=source.transform)


def load_dask_pytorch_ddp() -> ModuleType | str:
    """dask_pytorch_ddp.data, installed under bench/.cache on first use; or why it cannot be had.

    Its dependencies (boto3, torch, dask) are already here (bench.outside).
    """
    missing = install_beside("dask-pytorch-ddp", [DPD_REQUIREMENT], "dask_pytorch_ddp")
    if missing:
        return missing
    from dask_pytorch_ddp import data  # noqa: PLC0415 - importable only once installed

    return data


@contextmanager
def boto_environment(endpoint: str) -> Iterator[None]:
    """Point boto3's default session (and forked DataLoader workers) at `endpoint`.

    dask-pytorch-ddp calls `boto3.resource("s3")` with no arguments, so the endpoint and
    credentials can only reach it through the environment; boto3 reads AWS_ENDPOINT_URL_S3.
    """
    values = {"AWS_ENDPOINT_URL_S3": endpoint, "AWS_DEFAULT_REGION": MOTO_REGION,
              "AWS_ACCESS_KEY_ID": MOTO_CREDENTIALS["aws_access_key_id"],
              "AWS_SECRET_ACCESS_KEY": MOTO_CREDENTIALS["aws_secret_access_key"]}
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    boto3.DEFAULT_SESSION = None  # a session made earlier would keep another endpoint
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        boto3.DEFAULT_SESSION = None


# --- measuring -----------------------------------------------------------------------------

@dataclass
class Measurement:
    """One timed epoch. CPU times are the differences across it, in core-seconds."""

    images: int
    seconds: float
    client_cpu_s: float
    other_cpu_s: float  # by processes that are neither the client nor the server: noise
    server_cpu_s: float | None = None
    requests: Counter[str] = field(default_factory=Counter)

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds

    @property
    def disturbed(self) -> bool:
        """Whether other processes took more than a tenth of a core while it ran."""
        return self.other_cpu_s > NOISE_CORES * self.seconds


def client_processes() -> list[psutil.Process]:
    """This process and its DataLoader workers: forked children, so the same command line.

    The S3 servers are children too, but run other command lines, so they are left out.
    """
    me = psutil.Process()
    return [me, *(child for child in me.children() if child.cmdline() == me.cmdline())]


def cpu_s(processes: list[psutil.Process]) -> float:
    return sum(times.user + times.system for times in (p.cpu_times() for p in processes))


def cpu_now(processes: list[psutil.Process], server: S3Endpoint | None) -> tuple[float, float, float]:
    """CPU seconds so far of the client, the server and the whole machine (steal left out)."""
    machine = psutil.cpu_times()
    busy = machine.user + machine.nice + machine.system + machine.irq + machine.softirq
    return cpu_s(processes), server.cpu_s() if server else 0.0, busy


class EpochIndices(Sampler[int]):
    """The first `limit` indices, in order; `limit` may change between epochs.

    It lets the warm-up be a whole (short) epoch: one batch per worker, which forks the
    workers and creates their S3 clients, and leaves no batch in flight that a timed epoch
    would wait for or count requests of.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.limit))

    def __len__(self) -> int:
        return self.limit


def timed_epoch(loader: DataLoader, server: S3Endpoint | None) -> Measurement:
    """Time one epoch over `loader`, counting CPU and the server's requests across it."""
    processes = client_processes()
    requests_before = server.counts() if server else Counter()
    before = cpu_now(processes, server)
    start = time.perf_counter()
    images = sum(len(labels) for _, labels in loader)
    seconds = time.perf_counter() - start
    client, served, machine = (now - then for now, then in zip(cpu_now(processes, server), before))
    result = Measurement(images, seconds, client, machine - client - served)
    if server:
        time.sleep(0.2)  # moto logs a request after answering it
        result.server_cpu_s, result.requests = served, server.counts() - requests_before
    return result


def measure(dataset: Dataset, workers: int, server: S3Endpoint | None, repeats: int) -> Measurement:
    """The fastest of `repeats` epochs over all of `dataset`, after a warm-up epoch.

    A ShardDataset's warm-up is a whole epoch: its batches come from whole shards, so it
    cannot stop after one batch per worker without leaving shard GETs in flight.
    """
    options: dict[str, Any] = {"num_workers": workers}
    if workers:
        options |= {**forked_workers(), "persistent_workers": True}
    if isinstance(dataset, ShardDataset):
        loader, indices = ShardLoader(dataset, **options), None
    else:
        indices = EpochIndices(min(len(dataset), max(1, workers) * BATCH_SIZE))
        loader = FetchAheadLoader(dataset, indices, BATCH_SIZE, **options)  # as the recipe reads
    for _ in loader:  # warm-up
        pass
    if indices:
        indices.limit = len(dataset)
    return max((timed_epoch(loader, server) for _ in range(repeats)), key=lambda m: m.images_per_s)


# --- the run -------------------------------------------------------------------------------

@dataclass
class Row:
    image_set: str
    workers: int
    reader: str
    source: str
    result: Measurement


def run_set(image_set: ImageSet, folder: Path, readers: dict[str, Callable[[Source], Dataset]],
            servers: list[S3Endpoint], workers: list[int], repeats: int) -> Iterator[Row]:
    """Every reader on one image set, at each number of DataLoader workers."""
    transform = eval_transform(image_set.crop)
    for count in workers:
        local = read_local(Source(folder, image_set.name, transform))
        yield timed_row(image_set.name, count, LOCAL, local, None, repeats)
        for server in servers:
            for name, reader in readers.items():
                if name in FRONT_ONLY and server is not servers[-1]:
                    continue
                with boto_environment(server.url):
                    dataset = reader(Source(folder, image_set.name, transform, server.url, count))
                    row = timed_row(image_set.name, count, name, dataset, server, repeats)
                yield row


def timed_row(image_set: str, workers: int, reader: str, dataset: Dataset,
              server: S3Endpoint | None, repeats: int) -> Row:
    row = Row(image_set, workers, reader, server.name if server else "local disk",
              measure(dataset, workers, server, repeats))
    # Progress on stderr, so stdout stays the report.
    print(f"  {image_set}, {workers} workers, {reader} via {row.source}: "
          f"{row.result.images_per_s:.0f} images/s", file=sys.stderr, flush=True)
    return row


def best_rows(rows: list[Row]) -> list[Row]:
    """Each case's fastest row over the passes, in the order the cases first ran."""
    best: dict[tuple[str, int, str, str], Row] = {}
    for row in rows:
        case = (row.image_set, row.workers, row.reader, row.source)
        if case not in best or row.result.images_per_s > best[case].result.images_per_s:
            best[case] = row
    return list(best.values())


def requests_text(m: Measurement) -> str:
    if not m.requests:
        return "-"
    parts = " + ".join(f"{kind} {n / m.images:.2f}" for kind, n in sorted(m.requests.items()))
    return f"{sum(m.requests.values()) / m.images:.2f} ({parts})"


def baseline(rows: list[Row], row: Row) -> Row:
    return next(r for r in rows if (r.image_set, r.workers, r.reader) == (row.image_set, row.workers, LOCAL))


def table(rows: list[Row]) -> str:
    columns = ["images", "workers", "reader", "source", "images/s", "x local disk", "HTTP requests/image",
               "client CPU ms/image", "server CPU ms/image"]
    lines = [f"| {' | '.join(columns)} |", "|---" * len(columns) + "|"]
    for row in rows:
        m, base = row.result, baseline(rows, row).result
        server = "-" if m.server_cpu_s is None else f"{1000 * m.server_cpu_s / m.images:.2f}"
        mark = "*" if m.disturbed else ""
        lines.append(f"| {row.image_set} | {row.workers} | {row.reader} | {row.source} | {m.images_per_s:.0f}{mark} | "
                     f"{m.images_per_s / base.images_per_s:.2f} | {requests_text(m)} | "
                     f"{1000 * m.client_cpu_s / m.images:.2f} | {server} |")
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def targets(rows: list[Row], front: str) -> list[str]:
    """The targets for our readers through the latency front, one line per case."""
    lines = []
    for row in (r for r in rows if r.reader in (CACHED, SHARDS) and r.source == front):
        m, local = row.result, baseline(rows, row).result.images_per_s
        share = TARGETS[row.reader]
        lines.append(f"- {row.reader}, {row.image_set}, {row.workers} workers: {m.images_per_s / local:.2f}x local "
                     f"disk (>= {share}: {verdict(m.images_per_s >= share * local)}); "
                     f"{sum(m.requests.values()) / m.images:.3f} requests/image")
    for row in (r for r in rows if r.reader == OURS and r.source == front):
        m, local = row.result, baseline(rows, row).result.images_per_s
        dpd = next((r.result.images_per_s for r in rows if r.reader == DPD and r.source == front
                    and (r.image_set, r.workers) == (row.image_set, row.workers)), None)
        per_image = sum(m.requests.values()) / m.images
        one_get = set(m.requests) == {"GET"} and m.requests["GET"] == m.images
        dpd_text = "no dask-pytorch-ddp row" if dpd is None else (
            f"{m.images_per_s / dpd:.1f}x dask-pytorch-ddp (>= 10: {verdict(m.images_per_s >= 10 * dpd)})")
        share = PER_IMAGE_TARGETS[row.image_set]
        lines.append(f"- {row.image_set}, {row.workers} workers: {m.images_per_s / local:.2f}x local disk "
                     f"(>= {share}: {verdict(m.images_per_s >= share * local)}); {dpd_text}; "
                     f"{per_image:.2f} requests/image (exactly 1 GET: {verdict(one_get)})")
    return lines


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} cores ({model}), {gpu}, Python {platform.python_version()}, torch {torch.__version__}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small-per-class", type=int, default=128, help="64 px images per class (3 classes).")
    parser.add_argument("--photo-per-class", type=int, default=64, help="500x375 images per class (3 classes).")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader workers to try.")
    parser.add_argument("--repeats", type=int, default=2, help="Timed epochs per case; the fastest counts.")
    parser.add_argument("--latency-ms", type=float, default=30.0, help="The front's wait before each response.")
    parser.add_argument("--fetch-threads", type=int, default=TrainingConfig(batch_size=BATCH_SIZE).fetches_in_flight(),
                        help="Our S3ImageFolder's concurrent fetches per batch (the training default: the batch).")
    parser.add_argument("--skip-dpd", action="store_true", help="Leave dask-pytorch-ddp out.")
    parser.add_argument("--passes", type=int, default=1,
                        help="Run every row this many times, one pass over all rows after another, and keep "
                        "each row's best: load from other processes then hits a row and its baseline alike.")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads for this process (default: torch's own). 1 is what a rank "
                        "gets with 2 ranks on 2 cores (the gang's limit_threads); it keeps the transform's "
                        "intra-op threads from spinning against other processes' load at 0 workers.")
    parser.add_argument("--images-per-shard", type=int, default=32,
                        help="Images per tar shard in the shard rows (at least 2 shards per loader worker fit both sets).")
    args = parser.parse_args(argv)
    if min(args.small_per_class, args.photo_per_class, args.repeats, args.passes, args.torch_threads or 1) < 1 \
            or min(args.workers) < 0:
        parser.error("--small-per-class, --photo-per-class, --repeats, --passes and --torch-threads must be at "
                     "least 1, --workers at least 0.")
    return args


def readers(args: argparse.Namespace, work: Path, shards: dict[str, tuple[str, ShardIndex]],
            ) -> tuple[dict[str, Callable[[Source], Dataset]], str | None]:
    """The S3 readers to run, and why dask-pytorch-ddp is missing from them, if it is."""
    chosen: dict[str, Callable[[Source], Dataset]] = {
        OURS: partial(read_ours, fetch_threads=args.fetch_threads),
        CACHED: partial(read_cached, fetch_threads=args.fetch_threads, cache_folder=work / "byte-cache"),
        SHARDS: partial(read_shards, shards=shards),
    }
    if args.skip_dpd:
        return chosen, "left out (--skip-dpd)"
    module = load_dask_pytorch_ddp()
    if isinstance(module, str):
        return chosen, module
    return chosen | {DPD: partial(read_dpd, module)}, None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    image_sets = [ImageSet("small", "64x64", 64, partial(shapes_dataset, size=64)),
                  ImageSet("photo", "500x375", 224, photo_dataset)]
    counts = {"small": args.small_per_class, "photo": args.photo_per_class}
    started = time.perf_counter()
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-data-path-")))
        for image_set in image_sets:
            write_files(work / "images" / image_set.name, image_set.make(counts[image_set.name]))
        shards = {s.name: write_set_shards(work / "images" / s.name, s.name, work / "images", args.images_per_shard)
                  for s in image_sets}
        s3_readers, dpd_missing = readers(args, work, shards)
        servers = [stack.enter_context(moto_endpoint(work, BUCKET, work / "images")),
                   stack.enter_context(latency_endpoint(work, BUCKET, work / "images", args.latency_ms))]
        rows = best_rows([row for _ in range(args.passes) for image_set in image_sets for row in run_set(
            image_set, work / "images" / image_set.name, s3_readers, servers, args.workers, args.repeats)])
    report(args, rows, servers[1].name, dpd_missing, time.perf_counter() - started, image_sets, counts)


def report(args: argparse.Namespace, rows: list[Row], front: str, dpd_missing: str | None,
           seconds: float, image_sets: list[ImageSet], counts: dict[str, int]) -> None:
    sets = ", ".join(f"{s.name}: {counts[s.name] * len(CLASSES)} JPEGs of {s.shape}, eval crop {s.crop}"
                     for s in image_sets)
    print(f"# Data path, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    print(f"Machine: {machine()}")
    print(f"Command: {' '.join([os.path.relpath(sys.executable), '-m', 'bench.data_path', *sys.argv[1:]])}")
    print(f"Images: {sets}; batch {BATCH_SIZE}; our fetch_threads={args.fetch_threads}; "
          f"{args.images_per_shard} images per shard; torch threads {torch.get_num_threads()}; "
          f"best of {args.passes} pass(es) over all rows; "
          f"best of {args.repeats} epochs after a warm-up batch per worker; total run {seconds:.0f} s")
    if dpd_missing:
        print(f"dask-pytorch-ddp rows skipped: {dpd_missing}")
    print()
    print(table(rows))
    disturbed = [r.result.other_cpu_s / r.result.seconds for r in rows if r.result.disturbed]
    if disturbed:
        print(f"\n* {len(disturbed)} row(s) ran while other processes used up to {max(disturbed):.2f} cores "
              "of the machine's CPU: those numbers are low; rerun on a quiet machine.")
    print(f"\nTargets for our readers via {front}:")
    print("\n".join(targets(rows, front)))


if __name__ == "__main__":
    main()
