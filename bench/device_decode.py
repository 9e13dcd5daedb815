"""Decoding on the device, run on this machine's CPU (issue 45): a batch's images per second by path.

    .venv/bin/python -m bench.device_decode [--images 64] [--repeats 5] [--threads 1]

Makes `--images` photo-like JPEGs of 500x375 (bench.photos' gradients with grain, quality 90,
no EXIF), then turns them into one training batch (`train_transform(224)`) and one validation
batch (`eval_transform(224)`) three ways, each pass from the same seed:

- loader: as a DataLoader process does, image by image (`prepare`: PIL's decode, the transform),
  then stacked;
- device, per image: as `ToDevice` did before issue 45: the batch's JPEGs decoded in one call
  (`decode_on`), then the transform run image by image and the results stacked;
- device, batched: `ToDevice` now (one decode call, then `BatchTransform`: per image only the
  crop and resize, the flips, conversion and normalisation once on the batch).

The "per image" path decodes with today's `decode_on`, so the two device rows differ by the
transform alone. Here the device is the CPU, so the decode is libjpeg's in this process, not
nvjpeg's; what this measures is the CPU work of each path, on `--threads` of torch's threads
(1: per core, as a loader process runs). Whether the device path pays off on a GPU cannot be
measured here. A second table times the transform alone on 128 tiny images (about 40x30 to
24 px), where the pixels cost nothing: the Python and dispatch a rank's thread pays per image
whatever the device (a GPU adds a kernel launch per small kernel on top). Each measurement
runs `--repeats` passes; the fastest counts. Prints markdown tables with the machine's cores
and load average, for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import torch
import torchvision

from bench.photos import photo
from prefect_ddp.tasks.data.dataset import SizedTransform, encoded_tensor, eval_transform, prepare, train_transform
from prefect_ddp.tasks.data.device_batches import BatchTransform, EncodedBatch, ToDevice, decode_on

WIDTH, HEIGHT, IMAGE_SIZE = 500, 375, 224
TINY_IMAGES, TINY_SIZE = 128, 24


def loader_path(jpegs: list[bytes], transform: SizedTransform) -> torch.Tensor:
    """The batch as a loader process makes it: each image decoded by PIL and transformed, then stacked."""
    prepared = [prepare(data, 0, position, transform)[0] for position, data in enumerate(jpegs)]
    return torch.stack([image for image in prepared if isinstance(image, torch.Tensor)])


def per_image(images: list[torch.Tensor], transform: SizedTransform) -> torch.Tensor:
    """Decoded `images` run through `transform` one by one, then stacked: ToDevice before issue 45."""
    return torch.stack([transform(image) for image in images])


def at_once(images: list[torch.Tensor], batched: BatchTransform) -> torch.Tensor:
    """Decoded `images` run through `batched`: ToDevice now."""
    return batched.finished([batched.sized(image) for image in images], torch.contiguous_format)


def device_per_image(batch: EncodedBatch, transform: SizedTransform) -> torch.Tensor:
    """The batch as ToDevice made it before issue 45: one decode call, then the transform image by image."""
    return per_image([image for image in decode_on(torch.device("cpu"), batch.data) if image is not None], transform)


def device_batched(batch: EncodedBatch, transform: SizedTransform) -> torch.Tensor:
    """The batch as ToDevice makes it now (tasks/data/device_batches.py, `BatchTransform`)."""
    images, _ = ToDevice(torch.device("cpu"), transform=transform)(batch, torch.zeros(len(batch.data), dtype=torch.long))
    return images


def fastest_s(make: Callable[[], torch.Tensor], repeats: int, shape: tuple[int, ...]) -> float:
    """The shortest of `repeats` passes of `make`, each from the same seed; checks it made the whole batch."""
    times = []
    for _ in range(repeats):
        torch.manual_seed(0)
        started = time.perf_counter()
        made = make()
        times.append(time.perf_counter() - started)
        if made.shape != shape:
            raise RuntimeError(f"A path made a batch of {tuple(made.shape)}, not {shape}: an image did not "
                               "decode; the bench's JPEGs should all decode.")
    return min(times)


def transform_host_cost(repeats: int) -> None:
    """Print the transform's cost per image on tiny images, image by image and batched (module docstring)."""
    images = [torch.randint(0, 256, (3, 30 + n % 7, 40 + n % 5), dtype=torch.uint8) for n in range(TINY_IMAGES)]
    shape = (TINY_IMAGES, 3, TINY_SIZE, TINY_SIZE)
    print(f"\n| transform | {TINY_IMAGES} tiny images | us per image |")
    print("|---|---|---:|")
    for name, make_transform in (("train", train_transform), ("eval", eval_transform)):
        transform = make_transform(TINY_SIZE)
        before = fastest_s(partial(per_image, images, transform), repeats, shape)
        now = fastest_s(partial(at_once, images, BatchTransform(transform)), repeats, shape)
        print(f"| {name} | per image (before) | {before / TINY_IMAGES * 1e6:.0f} |")
        print(f"| {name} | batched (now) | {now / TINY_IMAGES * 1e6:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (1: per core, as a loader process)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    jpegs = [photo(WIDTH, HEIGHT, seed) for seed in range(args.images)]
    batch = EncodedBatch([encoded_tensor(data) for data in jpegs], torch.arange(args.images))
    paths: list[tuple[str, Callable[[SizedTransform], torch.Tensor]]] = [
        ("loader (PIL, per image)", partial(loader_path, jpegs)),
        ("device, per image (before)", partial(device_per_image, batch)),
        ("device, batched (now)", partial(device_batched, batch)),
    ]
    print(f"{os.cpu_count()} cores, load average {' '.join(f'{load:.2f}' for load in os.getloadavg())}, "
          f"torch {torch.__version__} on {args.threads} thread(s), torchvision {torchvision.__version__}; "
          f"{args.images} JPEGs of {WIDTH}x{HEIGHT} to {IMAGE_SIZE} px, fastest of {args.repeats}\n")
    print("| transform | path | ms per batch | images/s | vs loader |")
    print("|---|---|---:|---:|---:|")
    for name, make_transform in (("train", train_transform), ("eval", eval_transform)):
        transform = make_transform(IMAGE_SIZE)
        shape = (args.images, 3, IMAGE_SIZE, IMAGE_SIZE)
        seconds = {path: fastest_s(partial(run, transform), args.repeats, shape) for path, run in paths}
        loader_s = seconds[paths[0][0]]
        for path, took in seconds.items():
            print(f"| {name} | {path} | {took * 1e3:.0f} | {args.images / took:,.0f} | {loader_s / took:.2f}x |")
    transform_host_cost(args.repeats * 4)


if __name__ == "__main__":
    main()
