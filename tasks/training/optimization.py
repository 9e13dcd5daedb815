"""The optimiser, its schedule and the normalisation layers: the recipe's defaults, decided in one place.

The defaults follow what careful fine-tuning recipes do (torchvision's reference `train.py`
offers each as an option): the learning rate is multiplied by the world size (the linear
scaling rule) only for SGD, and then warmed up linearly over the first epoch from the
unscaled rate to the scaled one (the gradual warmup of Goyal et al., which the linear
scaling rule comes with), so that a pretrained backbone does not take steps of 8x its
learning rate from step 0, and a short fine-tune does not spend its first epoch near 0; adaptive
optimizers (AdamW) keep the per-rank rate unless asked. Norm and bias parameters get no
weight decay. BatchNorm layers whose parameters do not train (a frozen backbone) stay in
eval mode, so their running statistics stay the pretrained ones. `sync_batchnorm` pools
BatchNorm's batch statistics over the gang (CUDA ranks only: torch's SyncBatchNorm).
`EffectiveRecipe` says what was decided, for the report.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from prefect_ddp.tasks.backbone_names import is_timm
from prefect_ddp.tasks.config import ModelConfig, TrainingConfig


@dataclass(frozen=True)
class EffectiveRecipe:
    """The recipe as it runs on this gang: the settings an empty field left to the defaults."""

    lr: float  # per step, after scaling
    lr_scaled_by: int  # the world size, or 1
    warmup_epochs: int
    weight_decay: float  # on weights of two or more dimensions; norm and bias parameters get none
    frozen_batchnorm: int  # BatchNorm layers kept in eval mode (their parameters do not train)
    sync_batchnorm: bool
    knobs: dict[str, float | bool] = field(default_factory=dict)  # fine-tuning knobs set (TrainingConfig.knobs_set)


def scales_lr(cfg: TrainingConfig) -> bool:
    """training.scale_lr_by_world_size, or empty: for SGD only (adaptive optimizers keep the per-rank rate)."""
    return cfg.scale_lr_by_world_size if cfg.scale_lr_by_world_size is not None else cfg.optimizer == "sgd"


def warmup_epochs(cfg: TrainingConfig, world_size: int) -> int:
    """training.warmup_epochs, or empty: one epoch whenever the learning rate is scaled up."""
    if cfg.warmup_epochs is not None:
        return cfg.warmup_epochs
    return 1 if scales_lr(cfg) and world_size > 1 else 0


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters: weights with `weight_decay`, norm and bias parameters (one
    dimension or none) without: decaying a BatchNorm scale or a bias toward zero only fights the
    normalisation."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.ndim > 1], "weight_decay": weight_decay},
              {"params": [p for p in trainable if p.ndim <= 1], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def layer_decayed_groups(model: nn.Module, weight_decay: float, layer_decay: float, lr: float) -> list[dict[str, Any]]:
    """`parameter_groups`' split, per layer of a timm model (its `group_matcher`): the head's at `lr`, each
    layer below at `layer_decay` times the rate of the one above (timm's `param_groups_layer_decay`, its
    rates set here, as torch's optimizers and schedules read a group's `lr`). Parameters timm's model names
    as taking no weight decay (a ViT's position embedding, class token) take none."""
    from timm.optim import param_groups_layer_decay

    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()  # type: ignore[operator]
    groups = param_groups_layer_decay(model, weight_decay=weight_decay, no_weight_decay_list=skip,
                                      layer_decay=layer_decay)
    return [{"params": group["params"], "weight_decay": group["weight_decay"], "lr": lr * group["lr_scale"]}
            for group in groups]


def require_layer_decay(backbone: str, layer_decay: float | None) -> None:
    """Refuse layer-wise decay for a backbone without timm's layer groups."""
    if layer_decay is not None and not is_timm(backbone):
        raise ValueError(
            f"training.layer_decay={layer_decay} for {backbone}: layer-wise decay needs timm's layer groups, which "
            "only timm's models have. Use a timm/NAME backbone (timm/vit_base_patch16_224), or leave it empty."
        )


def build_optimizer(model: nn.Module, cfg: TrainingConfig, world_size: int) -> torch.optim.Optimizer:
    lr = cfg.lr * world_size if scales_lr(cfg) else cfg.lr
    groups = (layer_decayed_groups(model, cfg.weight_decay, cfg.layer_decay, lr) if cfg.layer_decay
              else parameter_groups(model, cfg.weight_decay))
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    raise ValueError(f"Invalid optimizer {cfg.optimizer!r}. Only sgd and adamw are supported.")


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig):
    if cfg.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs)
    if cfg.scheduler == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.1, patience=2)
    if cfg.scheduler == "none":
        return None
    raise ValueError(f"Invalid scheduler {cfg.scheduler!r}. Only cosine, plateau and none are supported.")


