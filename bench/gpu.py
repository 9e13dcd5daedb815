"""GPU benchmark (issue 12): does our S3 data path keep one GPU busy?

ResNet-50 training steps (channels-last, bf16 autocast, SGD) on one device, fed three ways
in the same run:
- synthetic: random tensors already on the device, the ceiling;
- S3, decoded on the CPU: S3ImageFolder through bench.s3_front (30 ms per response) with
  the recipe's train transform in forked DataLoader workers, pinned memory and
  non-blocking copies, as tasks/data/loaders.py makes them for the recipe;
- S3, decoded on the device: the loader hands over encoded JPEGs and the rank decodes and
  augments them on the device (`training.decode_on="device"`, tasks/data/device_batches.py).

It prints images/s of each and the ratio of each S3 row to the synthetic one (target:
at least 0.9). Each S3 row iterates its DataLoader epoch after epoch, as training does, so
the timed steps may span epoch starts (the defaults: 1,536 images make epochs of 12 batches
of 128, and the 3 warm-up and 30 timed steps cross two of them), which training pays too.
Written for the lent GPU machine; `--device cpu` with a small model and few images runs the
same code here, to check it, not to measure anything.

    source .gpu/setup.sh && python -m bench.gpu                       # on the lent GPU machine
    .venv/bin/python -m bench.gpu --device cpu --model resnet18 --per-class 8 --steps 4 --batch-size 8

bench/gpu_check.py runs it on the GPU machine together with the gpu-marked tests.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, closing
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from bench.data_path import (
    BUCKET,
    Source,
    machine,
    photo_dataset,
    read_ours,
    write_files,
)
from bench.s3_endpoints import latency_endpoint, leave_to_front
from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.dataset import forked_workers, train_transform
from prefect_ddp.tasks.data.device_batches import ToDevice, encoded_collate
from prefect_ddp.tasks.training.model import build_model
from prefect_ddp.tasks.training.optimization import build_optimizer
from prefect_ddp.tasks.training.rank_setup import autocast_dtype

IMAGE_SIZE = 224
CLASSES = 3
WARMUP_STEPS = 3
log = logging.getLogger("bench.gpu")
Batch = TypeVar("Batch")


@dataclass
class Row:
    name: str
    images_per_s: float
    front_ms: float | None = None  # the S3 front's CPU per image fed (warm-up steps included)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a check of the code).")
    parser.add_argument("--model", default="resnet50", help="torchvision backbone.")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30, help="Timed steps per row, after warm-up steps.")
    parser.add_argument("--per-class", type=int, default=512, help="Photo-sized JPEGs per class (3 classes).")
    parser.add_argument("--front-cpus", type=int, nargs="*", default=None,
                        help="CPUs the S3 front runs on, and this process with its loaders on the others "
                             "(default: all share all).")
    parser.add_argument("--workers", type=int, default=None,
                        help="DataLoader workers (default: the CPUs this process may use, less two).")
    parser.add_argument("--latency-ms", type=float, default=30.0, help="The S3 front's wait before each response.")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; use --device cpu to check the code on this machine.")
    return args


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, amp_dtype: torch.dtype | None
                  ) -> Callable[[torch.Tensor, torch.Tensor], None]:
    criterion = nn.CrossEntropyLoss()

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast(images.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = criterion(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def timed(name: str, batches: Iterable, inputs: ToDevice, step: Callable, steps: int, batch_size: int) -> Row:
    """Images/s over `steps` steps, after warm-up steps that fork workers and fill the pipeline.

    `batches` must not run out (`synthetic_batches`, or a loader through `epochs`)."""
    started = time.perf_counter()
    done = 0
    with closing(inputs.batches(batches)) as on_device:  # as the flow's passes take them (device decode ahead)
        for done, (images, labels) in enumerate(on_device, start=1):
            if done == WARMUP_STEPS + 1:
                synchronize(inputs.device)
                started = time.perf_counter()
            step(images, labels)
            if done == WARMUP_STEPS + steps:
                break
        else:
            raise ValueError(f"{name}: the batches ran out after {done} of {WARMUP_STEPS + steps}; "
                             "pass a loader through epochs(), which starts it again as training does.")
    synchronize(inputs.device)
    return Row(name, steps * batch_size / (time.perf_counter() - started))


def epochs(loader: DataLoader[Batch], name: str) -> Iterator[Batch]:
    """The loader's batches, epoch after epoch, as training iterates it: a timed window that
    spans an epoch's start pays what training pays there, and a short dataset cannot run out.

    Raises ValueError where an epoch makes no batch at all (fewer images than a batch with
    `drop_last`), which would otherwise loop for ever."""
    while True:
        made = 0
        for made, batch in enumerate(loader, start=1):
            yield batch
        if not made:
            raise ValueError(f"{name}: an epoch of {len(loader.dataset)} images makes no batch of "  # type: ignore[arg-type]
                             f"{loader.batch_size} (drop_last); give --per-class at least "
                             f"{-(-(loader.batch_size or 1) // CLASSES)} or a smaller --batch-size.")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_batches(device: torch.device, batch_size: int) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    images = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, device=device)
    labels = torch.randint(0, CLASSES, (batch_size,), device=device)
    while True:
        yield images, labels


def s3_loader(source: Source, args: argparse.Namespace, on_device: bool) -> DataLoader:
    dataset = read_ours(source, fetch_threads=args.batch_size)
    if on_device:
        dataset.transform = None  # serve encoded bytes; the rank decodes them
    options = {**forked_workers(), "persistent_workers": True, "prefetch_factor": 4} if args.workers else {}
    return DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=args.workers,
                      pin_memory=args.device == "cuda", collate_fn=encoded_collate if on_device else None, **options)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.front_cpus:
        leave_to_front(args.front_cpus)
    args.workers = max(1, len(os.sched_getaffinity(0)) - 2) if args.workers is None else args.workers
    device = torch.device(args.device)
    cfg = TrainingConfig(image_size=IMAGE_SIZE, batch_size=args.batch_size)
    model = build_model(ModelConfig(backbone=args.model), CLASSES).to(device).to(memory_format=torch.channels_last)
    step = training_step(model, build_optimizer(model, cfg, world_size=1), autocast_dtype(cfg, device, log))
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-gpu-")))
        write_files(work / "images" / "photo", photo_dataset(args.per_class))
        front = stack.enter_context(latency_endpoint(work, BUCKET, work / "images", args.latency_ms))
        if args.front_cpus:
            front.process.cpu_affinity(args.front_cpus)
        source = Source(work / "images" / "photo", "photo", train_transform(IMAGE_SIZE), front.url)
        on_cpu = f"S3 (+{args.latency_ms:g} ms), decoded by {args.workers} loader workers"
        on_device = f"S3 (+{args.latency_ms:g} ms), decoded on the device"
        fed = (WARMUP_STEPS + args.steps) * args.batch_size

        def from_s3(row: Callable[[], Row]) -> Row:
            spent = front.cpu_s()
            timed_row = row()
            timed_row.front_ms = 1000 * (front.cpu_s() - spent) / fed
            return timed_row

        rows = [
            timed("synthetic tensors on the device", synthetic_batches(device, args.batch_size),
                  ToDevice(device, channels_last=True), step, args.steps, args.batch_size),
            from_s3(lambda: timed(on_cpu, epochs(s3_loader(source, args, on_device=False), on_cpu),
                                  ToDevice(device, channels_last=True), step, args.steps, args.batch_size)),
            from_s3(lambda: timed(on_device, epochs(s3_loader(source, args, on_device=True), on_device),
                                  ToDevice(device, channels_last=True, transform=train_transform(IMAGE_SIZE)),
                                  step, args.steps, args.batch_size)),
        ]
    report(args, rows)


def report(args: argparse.Namespace, rows: list[Row]) -> None:
    print(f"# GPU data path, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    print(f"Machine: {machine()}")
    print(f"Command: {' '.join([os.path.relpath(sys.executable), '-m', 'bench.gpu', *sys.argv[1:]])}")
    print(f"{args.model}, batch {args.batch_size}, {args.steps} timed steps, channels-last, "
          f"autocast {autocast_dtype(TrainingConfig(), torch.device(args.device), log) or 'off'}")
    per_epoch = CLASSES * args.per_class // args.batch_size
    print(f"S3 rows: an epoch is {per_epoch} batches ({CLASSES * args.per_class} images), so their "
          f"{WARMUP_STEPS} warm-up and {args.steps} timed steps span "
          f"{-(-(WARMUP_STEPS + args.steps) // per_epoch)} epochs\n")
    front = f"on CPUs {args.front_cpus}, this process and its loaders on the others" if args.front_cpus else (
        "on the same CPUs as this process and its loaders")
    print(f"{args.workers} loader workers; the S3 front runs {front}\n")
    print("| feed | images/s | ratio to synthetic (target >= 0.9) | S3 front CPU ms/image |\n|---|---:|---:|---:|")
    for row in rows:
        spent = "-" if row.front_ms is None else f"{row.front_ms:.2f}"
        print(f"| {row.name} | {row.images_per_s:,.1f} | {row.images_per_s / rows[0].images_per_s:.2f}x | {spent} |")


if __name__ == "__main__":
    main()
