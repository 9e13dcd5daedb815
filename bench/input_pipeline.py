"""The flow's input pipeline against the bare DataLoader, with a model whose step costs almost nothing (issue 45).

On a GPU the flow fed ResNet-50 at 0.26x of the GPU's ceiling where the same loader code in a bare
DataLoader reached 0.80x (bench/RESULTS.md). With a model that costs almost nothing, all that is left
to measure is the input: both read the same photo-sized JPEGs (500x375) from bench.s3_front
(`--latency-ms` per response) with the same number of loader workers and the recipe's train transform,
and step a model of one linear layer on the images' channel means:

- bare: S3ImageFolder in a plain DataLoader (shuffled, persistent forked workers, torch's default
  prefetch), iterated epoch after epoch; each epoch timed from `iter()` to its last batch.
- flow: the recipe itself (`train_classifier` at world size 1, as a gang's rank runs it: rank_data's
  loaders, the step clock, progress, validation, checkpoints, the model card), each epoch's training
  pass timed by its own record (`images_per_s`, train images over the pass's wall time).

Epochs of `--short-steps` and of `--long-steps` steps; the first epoch of each (forking the loader
processes) is left out of both. It prints images/s of each and the flow's ratio to the bare loader
(target: at least 0.9 in both).

    .venv/bin/python -m bench.input_pipeline                       # both lengths, the host's default workers
    .venv/bin/python -m bench.input_pipeline --long-steps 0 --short-epochs 3   # a quick check of the code
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Iterator
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
from prefect_ddp.tasks.data.loaders import default_loader_workers
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.splitting import stratified_split
from prefect_ddp.tasks.gang import RankContext
from prefect_ddp.tasks.training import recipe
from prefect_ddp.tasks.training.optimization import build_optimizer

IMAGE_SIZE = 64
CLASSES = 3
VAL_FRACTION = 0.1
CTX = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo", device="cpu",
                  worker_address="local", master_addr="127.0.0.1", master_port=0)


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--short-steps", type=int, default=15, help="Steps per epoch of the short runs (0: none).")
    parser.add_argument("--long-steps", type=int, default=300, help="Steps per epoch of the long runs (0: none).")
    parser.add_argument("--short-epochs", type=int, default=16,
                        help="Epochs of the short runs; the first is left out of the rate.")
    parser.add_argument("--long-epochs", type=int, default=3,
                        help="Epochs of the long runs; the first is left out of the rate.")
    parser.add_argument("--workers", type=int, default=None,
                        help="Loader workers of both (default: the flow's own default on this host).")
    parser.add_argument("--latency-ms", type=float, default=30.0, help="The S3 front's wait before each response.")
    args = parser.parse_args(argv)
    if min(args.short_epochs, args.long_epochs) < 2:
        parser.error(f"--short-epochs {args.short_epochs}, --long-epochs {args.long_epochs}: give at least 2 "
                     "each, the first is left out of the rate.")
    if not any((args.short_steps, args.long_steps)):
        parser.error("--short-steps and --long-steps are both 0: give at least one epoch length.")
    return args


def per_class_for(steps: int, batch_size: int) -> int:
    """Images per class so that the train split holds `steps` batches (and a few images more)."""
    return int(steps * batch_size / (1 - VAL_FRACTION) / CLASSES) + batch_size


def bare_rate(manifest: Manifest, positions: list[int], endpoint: str, workers: int, batch_size: int,
              epochs: int) -> float:
    """Images/s of a plain DataLoader over the train images, epochs 2.. of `epochs`."""
    dataset = S3ImageFolder(manifest.root, [manifest.paths[i] for i in positions],
                            [manifest.labels[i] for i in positions], s3_options(endpoint),
                            train_transform(IMAGE_SIZE), fetch_threads=batch_size,
                            sizes=[manifest.sizes[i] for i in positions])
    options = {**forked_workers(), "persistent_workers": True} if workers else {}
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=workers, **options)
    model = ChannelMeans(CLASSES)
    optimizer = build_optimizer(model, TrainingConfig(), world_size=1)
    images_seen, seconds = 0, 0.0
    for epoch in range(epochs):
        started, count = time.perf_counter(), 0
        for images, labels in loader:
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            count += len(labels)
        if epoch:
            images_seen, seconds = images_seen + count, seconds + time.perf_counter() - started
    return images_seen / seconds


@contextmanager
def cheap_model() -> Iterator[None]:
    """The recipe builds ChannelMeans instead of its backbone: only the input is left to measure."""
    with mock.patch.object(recipe, "build_model", lambda config, classes, options=None: ChannelMeans(classes)):
        yield


def flow_rate(manifest: Manifest, endpoint: str, output: Path, workers: int, batch_size: int, epochs: int) -> float:
    """Images/s of the recipe's training passes, epochs 2.. of `epochs`, from its own epoch records."""
    source = DataLocation(url=manifest.root, endpoint_url=endpoint, region_name=MOTO_REGION, **MOTO_CREDENTIALS)
    job = recipe.TrainJob(
        source=source, output=DataLocation(url=str(output)), manifest=manifest,
        split=stratified_split(manifest, VAL_FRACTION, 0), model=ModelConfig(backbone="resnet18", weights=None),
        training=TrainingConfig(epochs=epochs, batch_size=batch_size, image_size=IMAGE_SIZE, num_workers=workers,
                                optimizer="adamw", lr=1e-3, scheduler="none"),
    )
    with cheap_model():
        history = recipe.train_classifier(CTX, job).history
    later = history[1:]
    return sum(h["train_samples"] for h in later) / sum(h["train_samples"] / h["images_per_s"] for h in later)


