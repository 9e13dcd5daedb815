"""GPU tier: runs where CUDA is present (the lent H100/H200 machine); elsewhere the `gpu`
tests skip (tests/conftest.py)."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.device_batches import ToDevice
from prefect_ddp.tasks.training.model import build_model
from prefect_ddp.tasks.training.optimization import build_optimizer
from prefect_ddp.tasks.training.passes import evaluate, train_one_epoch
from prefect_ddp.tasks.training.step_times import PARTS, StepClock


def tiny_loader(device_batches=3):
    """Batches of 4 random 32 px images, in a DataLoader as the recipe gets (it reads `len()`
    and `.dataset` of its loader)."""
    images, labels = torch.rand(4 * device_batches, 3, 32, 32), torch.randint(0, 3, (4 * device_batches,))
    return DataLoader(TensorDataset(images, labels), batch_size=4)


# GradScaler starts at a scale of 2**16; while the scaled gradients overflow float16 it skips
# the step and halves the scale, so a float16 run's first steps may all be skipped (3 were,
# on an H200). What float16 training must do: leave the weights alone on a skipped step,
# find a scale within a bounded number of steps, and then move the weights.
MAX_STEPS_TO_FIND_A_SCALE = 24  # 2**16 halved 24 times is 2**-8: gradients still inf there are broken


def parameters_of(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.unit
@pytest.mark.gpu
@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16])
def test_amp_training_step_on_cuda_updates_weights(amp_dtype):
    device = torch.device("cuda:0")
    # Module.to's documented forms take a device or a memory_format, not both in one call.
    model = build_model(ModelConfig(backbone="resnet18"), 3).to(device).to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model, TrainingConfig(), world_size=1)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    inputs = ToDevice(device, channels_last=True)
    skipped = []
    for _ in range(MAX_STEPS_TO_FIND_A_SCALE):
        before, fc_before, scale = parameters_of(model), model.fc.weight.detach().clone(), scaler.get_scale()
        sums = train_one_epoch(model, tiny_loader(device_batches=1), optimizer, scaler, inputs, amp_dtype)
        loss_sum, _, count = sums.sums()
        assert count == 4 and torch.isfinite(torch.tensor(loss_sum))
        after = parameters_of(model)
        if scaler.is_enabled() and scaler.get_scale() < scale:  # inf/nan found: the step was skipped
            assert all(torch.equal(b, a) for b, a in zip(before, after)), f"a skipped step at scale {scale} moved weights"
            skipped.append(scale)
            continue
        assert not torch.equal(fc_before, model.fc.weight.detach()), f"a step taken at scale {scale} left fc.weight as it was"
        assert all(torch.isfinite(a).all() for a in after)
        break
    else:
        pytest.fail(f"{amp_dtype}: every one of {MAX_STEPS_TO_FIND_A_SCALE} steps was skipped, the scale halved "
                    f"from {skipped[0]:g} to {scaler.get_scale():g}: the gradients are inf/nan at any scale")
    if amp_dtype == torch.bfloat16:
        assert skipped == []  # no scaler: bfloat16 has float32's range
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
