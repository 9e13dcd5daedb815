"""The flow's input pipeline against the bare DataLoader (issue 45), and on a GPU against the GPU's ceiling.

On a GPU the flow fed ResNet-50 at 0.26x of the GPU's ceiling where the same loader code in a bare
DataLoader reached 0.80x (bench/RESULTS.md). Both feeds here read the same photo-sized JPEGs
(500x375) from bench.s3_front (`--latency-ms` per response) with the same number of loader processes
(by default the flow's own default on this host) and the recipe's train transform:

- bare: S3ImageFolder in a plain DataLoader (shuffled, persistent forked workers, torch's default
  prefetch), iterated epoch after epoch; each epoch timed from `iter()` to its last step.
- flow: the recipe itself (`train_classifier` at world size 1, as a gang's rank runs it: rank_data's
  loaders, the step clock, progress, validation, checkpoints, the model card), each epoch's training
  pass timed by its own record (`images_per_s`: train images over the pass's wall time). Its byte
  cache as the flow chooses it (tasks/data/cache_choice.py: with 3 epochs or more, resized copies
  of the training images, which the epochs after the first read), in a folder of the run's own;
  `--cache-gb 0` reads the originals every epoch, as the flow did before it chose.

Epochs of `--short-steps` and of `--long-steps` steps; the first epoch of each (forking the loader
processes) is left out of both. Each feed also says what its loader processes spent: CPU per image
(all its epochs, train and validation, from the children's rusage once the loaders are reaped),
against the loaders' transforms alone on one thread of this process over the same images, measured
just before and after that feed ran, so under the same load, and weighted as the feed used them
(the flow's validation images take the eval transform) (target: the loader end to end at most 1.2x
the transform), images/s per loader process, and the S3 front's
CPU per image (it runs beside them here; `--front-cpus` pins it off the cores the rank and its
loaders use, as bench.gpu_check does on a GPU host). On the CPU (`--device cpu`, the default here) the model costs almost
nothing (one linear layer on each image's channel means), so all that is measured is the input: the
target is the flow at 0.9x of the bare loader or more. With `--device cuda` both train `--model`
(ResNet-50 at 224 px, batch 128, the recipe's bf16 autocast and channels-last) and a third row feeds it
synthetic tensors already on the GPU, the ceiling (targets: 0.9x in the best mode, 0.8x by default).
The report ends with what the flow's rank said of the feed `training.decode_on="auto"` chose, and why.

    .venv/bin/python -m bench.input_pipeline                                   # here: the CPU check
    .venv/bin/python -m bench.input_pipeline --long-steps 0 --short-epochs 3    # a quick check of the code
    source .gpu/setup.sh && python -m bench.input_pipeline --device cuda       # on the GPU machine
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from unittest import mock

import torch
from torch import nn
from torch.utils.data import DataLoader

from bench.data_path import BUCKET, listing_manifest, machine, photo_dataset, s3_options, write_files
from bench.project_log import project_messages
from bench.s3_endpoints import S3Endpoint, latency_endpoint, leave_to_front
from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.deployments.local_services import MOTO_CREDENTIALS, MOTO_REGION
from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.byte_cache import FOLDER_ENV
from prefect_ddp.tasks.data.dataset import S3ImageFolder, eval_transform, forked_workers, prepare, train_transform
from prefect_ddp.tasks.data.device_batches import ToDevice
from prefect_ddp.tasks.data.host_budget import HostLimits, LoaderLoad, handed_over_bytes, rank_budget
from prefect_ddp.tasks.data.loader_steps import collate_images, loader_steps
from prefect_ddp.tasks.data.loaders import LoaderWorkers, loader_workers
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.splitting import stratified_split
from prefect_ddp.tasks.gang import RankContext
from prefect_ddp.tasks.training import rank_setup
from prefect_ddp.tasks.training.job import TrainJob
from prefect_ddp.tasks.training.recipe import train_classifier
from prefect_ddp.tasks.training.model import build_model
from prefect_ddp.tasks.training.optimization import build_optimizer

CLASSES = 3
VAL_FRACTION = 0.1
# Distinct photos made per class; more are copies under other keys (making one costs ~15 ms of CPU).
DISTINCT_PER_CLASS = 256
CHEAP = "channel-means"  # --model's near-free classifier


class ChannelMeans(nn.Module):
    """A classifier that costs almost nothing per step: one linear layer on each image's channel means."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.head = nn.Linear(3, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.head(images.mean(dim=(2, 3)))
        return output


