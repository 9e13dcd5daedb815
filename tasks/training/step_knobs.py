"""The fine-tuning knobs that act on a training step: mixed batches (MixUp, CutMix), label
smoothing and gradient clipping (training.mixup_alpha, cutmix_alpha, label_smoothing and
clip_grad_norm; docs/models.md, "Fine-tuning knobs"). The knobs that act on each image
(trivial_augment, random_erasing) are steps of the train transform (tasks/data/dataset.py).

As torchvision's reference `train.py` has them: MixUp or CutMix on each batch (a random
choice of the two when both are on), the loss taking the soft targets they make, label
smoothing in the training loss, and clipping after backward, once a GradScaler has unscaled
the gradients. Validation is untouched: its loss stays plain cross-entropy
(tasks/training/passes.py, `evaluate`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torchvision.transforms import v2

from prefect_ddp.tasks.config import TrainingConfig


class BatchMixing:
    """MixUp and/or CutMix on a batch on the rank's device, never mixing a stand-in for an
    unreadable image (a negative label, tasks/data/dataset.py) into a readable one.

    torchvision's MixUp and CutMix mix each image with the one before it in the batch
    (`roll(1, 0)`) and draw one share per batch. A readable image whose partner is a stand-in
    would take in a copy of another image (or a blank) under a target that claims none of its
    class, so it keeps its own image and target. The check is on the device (`torch.where`),
    reading nothing back: a batch with stand-ins costs no wait. A stand-in's own row may be
    mixed: its loss is masked out anyway.

    >>> mixing = BatchMixing(num_classes=3, mixup_alpha=0.2)
    >>> images, targets = mixing(torch.rand(4, 3, 8, 8), torch.tensor([0, -1, 2, 1]))
    >>> targets[2].tolist()  # image 2's partner, image 1, is a stand-in: not mixed
    [0.0, 0.0, 1.0]
    """

    def __init__(self, num_classes: int, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0) -> None:
        choices: list[v2.Transform] = []
        if mixup_alpha > 0:
            choices.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
        if cutmix_alpha > 0:
            choices.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
        if not choices:
            raise ValueError(f"BatchMixing got mixup_alpha={mixup_alpha} and cutmix_alpha={cutmix_alpha}; "
                             "give at least one above 0 (at 0 both, train without it: StepKnobs.mixing None).")
        self.num_classes = num_classes
        self.mix: v2.Transform = choices[0] if len(choices) == 1 else v2.RandomChoice(choices)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch mixed, and each image's soft target (class probabilities, each row summing to 1)."""
        classes = labels.clamp(min=0)  # a stand-in's negative label is no class: one_hot refuses it
        mixed, targets = self.mix(images, classes)
        readable = labels >= 0
        unmixed = readable & ~readable.roll(1, 0)  # readable, with a stand-in for a partner (see above)
        own = nn.functional.one_hot(classes, self.num_classes).to(targets.dtype)
        # torch.where keeps the batch's layout (channels-last on CUDA ranks), as MixUp and CutMix do.
        return (torch.where(unmixed.view(-1, 1, 1, 1), images, mixed),
                torch.where(unmixed.view(-1, 1), own, targets))


class Accumulation(NamedTuple):
    """Where a batch stands in the optimizer step it adds its gradients to (training.accumulate_steps).

    The pass's batches go in groups of `accumulate_steps` from its first, the last group holding what
    is left; the step is taken after a group's last batch. Each batch's loss counts 1/size of the
    step's, so a step's gradient is the mean over its batches' (each one's mean over its images).

    >>> [Accumulation.of(step, total=5, every=2) for step in (1, 2, 5)]
    [Accumulation(first=True, last=False, size=2), Accumulation(first=False, last=True, size=2), Accumulation(first=True, last=True, size=1)]
    """

    first: bool  # the group's first batch: the gradients start from zero
    last: bool  # its last: the optimizer steps after it, and DDP all-reduces its gradients
    size: int  # batches in the group

    @classmethod
    def of(cls, step: int, total: int, every: int) -> Accumulation:
        """Batch `step` (from 1) of a pass of `total` batches, stepping after every `every`."""
        start = (step - 1) // every * every + 1
        size = min(every, total - start + 1)
        return cls(first=step == start, last=step == start + size - 1, size=size)


@dataclass(frozen=True)
class StepKnobs:
    """What a training step does beyond plain cross-entropy on its batch; the defaults do nothing more."""

    mixing: BatchMixing | None = None  # MixUp / CutMix: soft targets
    label_smoothing: float = 0.0  # in the training loss only
    clip_grad_norm: float | None = None  # the most total L2 norm the gradients keep
    accumulate_steps: int = 1  # batches per optimizer step

    @classmethod
    def of(cls, cfg: TrainingConfig, num_classes: int) -> StepKnobs:
        """The knobs `cfg` sets, for a model of `num_classes` outputs."""
        mixes = cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0
        return cls(mixing=BatchMixing(num_classes, cfg.mixup_alpha, cfg.cutmix_alpha) if mixes else None,
                   label_smoothing=cfg.label_smoothing, clip_grad_norm=cfg.clip_grad_norm,
                   accumulate_steps=cfg.accumulate_steps)

    def mixed(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch as the step trains on it, and its soft targets (None: the labels are the targets)."""
        return (images, None) if self.mixing is None else self.mixing(images, labels)

    def clip(self, parameters: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler) -> None:
        """Clip the gradients' total norm, after backward and before the optimizer step. Under
        float16's loss scaling the gradients are unscaled first, so that the bound is on the
        true gradients; the scaler's step then does not unscale them again."""
        if self.clip_grad_norm is None:
            return
        scaler.unscale_(optimizer)  # nothing to do where the scaler is off (full precision, bfloat16)
        nn.utils.clip_grad_norm_(parameters, self.clip_grad_norm)

