"""What the step-time accounting costs: the recipe's loop with its clock against the same
loop with a clock that records nothing, in one process, interleaved.

The loop is the recipe's own `train_one_epoch` on a DDP model (gloo, world size 1, so the
gradient hooks run as in a gang), resnet18 on in-memory 64 px samples: a small step, where a
fixed per-step cost shows most. Prints each variant's median epoch time and the ratio, with
a second silent baseline beside the first: the spread between the two is the noise the
ratio cannot see below. So it also times the clock's own work for one step (its marks and
one hook call per trained parameter) in a tight loop, against the median step.

    .venv/bin/python -m bench.step_times --epochs 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch
from torch.utils.data import DataLoader, TensorDataset
from torchvision.models import resnet18

from prefect_ddp.tasks.data.device_batches import ToDevice
from prefect_ddp.tasks.gang import free_port, process_group, wrap_ddp
from prefect_ddp.tasks.training.passes import train_one_epoch
from prefect_ddp.tasks.training.step_times import StepClock, time_gradient_sync

CPU = torch.device("cpu")


class SilentClock(StepClock):
    """The baseline: every mark is a no-op, and no gradient hook is registered."""

    def start(self) -> None:
        pass

    def mark(self, part: str) -> None:
        pass

    def after_backward(self) -> None:
        pass


def one_epoch(model: torch.nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer, clock: StepClock) -> float:
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    started = time.perf_counter()
    train_one_epoch(model, loader, optimizer, scaler, ToDevice(CPU), None, clock=clock)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5, help="timed epochs per variant, interleaved")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 3, 64, 64), torch.randint(0, 10, (args.samples,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    with process_group(backend="gloo", rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                       timeout=timedelta(seconds=60)):
        variants = {}
        for name, clock in (("silent clock (baseline)", SilentClock(CPU)), ("silent clock, again", SilentClock(CPU)),
                            ("step-time clock", StepClock(CPU))):
            model = wrap_ddp(resnet18(num_classes=10), CPU)
            if not isinstance(clock, SilentClock):
                time_gradient_sync(model, clock)
            variants[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01), clock, [])
        for model, optimizer, clock, _ in variants.values():  # warm-up, untimed
            one_epoch(model, loader, optimizer, clock)
        for round_ in range(args.epochs):  # alternate which goes first, so drift hits both alike
            order = list(variants.values())
            for model, optimizer, clock, times in order[::-1] if round_ % 2 else order:
                times.append(one_epoch(model, loader, optimizer, clock))
    steps = len(loader)
    baseline = statistics.median(next(iter(variants.values()))[3])
    print(f"{steps} steps per epoch, batch {args.batch_size}, medians of {args.epochs} interleaved epochs")
    print("| loop | epoch s | ms per step | x baseline |\n|---|---|---|---|")
    for name, (*_, times) in variants.items():
        median = statistics.median(times)
        print(f"| {name} | {median:.3f} | {1000 * median / steps:.1f} | {median / baseline:.4f} |")
    parameters = sum(1 for p in resnet18().parameters() if p.requires_grad)
    per_step = clock_work_per_step(parameters)
    print(f"\nthe clock's own work per step ({parameters} gradient hooks): {per_step * 1e6:.1f} us, "
          f"{per_step / (baseline / steps):.5f} of a median step")


def clock_work_per_step(parameters: int, steps: int = 2000) -> float:
    """Seconds of clock work per step: the marks and one gradient hook call per parameter."""
    clock = StepClock(CPU)
    clock.start()
    started = time.perf_counter()
    for _ in range(steps):
        clock.mark("data")
        clock.mark("forward")
        for _ in range(parameters):
            clock.gradient_ready()
        clock.after_backward()
        clock.mark("optimizer")
        clock.mark("other")
    return (time.perf_counter() - started) / steps


if __name__ == "__main__":
    main()
