"""A per-rank function of an elastic gang, and the flow that runs it, for tests/test_elastic.py.

The function trains a tiny model by DDP over numbered images, with the train sampler the
recipe uses (tasks/data/positioned_sampler.py), parks its state as it leaves a formation and
takes it back over the next one's process group; it keeps no checkpoint at all, so a state
that was not handed over in memory fails the run. Each rank writes what it did to `marks`:
the images of every step it completed, and checksums of the state it parked and took.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
from prefect import flow
from prefect_dask import DaskTaskRunner

from prefect_ddp.tasks.data.positioned_sampler import PositionedSampler
from prefect_ddp.tasks.gang import GangRegroup, RankContext, run_gang, wrap_ddp

IMAGES = 60


def checksum(model: torch.nn.Module) -> float:
    return round(float(sum(p.detach().double().sum() for p in model.parameters())), 9)


def note(marks: Path, name: str, record: dict) -> None:
    with open(marks / name, "a") as out:
        out.write(json.dumps(record) + "\n")


def train_elastic(ctx: RankContext, config: dict) -> dict:
    """`config`: marks (a folder), epochs, batch, step_s (seconds each step sleeps), kill_at
    ([epoch, step]: rank 1 of the first formation SIGKILLs its own worker there)."""
    marks = Path(config["marks"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    epoch, start = 0, 0
    handed = ctx.hand_over()
    if handed is not None:
        state = torch.load(io.BytesIO(handed.data), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        epoch, start = handed.position
        note(marks, "taken", {"attempt": ctx.attempt, "rank": ctx.rank, "checksum": checksum(model),
                              "position": [epoch, start]})
    elif ctx.attempt > 0:
        raise RuntimeError(f"attempt {ctx.attempt}: no rank handed its state over, and this function keeps no checkpoint")
    ddp = wrap_ddp(model, torch.device("cpu"))
    sampler = PositionedSampler(IMAGES, ctx.world_size, ctx.rank, seed=3, batch_size=config["batch"])
    done = 0

    def park(at: tuple[int, int]) -> None:
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        ctx.park(at, buffer.getvalue())
        note(marks, "parked", {"attempt": ctx.attempt, "rank": ctx.rank, "checksum": checksum(model),
                               "position": list(at)})

    try:
        while epoch < config["epochs"]:
            sampler.set_epoch(epoch, start)
            indices = list(sampler)
            for step, first in enumerate(range(0, len(indices), config["batch"])):
                if [epoch, step] == config["kill_at"] and ctx.attempt == 0 and ctx.rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)  # its worker is lost, as an OOM kill or a lost host
                batch = indices[first:first + config["batch"]]
                images = torch.tensor([[float(i), 1.0, -float(i), 0.5] for i in batch]) / IMAGES
                loss = ddp(images).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                done = first + len(batch)
                note(marks, f"trained-{ctx.attempt}-{ctx.rank}", {"epoch": epoch, "images": batch,
                                                                  "world_size": ctx.world_size, "at": time.time()})
                ctx.check_stop()
                time.sleep(config["step_s"])
            epoch, start, done = epoch + 1, 0, 0
            if epoch < config["epochs"] and ctx.regroup_requested():
                park((epoch, 0))
                raise GangRegroup(f"after epoch {epoch}")
    except GangRegroup:
        raise
    except BaseException:
        park((epoch, sampler.position_after(done)))  # a peer was lost: the survivors' state goes on
        raise
    return {"rank": ctx.rank, "world_size": ctx.world_size, "checksum": checksum(model)}


@flow(name="elastic-test")
def elastic_flow(address: str, config: dict, world_size: int, min_world_size: int, max_restarts: int = 2) -> dict:
    """One elastic gang of `train_elastic` on the cluster at `address`: its results and attempts."""
    with DaskTaskRunner(address=address) as runner:
        results = run_gang(train_elastic, config, task_runner=runner, world_size=world_size,
                           min_world_size=min_world_size, max_restarts=max_restarts,
                           init_timeout=timedelta(seconds=60), lease_timeout=timedelta(seconds=120))
    return {"results": list(results), "attempts": [asdict(a) for a in results.attempts]}
