"""Whether a backbone takes the run's image side, told before any cluster starts.

torchvision's classifiers differ in the sides they take: a ViT multiples of its patch (built for
the side, prefect_ddp.tasks.training.model.SIDE_KEYWORDS), MaxViT multiples of 224, Inception v3
75 px and more, AlexNet 64, SqueezeNet 24, most others 16. A run whose `training.image_size` its
backbone cannot take failed in every rank's first step, after the data check and the gang's
start. So the flow builds the backbone first, for that side, with its parameters and buffers on
the meta device (shapes without memory or initialisation: the largest torchvision classifier
holds 644M parameters) and runs one forward of a meta image of that side through it.

`torch.device("meta")` alone cannot build them all (RegNet computes its widths with tensors and
reads them back), so the parameters and buffers are moved to the meta device as each module
registers them, in the building thread only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from prefect_ddp.tasks.training.model import backbone_model

# The sides offered when the one given does not fit: common crops, and each family's own.
SIDES_TRIED = (32, 64, 96, 128, 160, 192, 224, 256, 299, 320, 384, 448, 512)

_building = threading.local()
_install_lock = threading.Lock()
_installed = 0
_originals: dict[str, Any] = {}


def _register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    if param is not None and getattr(_building, "on_meta", False):
        param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    _originals["register_parameter"](module, name, param)


def _register_buffer(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
    if tensor is not None and getattr(_building, "on_meta", False):
        tensor = tensor.to("meta")
    _originals["register_buffer"](module, name, tensor, persistent)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules this thread builds inside hold their parameters and buffers on the meta device;
    other threads build as ever."""
    global _installed
    with _install_lock:
        if _installed == 0:
            _originals.update(register_parameter=nn.Module.register_parameter,
                              register_buffer=nn.Module.register_buffer)
            nn.Module.register_parameter = _register_parameter  # type: ignore[method-assign,assignment]
            nn.Module.register_buffer = _register_buffer  # type: ignore[method-assign,assignment]
        _installed += 1
    outer = getattr(_building, "on_meta", False)
    _building.on_meta = True
    try:
        yield
    finally:
        _building.on_meta = outer
        with _install_lock:
            _installed -= 1
            if _installed == 0:
                nn.Module.register_parameter = _originals["register_parameter"]  # type: ignore[method-assign]
                nn.Module.register_buffer = _originals["register_buffer"]  # type: ignore[method-assign]


def meta_model(backbone: str, side: int | None = None, drop_path: float | None = None) -> nn.Module:
    """`backbone` as training builds it for `side`, with its parameters and buffers on the meta
    device, in eval mode."""
    with parameters_on_meta():
        return backbone_model(backbone, None, side, drop_path).eval()


def side_problem(backbone: str, side: int) -> str | None:
    """Why `backbone`, built for `side`, cannot classify square images of `side` pixels, or None when it can."""
    try:
        with torch.no_grad():
            scores = meta_model(backbone, side)(torch.empty(1, 3, side, side, device="meta"))
    except Exception as error:  # noqa: BLE001 - torchvision's asserts and the shape errors of its layers
        return f"{type(error).__name__}: {' '.join(str(error).split())}"  # on one line: MaxViT's spans two
    if not isinstance(scores, torch.Tensor) or scores.ndim != 2:  # a timm image encoder: features per patch
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        return f"it gives {shape} per image, not one score per class: it is not a classifier"
    return None


def require_input_side(backbone: str, side: int) -> None:
    """Refuse a backbone and image side that do not go together, naming the sides that do."""
    problem = side_problem(backbone, side)
    if problem is None:
        return
    sides = [tried for tried in SIDES_TRIED if side_problem(backbone, tried) is None]
    raise ValueError(
        f"model.backbone={backbone!r} cannot take training.image_size={side} ({problem}). "
        f"Of {', '.join(map(str, SIDES_TRIED))} it takes {', '.join(map(str, sides)) or 'none'}: set "
        "training.image_size to one of them, or choose another backbone."
    )


def require_drop_path(backbone: str, drop_path: float | None) -> None:
    """Refuse a drop-path rate for a backbone built without drop-path (torchvision's families
    without stochastic depth, timm's models that take no `drop_path_rate`)."""
    if drop_path is None:
        return
    try:
        meta_model(backbone, None, drop_path)
    except TypeError as error:  # timm passes the keyword on to a model that takes none
        raise ValueError(f"training.drop_path={drop_path} for {backbone}, which timm builds without drop-path "
                         f"({error}). Leave it empty.") from None
