"""GPU tier: runs where CUDA is present (the lent H100/H200 machine); elsewhere the `gpu`
tests skip (tests/conftest.py)."""

import pytest
import torch

from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.device_batches import ToDevice
from prefect_ddp.tasks.training.model import build_model
from prefect_ddp.tasks.training.optimization import build_optimizer
from prefect_ddp.tasks.training.recipe import evaluate, train_one_epoch
from prefect_ddp.tasks.training.step_times import PARTS, StepClock


def tiny_loader(device_batches=3):
    return [(torch.rand(4, 3, 32, 32), torch.randint(0, 3, (4,))) for _ in range(device_batches)]


@pytest.mark.unit
@pytest.mark.gpu
@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16])
def test_amp_training_step_on_cuda_updates_weights(amp_dtype):
    device = torch.device("cuda:0")
    model = build_model(ModelConfig(backbone="resnet18"), 3).to(device, memory_format=torch.channels_last)
    before = model.fc.weight.detach().clone()
    optimizer = build_optimizer(model, TrainingConfig(), world_size=1)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    inputs = ToDevice(device, channels_last=True)
    sums = train_one_epoch(model, tiny_loader(), optimizer, scaler, inputs, amp_dtype)
    assert sums.count == 12 and torch.isfinite(torch.tensor(sums.loss_sum))
    assert not torch.equal(before, model.fc.weight.detach())
    assert evaluate(model, tiny_loader(), inputs).count == 12


@pytest.mark.unit
@pytest.mark.gpu
def test_the_step_clock_reads_the_device_timeline_on_cuda():
    device = torch.device("cuda:0")
    model = build_model(ModelConfig(backbone="resnet18"), 3).to(device)
    optimizer = build_optimizer(model, TrainingConfig(), world_size=1)
    clock = StepClock(device)
    started = torch.cuda.Event(enable_timing=True)
    ended = torch.cuda.Event(enable_timing=True)
    started.record()
    train_one_epoch(model, tiny_loader(), optimizer, torch.amp.GradScaler("cuda", enabled=False),
                    ToDevice(device), None, clock=clock)
    ended.record()
    ended.synchronize()
    parts = clock.totals()
    assert set(parts) == set(PARTS) and parts["forward"] > 0 and parts["backward"] > 0 and parts["sync"] == 0
    assert sum(parts.values()) == pytest.approx(started.elapsed_time(ended) / 1000, rel=0.05)


# Not `unit` (it starts nothing): a mobilenet epoch on the CPU, 3-8 s on 2 busy cores.
def test_the_same_loop_runs_on_cpu_without_amp():
    device = torch.device("cpu")
    model = build_model(ModelConfig(backbone="mobilenet_v3_small"), 3)
    optimizer = build_optimizer(model, TrainingConfig(optimizer="adamw", lr=1e-3), world_size=1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    sums = train_one_epoch(model, tiny_loader(), optimizer, scaler, ToDevice(device), amp_dtype=None)
    assert sums.count == 12
