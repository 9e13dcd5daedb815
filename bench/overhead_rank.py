"""The rank side of bench/overhead.py: one small DDP training, timed from inside the rank.

The same `train` runs under torchrun (this module's `main`, started by
`torchrun --nproc_per_node 2 -m bench.overhead_rank`) and as a gang rank (`gang_rank`,
called by run_gang), so any difference in its loop time comes from the process it runs
in. Kept free of Prefect and Dask imports so torchrun's ranks start as a plain script
would.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchvision.models import resnet18

from prefect_ddp.tasks.gang import process_group


@dataclass(frozen=True)
class TrainConfig:
    """The training both launchers run; plain values so a gang can ship it to ranks."""

    samples: int = 512  # over all ranks, per epoch
    image_side: int = 64
    classes: int = 10
    batch_size: int = 32  # per rank
    epochs: int = 2
    seed: int = 0
    check_stop: bool = True  # gang ranks call ctx.check_stop() after every step, as the recipe does


@dataclass(frozen=True)
class RankTimes:
    """What one rank measured; times are time.time() so the launcher can compare them."""

    rank: int
    pid: int
    threads: int
    steps: int
    first_step_start: float
    last_step_end: float
    loop_cpu_s: float  # CPU of every thread of the rank's process during the loop
    peak_rss_mb: float

    @property
    def loop_s(self) -> float:
        return self.last_step_end - self.first_step_start


def synthetic_data(config: TrainConfig) -> TensorDataset:
    """The same in-memory images on every rank; the sampler gives each rank its half."""
    generator = torch.Generator().manual_seed(config.seed)
    images = torch.randn(config.samples, 3, config.image_side, config.image_side, generator=generator)
    labels = torch.randint(0, config.classes, (config.samples,), generator=generator)
    return TensorDataset(images, labels)


def peak_rss_mb() -> float:
    # ru_maxrss is in kilobytes on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(config: TrainConfig, rank: int, between_steps: Callable[[], None] = lambda: None) -> RankTimes:
    """Train resnet18 for `config.epochs` in the process group already formed; time the loop.

    `between_steps` runs after every optimizer step: the gang passes ctx.check_stop, as the
    transfer-learning recipe does, so its cost counts in the gang's loop.
    """
    torch.manual_seed(config.seed)
    model = DistributedDataParallel(resnet18(num_classes=config.classes))
    dataset = synthetic_data(config)
    sampler = DistributedSampler(dataset, shuffle=True, seed=config.seed)
    loader = DataLoader(dataset, batch_size=config.batch_size, sampler=sampler, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    dist.barrier()  # both ranks built their model: the loop starts together
    first_step_start, cpu_start = time.time(), time.process_time()
    steps = 0
    for epoch in range(config.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            optimizer.zero_grad()
            loss_fn(model(images), labels).backward()
            optimizer.step()
            between_steps()
            steps += 1
    last_step_end, loop_cpu_s = time.time(), time.process_time() - cpu_start
    return RankTimes(
        rank, os.getpid(), torch.get_num_threads(), steps, first_step_start, last_step_end, loop_cpu_s, peak_rss_mb()
    )


def gang_rank(ctx: Any, config: dict[str, Any]) -> dict[str, Any]:
    """run_gang's per-rank function: the process group is formed, threads are set."""
    config = TrainConfig(**config)
    times = train(config, ctx.rank, ctx.check_stop if config.check_stop else lambda: None)
    return asdict(times)


def main() -> None:
    """torchrun's entry point: form the group from torchrun's environment, train, write times."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", type=json.loads, default={})
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    with process_group(
        backend="gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
        master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]),
        timeout=timedelta(minutes=5),
    ):
        times = train(TrainConfig(**args.config), rank)
    (args.out / f"rank{rank}.json").write_text(json.dumps(asdict(times)))


if __name__ == "__main__":
    main()
