"""Ranks that disagree about the checkpoint are impossible: rank 0 reads it, every rank loads that.

Two real gloo processes, each pointed at its own folder, as ranks on two hosts with a local
output folder would be. Rank 1's folder holds an older checkpoint of the same job (or none);
both ranks must resume rank 0's epoch with rank 0's weights and optimizer state.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from prefect_ddp.tasks.data.storage import save_torch
from prefect_ddp.tasks.gang import free_port, process_group
from prefect_ddp.tasks.training.checkpoints import CheckpointMismatch, TrainingState
from tests.support.rank_processes import start_ranks

FINGERPRINT = {"classes": ["a", "b"], "split_digest": "d", "model": {}, "recipe": {}}


def tiny_state(seed: int) -> TrainingState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return TrainingState(model, optimizer, None, torch.amp.GradScaler("cpu", enabled=False))


def write_checkpoint(folder: Path, seed: int, epoch: int, fingerprint: dict) -> None:
    state = tiny_state(seed)
    state.model(torch.ones(4, 3)).sum().backward()
    state.optimizer.step()  # momentum buffers: optimizer state worth agreeing on
    save_torch(str(folder / "checkpoint.pt"),
               state.snapshot(epoch, [{"epoch": e + 1} for e in range(epoch + 1)], fingerprint, world_size=2), {})


def resume_as_rank(rank: int, tmp_path: Path, port: int) -> None:
    with process_group(backend="gloo", rank=rank, world_size=2, master_addr="127.0.0.1",
                       master_port=port, timeout=timedelta(seconds=60)):
        state = tiny_state(seed=100 + rank)  # each rank starts from weights of its own
        try:
            resumed = state.resume(str(tmp_path / f"rank{rank}" / "checkpoint.pt"), {}, FINGERPRINT,
                                   world_size=2, scale_lr=False)
            epoch, history = resumed.next_epoch, resumed.history
        except CheckpointMismatch as exc:
            outcome = {"refused": str(exc)}
        else:
            momentum = state.optimizer.state_dict()["state"][0]["momentum_buffer"]
            outcome = {"epoch": epoch, "history": history, "weight": state.model.weight.tolist(),
                       "momentum": momentum.tolist()}
    (tmp_path / f"outcome{rank}.json").write_text(json.dumps(outcome))


def resume_on_two_ranks(tmp_path: Path) -> list[dict]:
    start_ranks(resume_as_rank, (tmp_path, free_port()), 2)
    return [json.loads((tmp_path / f"outcome{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("rank1_has", ["an older checkpoint", "nothing"])
def test_every_rank_resumes_what_rank_0_read(tmp_path, rank1_has):
    write_checkpoint(tmp_path / "rank0", seed=1, epoch=2, fingerprint=FINGERPRINT)
    (tmp_path / "rank1").mkdir()
    if rank1_has == "an older checkpoint":
        write_checkpoint(tmp_path / "rank1", seed=2, epoch=0, fingerprint=FINGERPRINT)
    rank0, rank1 = resume_on_two_ranks(tmp_path)
    assert rank0["epoch"] == rank1["epoch"] == 3
    assert rank0["history"] == rank1["history"] == [{"epoch": 1}, {"epoch": 2}, {"epoch": 3}]
    written = torch.load(tmp_path / "rank0" / "checkpoint.pt", weights_only=True)
    assert rank0["weight"] == rank1["weight"] == written["model"]["weight"].tolist()
    assert rank0["momentum"] == rank1["momentum"] == written["optimizer"]["state"][0]["momentum_buffer"].tolist()


def test_another_jobs_checkpoint_is_refused_on_every_rank(tmp_path):
    write_checkpoint(tmp_path / "rank0", seed=1, epoch=2, fingerprint={**FINGERPRINT, "classes": ["x"]})
    (tmp_path / "rank1").mkdir()  # on its own, rank 1 would have started afresh
    outcomes = resume_on_two_ranks(tmp_path)
    assert all("belongs to another job" in outcome.get("refused", "") for outcome in outcomes), outcomes