@dataclass
class Row:
    image_set: str  # "short" or "long" (`run`)
    feed: str
    steps: int
    images_per_s: float
    loader_ms: float | None = None  # loader processes' CPU per image they prepared
    front_ms: float | None = None  # the S3 front's CPU per image
    alone_ms: float | None = None  # the same images' transforms alone, one thread, CPU per image
    chosen: str = ""  # the flow's: what its rank said of the feed it chose (training.decode_on="auto")


@dataclass
class Spent:
    """CPU seconds of this process's reaped children (the loader processes) and of the S3 front."""

    loaders_s: float
    front_s: float

    @classmethod
    def now(cls, front: S3Endpoint) -> Spent:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return cls(children.ru_utime + children.ru_stime, front.cpu_s())

    def per_image_ms(self, since: Spent, images: int) -> tuple[float, float]:
        return (1000 * (self.loaders_s - since.loaders_s) / images, 1000 * (self.front_s - since.front_s) / images)


Step = Callable[[torch.Tensor, torch.Tensor], None]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: the input alone, with a near-free model; cuda: --model on the GPU, and its ceiling.")
    parser.add_argument("--model", default=None,
                        help=f"A torchvision backbone, or {CHEAP} (default: {CHEAP} on cpu, resnet50 on cuda).")
    parser.add_argument("--image-size", type=int, default=None, help="Crop side (default: 64 on cpu, 224 on cuda).")
    parser.add_argument("--batch-size", type=int, default=None, help="Per step (default: 16 on cpu, 128 on cuda).")
    parser.add_argument("--short-steps", type=int, default=15, help="Steps per epoch of the short runs (0: none).")
    parser.add_argument("--long-steps", type=int, default=None,
                        help="Steps per epoch of the long runs (0: none; default: 300 on cpu, 100 on cuda).")
    parser.add_argument("--short-epochs", type=int, default=16,
                        help="Epochs of the short runs; the first is left out of the rate.")
    parser.add_argument("--long-epochs", type=int, default=3,
                        help="Epochs of the long runs; the first is left out of the rate.")
    parser.add_argument("--workers", type=int, default=None,
                        help="Loader processes of both (default: the flow's own default on this host).")
    parser.add_argument("--cache-gb", type=float, default=None,
                        help="The flow's training.cache_gb (default: empty, the flow's own choice; 0: no byte cache).")
    parser.add_argument("--latency-ms", type=float, default=30.0, help="The S3 front's wait before each response.")
    parser.add_argument("--front-cpus", type=int, nargs="*", default=None,
                        help="CPUs the S3 front runs on, and this process with its loaders on the others "
                             "(default: all share all); on a GPU host, cores the ranks then do not use.")
    args = parser.parse_args(argv)
    on_gpu = args.device == "cuda"
    args.model = args.model or ("resnet50" if on_gpu else CHEAP)
    args.image_size = args.image_size or (224 if on_gpu else 64)
    args.batch_size = args.batch_size or (128 if on_gpu else 16)
    args.long_steps = (100 if on_gpu else 300) if args.long_steps is None else args.long_steps
    if on_gpu and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; use --device cpu (the default) on this machine.")
    if min(args.short_epochs, args.long_epochs) < 2:
        parser.error(f"--short-epochs {args.short_epochs}, --long-epochs {args.long_epochs}: give at least 2 "
                     "each, the first is left out of the rate.")
    if not any((args.short_steps, args.long_steps)):
        parser.error("--short-steps and --long-steps are both 0: give at least one epoch length.")
    return args


def make_model(name: str, device: torch.device) -> nn.Module:
    model = ChannelMeans(CLASSES) if name == CHEAP else build_model(ModelConfig(backbone=name), CLASSES)
    return model.to(device).to(memory_format=torch.channels_last if device.type == "cuda" else torch.contiguous_format)


