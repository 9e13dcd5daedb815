"""The recipe on two gloo ranks in processes of their own, for tests that check what a real gang computes."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch

from prefect_ddp.tasks.gang import RankContext, process_group
from prefect_ddp.tasks.training.recipe import TrainJob, train_classifier


def train_as_rank(rank: int, port: int, jobs: dict[str, TrainJob], out: Path, fields: tuple[str, ...]) -> None:
    """Rank `rank` of 2 trains each of `jobs` in turn; writes `out`/rank{rank}.json: {job: {field: value}}
    for `fields` of each RankResult. Run it with torch.multiprocessing.start_processes(nprocs=2)."""
    torch.set_num_threads(1)  # two ranks on this machine's two cores
    ctx = RankContext(rank=rank, local_rank=rank, world_size=2, local_world_size=2, backend="gloo", device="cpu",
                      worker_address="local", master_addr="127.0.0.1", master_port=port)
    with process_group(backend="gloo", rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                       timeout=timedelta(seconds=60)):
        results = {name: train_classifier(ctx, job) for name, job in jobs.items()}
    (out / f"rank{rank}.json").write_text(json.dumps(
        {name: {field: getattr(result, field) for field in fields} for name, result in results.items()}))
