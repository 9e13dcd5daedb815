"""The recipe on gloo ranks in processes of their own, for tests that check what a real gang computes."""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from prefect_ddp.tasks.gang import GangRegroup, RankContext, process_group
from prefect_ddp.tasks.training.boundary import BoundaryPart, EpochEnd, Stop
from prefect_ddp.tasks.training.job import TrainJob
from prefect_ddp.tasks.training.parts import RankTraining
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


# How a stand-in is put in place: setattr in a rank process of its own, a test's monkeypatch.setattr in
# the test's process (undone after the test).
Patch = Callable[[Any, str, Any], None]


def scored_epochs(scores: list[float], keep_weights: Path | None = None, patch: Patch = setattr) -> None:
    """Have the recipe record `scores[n - 1]` as epoch n's val_acc, whatever it measured, so that a
    test chooses which epoch is best; with `keep_weights`, save each epoch's weights there as
    `epoch{n}.pt` (the weights the best epoch's copy is taken from)."""
    from prefect_ddp.tasks.training import epoch as epoch_module, recipe

    measured = epoch_module.run_epoch

    def scripted(ctx, rank, *args, **kwargs):
        record, images = measured(ctx, rank, *args, **kwargs)
        record["val_acc"] = scores[record["epoch"] - 1]
        if keep_weights is not None:  # whole or absent: a soak may kill this process mid-write
            kept = keep_weights / f"epoch{record['epoch']}.pt"
            torch.save(rank.state.model.state_dict(), kept.with_suffix(".tmp"))
            kept.with_suffix(".tmp").replace(kept)
        return record, images

    patch(recipe, "run_epoch", scripted)


def refuse_one_write(what: str, epoch: int, patch: Patch = setattr) -> None:
    """The store refuses, retries exhausted, rank 0's write of `what` ("checkpoint" or "model.pt")
    for `epoch` (counted from 1), once; every other write lands."""
    from prefect_ddp.tasks.training import best_weights, checkpointing

    module = checkpointing if what == "checkpoint" else best_weights
    landing = module.save_torch
    model_writes = itertools.count(1)  # the n-th model.pt write: epoch n's where each epoch up to n was a new best
    refused = []

    def refusing(url, obj, options, **kwargs):
        nth = obj["epoch"] + 1 if what == "checkpoint" else next(model_writes)
        if nth == epoch and not refused:
            refused.append(url)
            raise OSError(f"503 SlowDown for {url}: the store's retries are exhausted")
        return landing(url, obj, options, **kwargs)

    patch(module, "save_torch", refusing)


def take_over_as_rank(rank: int, ports: tuple[int, int], job: TrainJob, out: Path, scores: list[float],
                      refuse: str) -> None:
    """Rank `rank` of an elastic gang of 2 whose first formation fails on rank 0's refused write of
    epoch 2's `refuse` ("checkpoint" or "model.pt"); the second formation, on the same 2 ranks,
    takes the run over from the state a rank parked in memory and trains it to its end. Epochs
    score `scores`, each epoch's weights are kept in `out` (rank 0), and `out`/taken{rank}.json
    says what the first formation raised, where the state was handed from, and the result."""
    from prefect_ddp.tasks.gang import context

    torch.set_num_threads(1)
    context.grow_requested = lambda flag: False  # type: ignore[assignment]
    scored_epochs(scores, keep_weights=out if rank == 0 else None)
    if rank == 0:
        refuse_one_write(refuse, epoch=2)
    common = dict(local_rank=rank, world_size=2, local_world_size=2, backend="gloo", device="cpu",
                  worker_address=f"local-{rank}", master_addr="127.0.0.1", gang_id="gang-test",
                  stop_flag="test-flag", max_world_size=2, elastic=True)
    failed = ""
    # Rank 1 learns that rank 0 left only when its collective times out (the gang's supervisor, which
    # stops it at once, is not here): 20 s, far above any wait of these ranks for each other.
    with process_group(backend="gloo", rank=rank, world_size=2, master_addr="127.0.0.1", master_port=ports[0],
                       timeout=timedelta(seconds=20)):
        try:
            train_classifier(RankContext(rank=rank, master_port=ports[0], **common), job)
        except Exception as error:  # rank 0's refused write; rank 1's peer gone
            failed = type(error).__name__
    with process_group(backend="gloo", rank=rank, world_size=2, master_addr="127.0.0.1", master_port=ports[1],
                       timeout=timedelta(seconds=60)):
        result = train_classifier(RankContext(rank=rank, master_port=ports[1], attempt=1, **common), job)
    (out / f"taken{rank}.json").write_text(json.dumps(
        {"failed": failed, "best_epoch": result.best_epoch, "history": [h["epoch"] for h in result.history],
         "handed_over": [a["handed_over"] for a in result.attempts]}))