def training_step(model: nn.Module, device: torch.device) -> Step:
    """One optimizer step as the recipe takes it: bf16 autocast on CUDA, full precision on the CPU."""
    optimizer = build_optimizer(model, TrainingConfig(), world_size=1)
    amp = device.type == "cuda"

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate_over_epochs(epochs: Iterable[Iterable[tuple[torch.Tensor, torch.Tensor]]], inputs: ToDevice,
                     step: Step) -> float:
    """Images/s of `step` over every epoch but the first, each timed from its start to its last step done."""
    images_seen, seconds = 0, 0.0
    for number, batches in enumerate(epochs):
        synchronize(inputs.device)
        started, count = time.perf_counter(), 0
        for images, labels in inputs.batches(batches):
            step(images, labels)
            count += len(labels)
        synchronize(inputs.device)
        if number:
            images_seen, seconds = images_seen + count, seconds + time.perf_counter() - started
    return images_seen / seconds


def synthetic_rate(args: argparse.Namespace, steps: int, epochs: int) -> float:
    """The GPU's ceiling: the same steps on tensors already on the device."""
    device = torch.device(args.device)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, CLASSES, (args.batch_size,), device=device)
    batches = [[(images, labels)] * steps for _ in range(epochs)]
    return rate_over_epochs(batches, ToDevice(device, channels_last=True), training_step(
        make_model(args.model, device), device))


def bare_rate(args: argparse.Namespace, manifest: Manifest, positions: list[int], endpoint: str, workers: int,
              epochs: int) -> float:
    """Images/s of a plain DataLoader over the train images, epochs 2.. of `epochs`; the loaders
    run the recipe's uint8 steps and the rank finishes the batch (prefect_ddp.tasks.data.loader_steps)."""
    device = torch.device(args.device)
    transform = train_transform(args.image_size)
    dataset = S3ImageFolder(manifest.root, [manifest.paths[i] for i in positions],
                            [manifest.labels[i] for i in positions], s3_options(endpoint),
                            loader_steps(transform), fetch_threads=args.batch_size,
                            sizes=[manifest.sizes[i] for i in positions])
    options = {**forked_workers(), "persistent_workers": True} if workers else {}
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=workers,
                        pin_memory=device.type == "cuda", collate_fn=collate_images, **options)
    rate = rate_over_epochs((loader for _ in range(epochs)), ToDevice(device, device.type == "cuda", transform),
                            training_step(make_model(args.model, device), device))
    del loader  # its processes end and are reaped: their CPU joins the children's rusage
    gc.collect()
    return rate


@dataclass(frozen=True)
class Alone:
    """The loaders' transforms alone, CPU ms per image on one thread: the train loader's (decode,
    crop, resize, flip to uint8) and the validation loader's (decode, resize, centre crop)."""

    train_ms: float
    eval_ms: float

    @classmethod
    def measure(cls, folder: Path, image_size: int) -> Alone:
        return cls(transform_ms(folder, loader_steps(train_transform(image_size))),
                   transform_ms(folder, loader_steps(eval_transform(image_size))))

    def beside(self, other: Alone) -> Alone:
        """The mean of two measures, one taken just before a feed ran and one just after."""
        return Alone((self.train_ms + other.train_ms) / 2, (self.eval_ms + other.eval_ms) / 2)

    def weighted(self, train: int, val: int) -> float:
        """Per image, over `train` images through the train transform and `val` through the eval one."""
        return (train * self.train_ms + val * self.eval_ms) / (train + val)


