"""training.ema_decay: the weights' moving average, validated beside the model each epoch and kept
when it did better (tasks/training/weights_average.py).

What it decides for the user is which weights ship: model.pt must hold exactly the weights the
epoch's record names, on a real gang too, and a resumed or handed-over run must go on from the
same average.
"""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.splitting import stratified_split
from prefect_ddp.tasks.gang import RankContext, free_port
from prefect_ddp.tasks.selection import Selection
from prefect_ddp.tasks.training.best_weights import BestWeights
from prefect_ddp.tasks.training.boundary import EpochEnd
from prefect_ddp.tasks.training.checkpoints import TrainingState
from prefect_ddp.tasks.training.job import RunFiles, TrainJob
from prefect_ddp.tasks.training.weights_average import weights_average
from tests.support.image_folders import local_image_folder
from tests.support.rank_processes import start_ranks
from tests.support.two_ranks import train_as_rank


def tiny_job(tmp_path, **training) -> TrainJob:
    manifest = local_image_folder(tmp_path / "images", per_class=4)
    return TrainJob(source=DataLocation(url=str(tmp_path / "images")), output=DataLocation(url=str(tmp_path / "out")),
                    manifest=manifest, split=stratified_split(manifest, 0.25, 0), model=ModelConfig(),
                    training=TrainingConfig(**{"epochs": 1, "batch_size": 2, "image_size": 32, "num_workers": 0,
                                               "ema_decay": 0.5} | training))


def state_with_average(decay: float = 0.9) -> TrainingState:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainingState(model, optimizer, None, torch.amp.GradScaler("cpu", enabled=False),
                         weights_average(model, decay))


def step(state: TrainingState) -> None:
    state.optimizer.zero_grad()
    state.model(torch.randn(8, 3)).square().sum().backward()
    state.optimizer.step()
    assert state.average is not None
    state.average.update_parameters(state.model)


@pytest.mark.unit
def test_the_average_moves_one_minus_decay_of_the_way_after_each_step_and_none_without_a_decay():
    assert weights_average(nn.Linear(2, 2), None) is None
    state = state_with_average(decay=0.75)
    step(state)  # the first update takes the weights as they are
    before = state.average.module[0].weight.detach().clone()
    step(state)
    expected = 0.75 * before + 0.25 * state.model[0].weight.detach()
    assert torch.allclose(state.average.module[0].weight, expected)
    with pytest.raises(ValidationError):
        TrainingConfig(ema_decay=1)


@pytest.mark.unit
@pytest.mark.parametrize("kept", ["ema", "model"])
def test_the_best_epoch_keeps_the_weights_its_record_names(kept, tmp_path):
    state = state_with_average()
    step(state), step(state)
    assert not torch.equal(state.average.module[0].weight, state.model[0].weight)
    ctx = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo", device="cpu",
                      worker_address="local", master_addr="127.0.0.1", master_port=0)
    best = BestWeights(ctx, state.model, RunFiles.of(tiny_job(tmp_path), {}), Selection(), state.average)
    best.after_epoch(EpochEnd(0, [{"epoch": 1, "val_acc": 0.5, "weights": kept}], last=True))
    held = best.unwritten(None)
    assert held is not None
    source = state.average.module if kept == "ema" else state.model
    assert all(torch.equal(held[1][name], tensor) for name, tensor in source.state_dict().items())


@pytest.mark.unit
def test_a_checkpoint_carries_the_average_and_a_resumed_state_goes_on_from_it():
    state = state_with_average()
    step(state), step(state)
    snapshot = state.snapshot(1, [{"epoch": 1}], {"job": 1}, world_size=1)
    buffer = io.BytesIO()
    torch.save(snapshot, buffer)
    resumed = state_with_average()
    resumed.resume("memory://checkpoint.pt", {}, {"job": 1}, world_size=1, scale_lr=False, handed=buffer.getvalue())
    assert resumed.average is not None and int(resumed.average.n_averaged) == 2
    assert all(torch.equal(resumed.average.state_dict()[name], tensor) for name, tensor in state.average.state_dict().items())


def test_on_two_gloo_ranks_each_epoch_validates_both_and_model_pt_holds_the_weights_it_names(tmp_path):
    job = tiny_job(tmp_path, epochs=1)
    start_ranks(train_as_rank, (free_port(), {"ema": job}, tmp_path, ("history", "best_epoch")), 2)
    record = json.loads((tmp_path / "rank0.json").read_text())["ema"]["history"][0]
    assert record["weights"] in ("ema", "model") and all(
        math.isfinite(record[key]) for key in ("model_val_acc", "ema_val_acc", "model_val_loss", "ema_val_loss"))
    assert (record["val_acc"], record["val_loss"]) == (record[f"{record['weights']}_val_acc"],
                                                       record[f"{record['weights']}_val_loss"])
    files = RunFiles.of(job, {})
    checkpoint = torch.load(files.checkpoint, weights_only=True)
    kept = (checkpoint["model"] if record["weights"] == "model" else
            {name.removeprefix("module."): tensor for name, tensor in checkpoint["average"].items() if name != "n_averaged"})
    shipped = torch.load(files.model, weights_only=True)
    assert shipped.keys() == kept.keys() and all(torch.equal(shipped[name], kept[name]) for name in kept)