def run(args: argparse.Namespace, workers: int, steps: int, epochs: int, work: Path) -> list[Row]:
    """Both feeds over one image set whose train split holds about `steps` batches, for `epochs` epochs."""
    folder = work / f"images-{steps}"
    write_files(folder / "photo", photo_dataset(per_class_for(steps, args.batch_size)))
    with latency_endpoint(work, BUCKET, folder, args.latency_ms) as front:
        manifest = listing_manifest(folder / "photo", f"s3://{BUCKET}/photo")
        train = stratified_split(manifest, VAL_FRACTION, 0).train
        bare = bare_rate(manifest, train, front.url, workers, args.batch_size, epochs)
        flow = flow_rate(manifest, front.url, work / f"run-{steps}", workers, args.batch_size, epochs)
    return [Row("bare DataLoader", steps, bare), Row("the flow's recipe", steps, flow)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workers = args.workers if args.workers is not None else default_loader_workers().workers
    load = os.getloadavg()
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-input-")))
        rows = [row for steps, epochs in ((args.short_steps, args.short_epochs), (args.long_steps, args.long_epochs))
                if steps for row in run(args, workers, steps, epochs, work)]
    print(f"# The flow's input pipeline against the bare DataLoader, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    print(f"Machine: {machine()}; load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print(f"Command: {' '.join([os.path.relpath(sys.executable), '-m', 'bench.input_pipeline', *sys.argv[1:]])}")
    print(f"{workers} loader worker(s) each, batch {args.batch_size}, {IMAGE_SIZE} px crops of 500x375 JPEGs, "
          f"S3 front +{args.latency_ms:g} ms; {args.short_epochs} short or {args.long_epochs} long epochs, "
          "the first left out\n")
    print("| steps per epoch | bare DataLoader, images/s | the flow, images/s | flow / bare (target >= 0.9) |")
    print("|---:|---:|---:|---:|")
    for bare, flow in zip(rows[::2], rows[1::2]):
        print(f"| {bare.steps} | {bare.images_per_s:,.1f} | {flow.images_per_s:,.1f} | "
              f"{flow.images_per_s / bare.images_per_s:.2f}x |")


if __name__ == "__main__":
    main()
