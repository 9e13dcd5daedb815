"""The flow's input pipeline against the bare DataLoader (issue 45), and on a GPU against the GPU's ceiling.

On a GPU the flow fed ResNet-50 at 0.26x of the GPU's ceiling where the same loader code in a bare
DataLoader reached 0.80x (bench/RESULTS.md). Both feeds here read the same photo-sized JPEGs
(500x375) from bench.s3_front (`--latency-ms` per response) with the same number of loader processes
(by default the flow's own default on this host) and the recipe's train transform:

- bare: S3ImageFolder in a plain DataLoader (shuffled, persistent forked workers, torch's default
  prefetch), iterated epoch after epoch; each epoch timed from `iter()` to its last step.
- flow: the recipe itself (`train_classifier` at world size 1, as a gang's rank runs it: rank_data's
  loaders, the step clock, progress, validation, checkpoints, the model card), each epoch's training
  pass timed by its own record (`images_per_s`: train images over the pass's wall time).

Epochs of `--short-steps` and of `--long-steps` steps; the first epoch of each (forking the loader
processes) is left out of both. On the CPU (`--device cpu`, the default here) the model costs almost
nothing (one linear layer on each image's channel means), so all that is measured is the input: the
target is the flow at 0.9x of the bare loader or more. With `--device cuda` both train `--model`
(ResNet-50 at 224 px, batch 128, the recipe's bf16 autocast and channels-last) and a third row feeds it
synthetic tensors already on the GPU, the ceiling (targets: 0.9x in the best mode, 0.8x by default).

    .venv/bin/python -m bench.input_pipeline                                   # here: the CPU check
    .venv/bin/python -m bench.input_pipeline --long-steps 0 --short-epochs 3    # a quick check of the code
    source .gpu/setup.sh && python -m bench.input_pipeline --device cuda       # on the GPU machine
"""

from __future__ import annotations

import argparse
import os
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
from bench.s3_endpoints import latency_endpoint
from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.deployments.local_services import MOTO_CREDENTIALS, MOTO_REGION
from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.dataset import S3ImageFolder, forked_workers, train_transform
from prefect_ddp.tasks.data.device_batches import ToDevice
from prefect_ddp.tasks.data.loaders import default_loader_workers
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
    feed: str
    steps: int
    images_per_s: float


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
    parser.add_argument("--latency-ms", type=float, default=30.0, help="The S3 front's wait before each response.")
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
        for images, labels in batches:
            step(*inputs(images, labels))
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
    """Images/s of a plain DataLoader over the train images, epochs 2.. of `epochs`."""
    device = torch.device(args.device)
    dataset = S3ImageFolder(manifest.root, [manifest.paths[i] for i in positions],
                            [manifest.labels[i] for i in positions], s3_options(endpoint),
                            train_transform(args.image_size), fetch_threads=args.batch_size,
                            sizes=[manifest.sizes[i] for i in positions])
    options = {**forked_workers(), "persistent_workers": True} if workers else {}
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=workers,
                        pin_memory=device.type == "cuda", **options)
    return rate_over_epochs((loader for _ in range(epochs)), ToDevice(device, channels_last=device.type == "cuda"),
                            training_step(make_model(args.model, device), device))


@contextmanager
def recipe_model(name: str) -> Iterator[None]:
    """The recipe builds ChannelMeans instead of its backbone where --model says so: only the input is left."""
    if name == CHEAP:
        with mock.patch.object(rank_setup, "build_model", lambda config, classes, options=None: ChannelMeans(classes)):
            yield
    else:
        yield


def flow_rate(args: argparse.Namespace, manifest: Manifest, endpoint: str, output: Path, workers: int | None,
              epochs: int) -> float:
    """Images/s of the recipe's training passes, epochs 2.. of `epochs`, from its own epoch records."""
    source = DataLocation(url=manifest.root, endpoint_url=endpoint, region_name=MOTO_REGION, **MOTO_CREDENTIALS)
    job = TrainJob(
        source=source, output=DataLocation(url=str(output)), manifest=manifest,
        split=stratified_split(manifest, VAL_FRACTION, 0),
        model=ModelConfig(backbone="resnet18" if args.model == CHEAP else args.model, weights=None),
        training=TrainingConfig(epochs=epochs, batch_size=args.batch_size, image_size=args.image_size,
                                num_workers=workers, scheduler="none"),
    )
    device = "cuda:0" if args.device == "cuda" else "cpu"
    ctx = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo", device=device,
                      worker_address="local", master_addr="127.0.0.1", master_port=0)
    with recipe_model(args.model):
        history = train_classifier(ctx, job).history
    later = history[1:]
    return sum(h["train_samples"] for h in later) / sum(h["train_samples"] / h["images_per_s"] for h in later)


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


def run(args: argparse.Namespace, workers: int, steps: int, epochs: int, work: Path) -> list[Row]:
    """The feeds over one image set whose train split holds about `steps` batches, for `epochs` epochs."""
    folder = work / f"images-{steps}"
    write_files(folder / "photo", photo_files(per_class_for(steps, args.batch_size)))
    rows = [Row("synthetic tensors on the GPU", steps, synthetic_rate(args, steps, epochs))] if args.device == "cuda" else []
    with latency_endpoint(work, BUCKET, folder, args.latency_ms) as front:
        manifest = listing_manifest(folder / "photo", f"s3://{BUCKET}/photo")
        train = stratified_split(manifest, VAL_FRACTION, 0).train
        rows.append(Row("bare DataLoader", steps, bare_rate(args, manifest, train, front.url, workers, epochs)))
        rows.append(Row("the flow's recipe", steps,
                        flow_rate(args, manifest, front.url, work / f"run-{steps}", args.workers, epochs)))
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workers = args.workers if args.workers is not None else default_loader_workers().workers
    load = os.getloadavg()
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-input-")))
        rows = [row for steps, epochs in ((args.short_steps, args.short_epochs), (args.long_steps, args.long_epochs))
                if steps for row in run(args, workers, steps, epochs, work)]
    report(args, workers, load, rows)


def report(args: argparse.Namespace, workers: int, load: tuple[float, float, float], rows: list[Row]) -> None:
    print(f"# The flow's input pipeline against the bare DataLoader, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    print(f"Machine: {machine()}; load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print(f"Command: {' '.join([os.path.relpath(sys.executable), '-m', 'bench.input_pipeline', *sys.argv[1:]])}")
    print(f"{args.model} on {args.device}, {workers} loader process(es) each ({default_loader_workers().why}), "
          f"batch {args.batch_size}, {args.image_size} px crops of 500x375 JPEGs, S3 front +{args.latency_ms:g} ms; "
          f"{args.short_epochs} short or {args.long_epochs} long epochs, the first left out\n")
    print("| steps per epoch | feed | images/s | of the bare loader | of the GPU's ceiling |\n|---:|---|---:|---:|---:|")
    for steps in dict.fromkeys(row.steps for row in rows):
        same = {row.feed: row.images_per_s for row in rows if row.steps == steps}
        ceiling = same.get("synthetic tensors on the GPU")
        for feed, rate in same.items():
            of_ceiling = f"{rate / ceiling:.2f}x" if ceiling else "-"
            print(f"| {steps} | {feed} | {rate:,.1f} | {rate / same['bare DataLoader']:.2f}x | {of_ceiling} |")


if __name__ == "__main__":
    main()