class StopAfterEpochsSeen(BoundaryPart):
    """A caller's part that stops the run once it has seen `epochs` epochs end in its formation (as
    an early stop that counts its patience in memory does): a formation that trained again from an
    earlier checkpoint would stop later than the run did."""

    name = "stop after epochs seen"

    def __init__(self, training: RankTraining, epochs: int = 2) -> None:
        self.left = epochs

    def after_epoch(self, end: EpochEnd) -> Stop | None:
        self.left -= 1
        return Stop("patience ran out") if self.left == 0 else None


def stop_and_retry_as_rank(rank: int, port: int, jobs: dict[str, TrainJob], out: Path) -> None:
    """Rank `rank` of 2 trains each of `jobs` with a part that stops it after 2 epochs, then trains the
    same job again as a flow retry does; writes `out`/retried{rank}.json: {job: {"first": ..., "again": ...}},
    each the epochs recorded and those trained in that call."""
    torch.set_num_threads(1)
    ctx = RankContext(rank=rank, local_rank=rank, world_size=2, local_world_size=2, backend="gloo", device="cpu",
                      worker_address="local", master_addr="127.0.0.1", master_port=port)
    runs = {}
    with process_group(backend="gloo", rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                       timeout=timedelta(seconds=60)):
        for name, job in jobs.items():
            calls = [train_classifier(ctx, job, parts=[StopAfterEpochsSeen]) for _ in ("first", "again")]
            runs[name] = {call: {"history": [h["epoch"] for h in result.history],
                                 "trained": len(result.local_train_samples), "best_epoch": result.best_epoch}
                          for call, result in zip(("first", "again"), calls)}
    (out / f"retried{rank}.json").write_text(json.dumps(runs))


def hand_over_as_rank(rank: int, port: int, carries: list[int], out: Path) -> None:
    """Rank `rank` of 2 parks b"rank{rank}" at the same position, carrying best weights of epoch
    `carries[rank]` (-1: none), then takes part in the hand-over; writes what it was handed to
    `out`/handed{rank}.json."""
    from prefect_ddp.tasks.gang import handover

    handover.park("gang-test", (3, 0), f"rank{rank}".encode(), carries[rank])
    with process_group(backend="gloo", rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                       timeout=timedelta(seconds=60)):
        handed = handover.hand_over("gang-test")
    assert handed is not None
    (out / f"handed{rank}.json").write_text(json.dumps({"data": handed.data.decode(), "carries": handed.carries}))


ACCUMULATION_SEED = 7


def accumulation_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s 4 samples of a 4-feature, 3-class problem: the same on every call."""
    generator = torch.Generator().manual_seed(ACCUMULATION_SEED + rank)
    return torch.randn(4, 4, generator=generator), torch.randint(0, 3, (4,), generator=generator)


def accumulation_model() -> torch.nn.Module:
    torch.manual_seed(ACCUMULATION_SEED)
    return torch.nn.Linear(4, 3)


def accumulate_as_rank(rank: int, port: int, out: Path) -> None:
    """Rank `rank` of 2 takes one optimizer step over its 4 samples in 2 batches of 2, accumulated
    (training.accumulate_steps=2) under DDP; writes `out`/accumulated{rank}.pt: the weights after it,
    and after which batches the pass called on_step (an optimizer step) and on_batch (a heartbeat)."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset

    from prefect_ddp.tasks.data.device_batches import ToDevice
    from prefect_ddp.tasks.training.passes import train_one_epoch
    from prefect_ddp.tasks.training.step_knobs import StepKnobs

    torch.set_num_threads(1)
    with process_group(backend="gloo", rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                       timeout=timedelta(seconds=60)):
        model = accumulation_model()
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        steps: list[int] = []
        beats: list[int] = []
        train_one_epoch(ddp, DataLoader(TensorDataset(*accumulation_data(rank)), batch_size=2), optimizer,
                        torch.amp.GradScaler("cpu", enabled=False), ToDevice(torch.device("cpu")), None,
                        on_step=lambda done, total: steps.append(done), knobs=StepKnobs(accumulate_steps=2),
                        on_batch=lambda done, total: beats.append(done))
        torch.save({"state": model.state_dict(), "steps": steps, "beats": beats}, out / f"accumulated{rank}.pt")
