"""One pass over a loader, as torchvision's reference `train.py` has them: `train_one_epoch`
and `evaluate`, knowing batches and steps and nothing of the gang around them.

An image that turns out unreadable when a loader reads it (gone, or not decoding) holds its
place in its batch as a stand-in (tasks/data/dataset.py) that the loss and the counts mask
out (`readable_loss`), and is counted against data.max_unreadable_fraction
(tasks/training/unreadable.py). The loops do not care about world size: at world size 1 there
is no process group and the wrappers do nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import closing, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader

from prefect_ddp.tasks.data.device_batches import ToDevice
from prefect_ddp.tasks.training.optimization import Warmup, keep_frozen_in_eval
from prefect_ddp.tasks.training.pass_sums import PassSums
from prefect_ddp.tasks.training.step_knobs import Accumulation, StepKnobs
from prefect_ddp.tasks.training.step_times import StepClock


def readable_loss(logits: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor | None = None,
                  label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the batch's readable images, and how many there are.

    Stand-ins for unreadable images (negative labels, tasks/data/dataset.py) add nothing. They are
    masked, not cut out of the batch: no device sync, and a batch with none readable keeps
    its graph, so its zero loss still runs backward, and DDP's gradient all-reduce with it.
    `targets`: soft targets (class probabilities, MixUp's and CutMix's) to take instead of the
    labels; `label_smoothing` as `cross_entropy` takes it (training's only: validation's loss stays
    plain cross-entropy, so that val_loss compares between runs with other knobs).
    """
    readable = labels >= 0
    losses = nn.functional.cross_entropy(logits, labels.clamp(min=0) if targets is None else targets,
                                         reduction="none", label_smoothing=label_smoothing)
    return torch.where(readable, losses, 0).sum(), readable.sum()


def train_one_epoch(
    model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler, inputs: ToDevice, amp_dtype: torch.dtype | None,
    on_step: Callable[[int, int], None] | None = None, clock: StepClock | None = None,
    warmup: Warmup | None = None, frozen: Sequence[nn.Module] = (), sums: PassSums | None = None,
    batches: Iterable[Any] | None = None, knobs: StepKnobs = StepKnobs(), average: AveragedModel | None = None,
    on_batch: Callable[[int, int], None] | None = None,
) -> PassSums:
    """One pass over this rank's shard; returns the rank's local sums.

    `inputs` puts each batch of images on the rank's device (decoding it there when the
    loader hands over encoded images); `amp_dtype` None trains in full precision.
    `on_step(done, total)` is called after every optimizer step (`done`: the batches so far), for
    progress reports, positions and boundaries; `on_batch(done, total)` after every other batch (those
    an accumulated step takes before its last), for heartbeats.
    `clock` is cut at each part of the step (tasks/training/step_times.py); the
    final mark counts the wait that ends the pass, so its parts add up to the pass.
    `warmup` scales each step's learning rate while it lasts; the BatchNorm layers in
    `frozen` stay in eval mode (tasks/training/optimization.py). `sums`: where to
    add the pass's sums (a new PassSums by default), for a caller that reads them mid-pass.
    `batches`: the loader's batches for this pass where the caller began them (an epoch started
    ahead, tasks/data/epoch_ahead.py); the loader's own otherwise. `knobs`: mixed batches, label
    smoothing and gradient clipping (tasks/training/step_knobs.py); train accuracy counts the
    logits' argmax against each image's own label, mixed batches' too. `average`: the weights'
    moving average, moved after every step (tasks/training/weights_average.py).
    The loss is the mean over the batch's readable images; a batch with none still steps,
    with a zero loss: which batches hold readable images differs between ranks, and a rank
    that skipped its step would leave the others waiting in DDP's all-reduce.
    """
    model.train()
    keep_frozen_in_eval(frozen)
    sums = sums if sums is not None else PassSums()
    clock = clock or StepClock(inputs.device)
    clock.start()
    with closing(inputs.batches(loader if batches is None else batches)) as on_device:
        for step, (images, labels) in enumerate(on_device, start=1):
            images, targets = knobs.mixed(images, labels)
            clock.mark("data")
            group = Accumulation.of(step, len(loader), knobs.accumulate_steps)
            # DDP all-reduces the gradients in the backward of a group's last batch only (its `no_sync` before).
            with model.no_sync() if isinstance(model, DistributedDataParallel) and not group.last else nullcontext():
                with torch.autocast(inputs.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    logits = model(images)
                    loss_sum, readable = readable_loss(logits, labels, targets, knobs.label_smoothing)
                clock.mark("forward")
                if group.first:
                    optimizer.zero_grad(set_to_none=True)
                loss = loss_sum / readable.clamp(min=1)
                scaler.scale(loss / group.size if group.size > 1 else loss).backward()
            clock.after_backward()
            if group.last:
                knobs.clip(model.parameters(), optimizer, scaler)
                if warmup:
                    warmup.before_step(optimizer, group.size)
                scaler.step(optimizer)
                scaler.update()
                if average is not None:
                    average.update_parameters(getattr(model, "module", model))  # DDP's wrapped model, or the model
                clock.mark("optimizer")
            sums.add(loader, logits, labels, loss_sum, readable)
            if group.last:  # positions and boundaries fall between optimizer steps only
                if on_step:
                    on_step(step, len(loader))
            elif on_batch:
                on_batch(step, len(loader))
            clock.mark("other")
    clock.mark("data")  # the wait for the loader to say the pass is over
    if warmup:
        warmup.end_epoch(optimizer)
    return sums


@torch.inference_mode()
def evaluate(model: nn.Module, loader: DataLoader, inputs: ToDevice,
             on_batch: Callable[[int, int], None] | None = None) -> PassSums:
    """This rank's shard of the val set, in full precision; returns the rank's local sums.

    `on_batch(done, total)` is called after every batch, for progress reports: a pass over
    a large validation set lasts far longer than a rank may be silent (tasks/training/epoch.py, `validate`).
    """
    model.eval()
    sums = PassSums()
    with closing(inputs.batches(loader)) as on_device:
        for done, (images, labels) in enumerate(on_device, start=1):
            logits = model(images)
            sums.add(loader, logits, labels, *readable_loss(logits, labels))
            if on_batch:
                on_batch(done, len(loader))
    return sums