def transform_ms(folder: Path, steps: Callable[..., torch.Tensor], count: int = 128) -> float:
    """A loader's `steps` alone on one thread of this process, CPU ms per image, over the first
    `count` images of `folder`."""
    images = [path.read_bytes() for path in sorted(folder.rglob("*.jpg"))[:count]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prepare(images[0], 0, 0, steps)  # the first call loads what the decoders need
        started = time.thread_time()
        for data in images:
            prepare(data, 0, 0, steps)
        return 1000 * (time.thread_time() - started) / len(images)
    finally:
        torch.set_num_threads(threads)


@contextmanager
def recipe_model(name: str) -> Iterator[None]:
    """The recipe builds ChannelMeans instead of its backbone where --model says so: only the input is left."""
    if name == CHEAP:
        with mock.patch.object(rank_setup, "build_model", lambda config, classes, *where_and_how: ChannelMeans(classes)):
            yield
    else:
        yield


def flow_rate(args: argparse.Namespace, manifest: Manifest, endpoint: str, output: Path, workers: int | None,
              epochs: int) -> tuple[float, tuple[int, int], str]:
    """Images/s of the recipe's training passes, epochs 2.. of `epochs`, from its own epoch
    records; the images its loaders prepared in all (train, validation; every epoch); and what
    its rank said of the feed it chose."""
    source = DataLocation(url=manifest.root, endpoint_url=endpoint, region_name=MOTO_REGION, **MOTO_CREDENTIALS)
    job = TrainJob(
        source=source, output=DataLocation(url=str(output)), manifest=manifest,
        split=stratified_split(manifest, VAL_FRACTION, 0),
        model=ModelConfig(backbone="resnet18" if args.model == CHEAP else args.model, weights=None),
        training=TrainingConfig(epochs=epochs, batch_size=args.batch_size, image_size=args.image_size,
                                num_workers=workers, scheduler="none", cache_gb=args.cache_gb),
    )
    device = "cuda:0" if args.device == "cuda" else "cpu"
    ctx = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo", device=device,
                      worker_address="local", master_addr="127.0.0.1", master_port=0)
    # The byte cache in a folder of this run's own, so no earlier run's copies serve its first epoch.
    with (recipe_model(args.model), project_messages() as messages,
          mock.patch.dict(os.environ, {FOLDER_ENV: str(output / "cache")})):
        history = train_classifier(ctx, job).history
    # What the rank says of its feed (training.decode_on="auto": where it decodes and why,
    # tasks/training/feed_choice.py) and of its byte cache (tasks/data/cache_choice.py).
    said = [message for message in messages if "decode_on='auto'" in message or message.startswith("Byte cache")]
    later = history[1:]
    rate = sum(h["train_samples"] for h in later) / sum(h["train_samples"] / h["images_per_s"] for h in later)
    return rate, (epochs * len(job.split.train), epochs * len(job.split.val)), " ".join(said) or "not said"


def photo_files(per_class: int) -> dict[str, bytes]:
    """`per_class` photo-sized JPEGs per class: DISTINCT_PER_CLASS made, the rest copies under other keys."""
    made = photo_dataset(min(per_class, DISTINCT_PER_CLASS))
    by_class: dict[str, list[bytes]] = {}
    for key, data in made.items():
        by_class.setdefault(key.split("/")[0], []).append(data)
    return {f"{name}/{n:06d}.jpg": images[n % len(images)] for name, images in by_class.items()
            for n in range(per_class)}


def per_class_for(steps: int, batch_size: int) -> int:
    """Images per class so that the train split holds `steps` batches (and a few images more)."""
    return int(steps * batch_size / (1 - VAL_FRACTION) / CLASSES) + batch_size


