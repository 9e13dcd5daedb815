"""What the chosen backbone must take of the training recipe, checked before any cluster starts.

Each check refuses a `training` value the backbone cannot train with, naming what it takes:
the image side (tasks/training/input_side.py), a drop-path rate (families without drop-path),
layer-wise decay (timm's models only). The flow runs them for its backbone; a sweep for every
backbone its space may draw against every value of the field it may draw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.training.input_side import require_drop_path, require_input_side
from prefect_ddp.tasks.training.optimization import require_layer_decay

# training's field -> the check of a backbone and a value of it.
BACKBONE_CHECKS: dict[str, Callable[[str, Any], None]] = {
    "image_size": require_input_side,
    "drop_path": require_drop_path,
    "layer_decay": require_layer_decay,
}


def require_backbone_takes(backbone: str, training: TrainingConfig) -> None:
    """Refuse the first of `training`'s values that `backbone` cannot train with."""
    for field, check in BACKBONE_CHECKS.items():
        check(backbone, getattr(training, field))
