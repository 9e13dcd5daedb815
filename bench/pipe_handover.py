"""What a batch handed over through a loader process's pipe costs the rank, against /dev/shm.

    .venv/bin/python -m bench.pipe_handover [--rounds 3] [--batches 60] [--batch-size 32]

A DataLoader with two forked loader processes over one constant 224-px uint8 image (so the loader
processes cost next to nothing) hands over `--batches` batches, collated by `collate_images` (torch's
way: in /dev/shm) or by `PipedCollate` (prefect_ddp.tasks.data.pipe_handover: through the processes'
pipes). Measured from the first batch on: the rank process's CPU (every thread's, from rusage) and wall
time per MiB handed over. Interleaved: each round runs both, the order alternating. Prints each round and
the median per-round ratio pipe / shm. host_budget.PIPE_RANK_MS_PER_MIB quotes the pipe's CPU per MiB.
Record the table, machine and load in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from prefect_ddp.tasks.data.loader_steps import collate_images
from prefect_ddp.tasks.data.pipe_handover import PipedCollate

MiB = 2**20


class OneImage(Dataset[tuple[torch.Tensor, int]]):
    """`length` copies of one random 224-px image: the loader processes' own cost is next to nothing."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.image = torch.randint(0, 256, (3, 224, 224), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.image, index


def handed_over(collate: Any, batches: int, batch_size: int) -> tuple[float, float]:
    """(rank CPU ms, wall ms) per MiB of batches handed over by two forked loader processes."""
    loader = DataLoader(OneImage(batches * batch_size), batch_size=batch_size, num_workers=2, collate_fn=collate,
                        multiprocessing_context="fork")
    batches_in = iter(loader)
    next(batches_in)  # the processes started
    wall, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    handed = sum(images.nbytes for images, _ in batches_in)
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - wall
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu * 1e3 / (handed / MiB), wall * 1e3 / (handed / MiB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    ways = {"shm": collate_images, "pipe": PipedCollate(functools.partial(collate_images, shared=False))}
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; batches of {args.batch_size} 224-px uint8 "
          f"images ({args.batch_size * 3 * 224 * 224 / MiB:.2f} MiB), {args.batches} a run")
    ratios = []
    for round_number in range(args.rounds):
        order = list(ways) if round_number % 2 == 0 else list(reversed(ways))
        measured = {way: handed_over(ways[way], args.batches, args.batch_size) for way in order}
        ratios.append(measured["pipe"][0] / measured["shm"][0])
        for way in ways:
            cpu, wall = measured[way]
            print(f"round {round_number + 1} {way:4}: rank CPU {cpu:.3f} ms/MiB, wall {wall:.3f} ms/MiB")
    print(f"pipe / shm, rank CPU per MiB, median of the rounds' ratios: {statistics.median(ratios):.2f}x "
          f"(load average {os.getloadavg()[0]:.2f} after)")


if __name__ == "__main__":
    main()