def run(args: argparse.Namespace, workers: int, name: str, steps: int, epochs: int, work: Path) -> list[Row]:
    """The feeds over one image set whose train split holds about `steps` batches, for `epochs` epochs;
    its images and the flow's output in folders of their own, `name`d ("short", "long"), so that two
    sets of one length do not share them."""
    folder = work / f"images-{name}"
    write_files(folder / "photo", photo_files(per_class_for(steps, args.batch_size)))
    rows = ([Row(name, "synthetic tensors on the GPU", steps, synthetic_rate(args, steps, epochs))]
            if args.device == "cuda" else [])
    with latency_endpoint(work, BUCKET, folder, args.latency_ms) as front:
        if args.front_cpus:
            front.process.cpu_affinity(args.front_cpus)  # this process left them (main, leave_to_front)
        manifest = listing_manifest(folder / "photo", f"s3://{BUCKET}/photo")
        train = stratified_split(manifest, VAL_FRACTION, 0).train
        alone_before = Alone.measure(folder, args.image_size)
        before = Spent.now(front)
        bare = bare_rate(args, manifest, train, front.url, workers, epochs)
        after_bare = Spent.now(front)
        alone_between = Alone.measure(folder, args.image_size)
        rows.append(Row(name, "bare DataLoader", steps, bare,
                        *after_bare.per_image_ms(before, epochs * (len(train) // args.batch_size) * args.batch_size),
                        alone_ms=alone_before.beside(alone_between).train_ms))
        rate, (trained, validated), chosen = flow_rate(args, manifest, front.url, work / f"run-{name}", args.workers,
                                                       epochs)
        spent = Spent.now(front).per_image_ms(after_bare, trained + validated)
        alone_after = Alone.measure(folder, args.image_size)
        rows.append(Row(name, "the flow's recipe", steps, rate, *spent,
                        alone_ms=alone_between.beside(alone_after).weighted(trained, validated), chosen=chosen))
    return rows


def flow_default(args: argparse.Namespace) -> LoaderWorkers:
    """The loader processes the flow's recipe starts for one rank on this host at these batches, and why."""
    cfg = TrainingConfig(batch_size=args.batch_size, image_size=args.image_size)
    load = LoaderLoad.of(cfg, [], handed_over_bytes(loader_steps(eval_transform(args.image_size)), args.image_size),
                         pinned=args.device == "cuda")
    return loader_workers(rank_budget(cfg, HostLimits.of_this_host(), load))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.front_cpus:
        leave_to_front(args.front_cpus)
    workers = args.workers if args.workers is not None else flow_default(args).workers
    load = os.getloadavg()
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-input-")))
        sets = (("short", args.short_steps, args.short_epochs), ("long", args.long_steps, args.long_epochs))
        rows = [row for name, steps, epochs in sets if steps for row in run(args, workers, name, steps, epochs, work)]
    report(args, workers, load, rows)


def report(args: argparse.Namespace, workers: int, load: tuple[float, float, float], rows: list[Row]) -> None:
    print(f"# The flow's input pipeline against the bare DataLoader, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    print(f"Machine: {machine()}; load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print(f"Command: {' '.join([os.path.relpath(sys.executable), '-m', 'bench.input_pipeline', *sys.argv[1:]])}")
    print(f"{args.model} on {args.device}, {workers} loader process(es) each ({flow_default(args).why}), "
          f"batch {args.batch_size}, {args.image_size} px crops of 500x375 JPEGs, S3 front +{args.latency_ms:g} ms; "
          f"{args.short_epochs} short or {args.long_epochs} long epochs, the first left out\n")
    print("Loader CPU per image against the loaders' transforms alone on one thread, measured just before and "
          "after each feed ran (the flow's weighted by its train and validation images).\n")
    print("| steps per epoch | feed | images/s | per loader process | of the bare loader | of the GPU's ceiling "
          "| loader CPU ms/image | of the transform alone | S3 front CPU ms/image |\n"
          "|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for image_set in dict.fromkeys(row.image_set for row in rows):
        same = {row.feed: row for row in rows if row.image_set == image_set}
        ceiling = same.get("synthetic tensors on the GPU")
        bare = same["bare DataLoader"].images_per_s
        for feed, row in same.items():
            of_ceiling = f"{row.images_per_s / ceiling.images_per_s:.2f}x" if ceiling else "-"
            per_process = f"{row.images_per_s / workers:,.1f}" if row.loader_ms is not None and workers else "-"
            spent = ("- | - | -" if row.loader_ms is None or row.front_ms is None or row.alone_ms is None else
                     f"{row.loader_ms:.2f} | {row.loader_ms / row.alone_ms:.2f}x | {row.front_ms:.2f}")
            print(f"| {row.steps} | {feed} | {row.images_per_s:,.1f} | {per_process} | {row.images_per_s / bare:.2f}x "
                  f"| {of_ceiling} | {spent} |")
    for row in rows:
        if row.chosen:
            print(f"\nThe flow's feed on the {row.image_set} set ({row.steps} steps per epoch): {row.chosen}")


if __name__ == "__main__":
    main()
