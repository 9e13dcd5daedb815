"""What each fine-tuning knob costs (docs/models.md, "Fine-tuning knobs"), against the defaults
measured in the same run, interleaved.

Two parts, each a ratio to its own baseline:

- per training step: the recipe's own `train_one_epoch` (with the knobs' `StepKnobs` and the
  weights' average, as a rank runs it), resnet18 on in-memory 64 px samples in one process,
  batch 16: the step knobs (label smoothing, MixUp, CutMix, clipping, the average, two
  accumulated batches per step); and timm's resnet18 with and without layer-wise decay, and
  timm's ConvNeXt-Atto with and without drop-path, each against its own model's defaults;
- per training image: the train transform (`train_transform_for`) of a 500x375 photo-like
  JPEG, decoded once, at 224 px: TrivialAugmentWide and RandomErasing against the defaults.

Validation with the average takes a second pass over the validation images: twice
validation's time, not timed here.

    .venv/bin/python -m bench.knob_costs [--rounds 5]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.dataset import train_transform_for
from prefect_ddp.tasks.data.device_batches import ToDevice
from prefect_ddp.tasks.data.preprocessing import Preprocessing
from prefect_ddp.tasks.training.model import build_model
from prefect_ddp.tasks.training.optimization import build_optimizer
from prefect_ddp.tasks.training.passes import train_one_epoch
from prefect_ddp.tasks.training.step_knobs import StepKnobs
from prefect_ddp.tasks.training.weights_average import weights_average

CPU = torch.device("cpu")
CLASSES = 10
# (arm, backbone, the training fields it sets): each arm's ratio is to the first arm of its backbone.
STEP_ARMS: list[tuple[str, str, dict[str, Any]]] = [
    ("defaults", "resnet18", {}),
    ("defaults again", "resnet18", {}),  # the noise: its ratio to the first is what no other ratio can show
    ("label_smoothing=0.1", "resnet18", {"label_smoothing": 0.1}),
    ("mixup_alpha=0.2", "resnet18", {"mixup_alpha": 0.2}),
    ("cutmix_alpha=1.0", "resnet18", {"cutmix_alpha": 1.0}),
    ("clip_grad_norm=1.0", "resnet18", {"clip_grad_norm": 1.0}),
    ("ema_decay=0.999", "resnet18", {"ema_decay": 0.999}),
    ("accumulate_steps=2", "resnet18", {"accumulate_steps": 2}),
    ("defaults", "timm/resnet18", {}),
    ("layer_decay=0.75", "timm/resnet18", {"layer_decay": 0.75}),
    ("defaults", "timm/convnext_atto", {}),
    ("drop_path=0.1", "timm/convnext_atto", {"drop_path": 0.1}),
]
IMAGE_ARMS: list[tuple[str, dict[str, Any]]] = [
    ("defaults", {}), ("defaults again", {}), ("trivial_augment", {"trivial_augment": True}), ("random_erasing=0.25", {"random_erasing": 0.25}),
]


def epoch_runner(backbone: str, fields: dict[str, Any], samples: int, batch_size: int) -> Callable[[], float]:
    """One epoch of the recipe's training pass as `fields` set it up; returns a call that times one."""
    cfg = TrainingConfig(image_size=64, batch_size=batch_size, **fields)
    model = build_model(ModelConfig(backbone=backbone), CLASSES, side=64, drop_path=cfg.drop_path)
    optimizer = build_optimizer(model, cfg, world_size=1)
    average = weights_average(model, cfg.ema_decay)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, 3, 64, 64, generator=generator),
                         torch.randint(0, CLASSES, (samples,), generator=generator))
    loader = DataLoader(data, batch_size=batch_size)
    knobs = StepKnobs.of(cfg, CLASSES)
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def run() -> float:
        started = time.perf_counter()
        train_one_epoch(model, loader, optimizer, scaler, ToDevice(CPU), None, knobs=knobs, average=average)
        return time.perf_counter() - started
    return run


def photo() -> Image.Image:
    """A 500x375 photo-like JPEG (smooth gradients and noise), decoded."""
    generator = torch.Generator().manual_seed(1)
    across, down = torch.linspace(0, 255, 500).expand(375, 500), torch.linspace(0, 255, 375)[:, None].expand(375, 500)
    pixels = torch.stack([across, across.flip(1), down], -1)
    pixels = (pixels + 20 * torch.randn(375, 500, 3, generator=generator)).clamp(0, 255).to(torch.uint8)
    encoded = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(encoded, format="JPEG", quality=90)
    return Image.open(io.BytesIO(encoded.getvalue())).convert("RGB")


def image_runner(fields: dict[str, Any], images: int) -> Callable[[], float]:
    transform = train_transform_for(TrainingConfig(image_size=224, **fields), Preprocessing())
    image = photo()

    def run() -> float:
        started = time.perf_counter()
        for _ in range(images):
            transform(image)
        return time.perf_counter() - started
    return run


def interleaved(runners: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each runner's median time over `rounds`, the runners taken in turn in every round, each round
    starting one runner later (the first of a round ran slower); one warm-up each."""
    for run in runners.values():
        run()
    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            times[name].append(runners[name]())
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--images", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = args.samples // args.batch_size
    runners = {(arm, backbone): epoch_runner(backbone, fields, args.samples, args.batch_size)
               for arm, backbone, fields in STEP_ARMS}
    medians = interleaved({f"{backbone} {arm}": run for (arm, backbone), run in runners.items()}, args.rounds)
    print(f"per training step ({steps} steps of {args.batch_size} at 64 px, one thread; median of {args.rounds}):")
    for arm, backbone, _ in STEP_ARMS:
        seconds = medians[f"{backbone} {arm}"]
        baseline = medians[f"{backbone} defaults"]
        print(f"  {backbone:20} {arm:22} {1000 * seconds / steps:8.1f} ms/step  x{seconds / baseline:.2f}")
    images = interleaved({arm: image_runner(fields, args.images) for arm, fields in IMAGE_ARMS}, args.rounds)
    print(f"per training image (500x375 JPEG decoded once, 224 px crop; median of {args.rounds}):")
    for arm, _ in IMAGE_ARMS:
        print(f"  {arm:22} {1000 * images[arm] / args.images:6.2f} ms/image  x{images[arm] / images['defaults']:.2f}")


if __name__ == "__main__":
    main()
