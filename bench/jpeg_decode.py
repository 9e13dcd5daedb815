"""The loaders' JPEG decode alone, against the decoder the uint8 path first had, at each scale PIL picks.

    .venv/bin/python -m bench.jpeg_decode [--rounds 8]

`decoded_tensor` (prefect_ddp.tasks.data.decoding: libjpeg-turbo through simplejpeg at the scale
PIL's `draft` picks, PIL reading the header for its orientation and its verdict) against
`bench.train_path.first_decoder` (092522c: torchvision's `decode_jpeg` where PIL decodes at full
size, PIL's `open_rgb` where it reduces), on photo-like JPEGs (`bench.photos.photo`, quality 90)
decoded for the sides the loaders ask: 500x375 for 224-px crops (whole), 500x375 for 64-px crops
(1/2), 2048x1536 3-MP photos for 224-px crops (1/4) and 4032x3024 12-MP photos for 224-px crops
(1/8). One thread; interleaved: each round decodes every case with both, the order alternating.
Prints the median CPU ms per image of each and the median of the per-round ratios new / first.
The pixels are checked equal first. Record the table, machine and load in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from bench.photos import photo
from bench.train_path import cpu_model, first_decoder, versions
from prefect_ddp.tasks.data.decoding import decoded_tensor, draft_scale

# (what it is, width, height, images, the side the loaders ask for)
CASES = [("500x375 for 224-px crops", 500, 375, 128, 334), ("500x375 for 64-px crops", 500, 375, 128, 96),
         ("2048x1536 for 224-px crops", 2048, 1536, 24, 334), ("12 MP for 224-px crops", 4032, 3024, 12, 334)]


def cpu_ms(decode: Callable[[bytes, int], torch.Tensor], datas: list[bytes], side: int) -> float:
    started = time.process_time()
    for data in datas:
        decode(data, side)
    return (time.process_time() - started) / len(datas) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    sets = {name: ([photo(width, height, seed) for seed in range(count)], side)
            for name, width, height, count, side in CASES}
    for name, (datas, side) in sets.items():
        if not all(torch.equal(decoded_tensor(data, side), first_decoder(data, side)) for data in datas):
            raise AssertionError(f"{name}: the two decoders' pixels differ")
    new: dict[str, list[float]] = {name: [] for name in sets}
    first: dict[str, list[float]] = {name: [] for name in sets}
    for round_ in range(args.rounds):
        for name, (datas, side) in sets.items():
            pair = [(new, decoded_tensor), (first, first_decoder)]
            for times, decode in pair if round_ % 2 == 0 else pair[::-1]:
                times[name].append(cpu_ms(decode, datas, side))
    load_after = os.getloadavg()
    print(f"`.venv/bin/python -m bench.jpeg_decode --rounds {args.rounds}`\n")
    print(f"{os.cpu_count()} cores ({cpu_model()}); {versions()}; load average before {load_before[0]:.2f}, "
          f"after {load_after[0]:.2f}\n")
    print("| images, decoded for | PIL's scale | first decoder ms/image | new ms/image | new / first (per round) |")
    print("|---|---:|---:|---:|---:|")
    for name, width, height, _, side in CASES:
        ratio = statistics.median(n / f for n, f in zip(new[name], first[name]))
        print(f"| {name} | 1/{draft_scale((width, height), side)} | {statistics.median(first[name]):.3f} "
              f"| {statistics.median(new[name]):.3f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