def step_scheduler(scheduler, val_loss: float) -> None:
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(val_loss)
    elif scheduler is not None:
        scheduler.step()


class Warmup:
    """Linear warmup over the first `steps` batches of the run: the rate rises in equal steps from
    `start` of the epoch's rate (1/world size when the rate was scaled up by it: the unscaled rate)
    to all of it at the last warmup batch; the optimizer step after batch n (from 0) takes
    start + (1 - start) * (n + 1) / steps of it. An optimizer step over several batches
    (training.accumulate_steps) counts them all.

    The epoch-level schedule sets each epoch's rate; warmup scales it step by step and puts
    it back at the epoch's end (`end_epoch`, before the schedule steps), so the schedule and
    the checkpoints only ever see the epoch's own rate. `done`: the steps a resumed run
    already took.
    """

    def __init__(self, steps: int, start: float = 0.0, done: int = 0) -> None:
        self.steps = steps
        self.start = start
        self.done = done
        self._epoch_lrs: list[float] | None = None

    def before_step(self, optimizer: torch.optim.Optimizer, batches: int = 1) -> None:
        """Before the optimizer step over the next `batches` batches: their share of the rate."""
        if self.done < self.steps:
            if self._epoch_lrs is None:
                self._epoch_lrs = [group["lr"] for group in optimizer.param_groups]
            reached = min(self.done + batches, self.steps) / self.steps
            for group, lr in zip(optimizer.param_groups, self._epoch_lrs):
                group["lr"] = lr * (self.start + (1 - self.start) * reached)
        self.done += batches

    def end_epoch(self, optimizer: torch.optim.Optimizer) -> None:
        if self._epoch_lrs is not None:
            for group, lr in zip(optimizer.param_groups, self._epoch_lrs):
                group["lr"] = lr
            self._epoch_lrs = None


def frozen_batchnorm(model: nn.Module) -> list[nn.Module]:
    """The BatchNorm layers none of whose parameters train (a frozen backbone's)."""
    return [module for module in model.modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm)
            and not any(p.requires_grad for p in module.parameters())]


def keep_frozen_in_eval(layers: Sequence[nn.Module]) -> None:
    """After `model.train()`: frozen BatchNorm layers normalise with their pretrained running
    statistics and leave them unchanged, as the frozen weights expect."""
    for layer in layers:
        layer.eval()


def frozen_random_backbone(model: ModelConfig, warm_started: bool) -> str | None:
    """Why a frozen backbone with no starting weights trains poorly, or None: its BatchNorm layers,
    kept in eval mode, normalise with the initial statistics (mean 0, variance 1), which fit no
    random network's activations (bench/RESULTS.md, "Recipe defaults on real digits")."""
    if not model.freeze_backbone or model.weights or warm_started:
        return None
    return ("model.freeze_backbone=true with no model.weights (and no warm start) trains a head over a random "
            "backbone, whose BatchNorm layers stay in eval mode with their initial statistics. Set model.weights "
            "(DEFAULT, or a state_dict URI) or model.warm_start, or train the backbone too.")


def sync_batchnorm(model: nn.Module, device: torch.device, world_size: int, log: logging.Logger | Any) -> bool:
    """Convert the model's BatchNorm layers to SyncBatchNorm where it can work; whether it did."""
    if world_size == 1:
        return False
    if device.type != "cuda":
        log.warning("training.sync_batchnorm applies on CUDA ranks only (torch's SyncBatchNorm); these ranks "
                    "run on %s, so each rank's BatchNorm keeps its own batch statistics.", device.type)
        return False
    nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return True
