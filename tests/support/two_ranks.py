"""The recipe on gloo ranks in processes of their own, for tests that check what a real gang computes."""

from __future__ import annotations

import io
import itertools
import json
from datetime import timedelta
from pathlib import Path

import torch

from prefect_ddp.tasks.gang import GangRegroup, RankContext, process_group
from prefect_ddp.tasks.training.job import TrainJob
from prefect_ddp.tasks.training.recipe import train_classifier


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


def grow_as_rank(rank: int, ports: tuple[int, int], job: TrainJob, out: Path, ask: int) -> None:
    """Rank `rank` of an elastic gang that trains on 2 ranks, is asked to grow at its `ask`-th
    check, and goes on with 3 (process 2 joins the second formation only). The supervisor's flag
    is the one part stood in for: rank 0's read of it answers True on its `ask`-th call (the
    flag's own path, on Dask, is tests/test_elastic.py's). Writes `out`/grown{rank}.json: what
    the first formation raised and the train sums its state parked, the second's history and
    rank 0's attempts."""
    from prefect_ddp.tasks.gang import context, handover

    torch.set_num_threads(1)
    calls = itertools.count(1)
    context.grow_requested = lambda flag: next(calls) == ask  # type: ignore[assignment]
    common = dict(local_rank=rank, backend="gloo", device="cpu", worker_address=f"local-{rank}",
                  master_addr="127.0.0.1", gang_id="gang-test", stop_flag="test-flag", max_world_size=3,
                  elastic=True)
    regrouped, parked = "", {}
    if rank < 2:
        first = RankContext(rank=rank, world_size=2, local_world_size=2, master_port=ports[0], **common)
        with process_group(backend="gloo", rank=rank, world_size=2, master_addr="127.0.0.1", master_port=ports[0],
                           timeout=timedelta(seconds=60)):
            try:
                train_classifier(first, job)
            except GangRegroup as regroup:
                regrouped = str(regroup)
                parked = torch.load(io.BytesIO(handover._parked["gang-test"].data), weights_only=True)
    second = RankContext(rank=rank, world_size=3, local_world_size=3, master_port=ports[1], attempt=1, regroups=1,
                         **common)
    with process_group(backend="gloo", rank=rank, world_size=3, master_addr="127.0.0.1", master_port=ports[1],
                       timeout=timedelta(seconds=60)):
        result = train_classifier(second, job)
    (out / f"grown{rank}.json").write_text(json.dumps(
        {"regrouped": regrouped, "parked_trained": parked.get("trained"), "history": result.history,
         "attempts": result.attempts}))
