"""timm's models as backbones: `model.backbone="timm/NAME"`, with the optional `timm` extra.

NAME is a timm architecture (`convnext_tiny`), or one with a pretrained tag
(`convnext_tiny.fb_in22k`); the tag chooses the weights `model.weights="DEFAULT"` downloads and
the preprocessing they were made with (timm's pretrained config: crop_pct, interpolation,
mean, std). Without a tag, timm's default tag for the architecture. A state_dict or
safetensors URI in `model.weights` is taken to hold the weights of the named tag: its
preprocessing is that tag's. Random init keeps torchvision's usual preprocessing, as for
torchvision's models (docs/models.md, "timm").

timm is imported only when a `timm/` name is used (`backbone_names.timm_module`): it is an
optional extra, and takes seconds to import.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prefect_ddp.tasks.backbone_names import is_timm, timm_module, timm_name
from prefect_ddp.tasks.data.preprocessing import Preprocessing

# The file timm's own Hugging Face repositories hold the weights in, where the config names none.
HF_WEIGHTS_FILE = "model.safetensors"


def pretrained_config(backbone: str, weights: str | None) -> Any:
    """timm's pretrained config of the weights `weights` names for `backbone`: None for random init
    (and a URI, which is not named); refused when timm knows no weights for it, or for another name."""
    if weights is None:
        return None
    if weights != "DEFAULT":
        raise ValueError(
            f"model.weights={weights!r} for {backbone}: a timm model's weights are chosen by its name's tag "
            "(timm/convnext_tiny.fb_in22k). Use DEFAULT (the tag's weights, downloaded), a state_dict or "
            "safetensors URI (s3://... or a local path), or leave it empty for random init."
        )
    config = timm_module().models.get_pretrained_cfg(timm_name(backbone))
    if config is None or not (config.hf_hub_id or config.url):
        raise ValueError(f"timm has no pretrained weights for {backbone}: leave model.weights empty for random "
                         "init, or give a state_dict URI.")
    return config


def weights_url(config: Any) -> str:
    """Where timm's pretrained `config` downloads its weights from: its Hugging Face file, else its url.

    >>> from types import SimpleNamespace as Cfg
    >>> weights_url(Cfg(hf_hub_id="timm/resnet18.a1_in1k", hf_hub_filename=None, url="https://x/r.pth"))
    'https://huggingface.co/timm/resnet18.a1_in1k/resolve/main/model.safetensors'
    >>> weights_url(Cfg(hf_hub_id=None, hf_hub_filename=None, url="https://x/r.pth"))
    'https://x/r.pth'
    """
    if config.hf_hub_id:
        repository, _, revision = config.hf_hub_id.partition("@")
        return (f"https://huggingface.co/{repository}/resolve/{revision or 'main'}/"
                f"{config.hf_hub_filename or HF_WEIGHTS_FILE}")
    return str(config.url)


def weights_folder(config: Any) -> Path:
    """The cache folder of one pretrained config's weights: their file names repeat between models."""
    return Path(torch.hub.get_dir()) / "checkpoints" / "timm" / f"{config.architecture}.{config.tag}"


def timm_model(backbone: str, weights_file: Path | None, side: int | None, drop_path: float | None = None) -> nn.Module:
    """timm's `backbone` as pretrained (its 1000 or so classes), its weights read from `weights_file`
    (None: random init), built for images of `side` where its family is built for one side (timm
    resizes a ViT's position embeddings to it), its drop-path rate `drop_path` (None: its builder's,
    0 for most, 0.1-0.2 for a few families such as FasterNet and Next-ViT)."""
    timm, name = timm_module(), timm_name(backbone)
    config = timm.models.get_pretrained_cfg(name)
    sized = bool(side) and config is not None and config.fixed_input_size
    keywords: dict[str, Any] = ({"img_size": side} if sized else {}) | ({"drop_path_rate": drop_path} if drop_path is not None else {})
    if weights_file is not None:
        keywords |= {"pretrained": True, "pretrained_cfg_overlay": {"file": str(weights_file)}}
    return timm.create_model(name, **keywords)


def is_timm_model(model: nn.Module) -> bool:
    """Whether timm built `model`: timm sets a pretrained config on every model it creates."""
    return isinstance(getattr(model, "pretrained_cfg", None), dict) and hasattr(model, "reset_classifier")


def timm_head_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The state_dict prefixes of a timm model's classifier heads (two for a distilled DeiT)."""
    heads = model.get_classifier()  # type: ignore[operator]
    heads = heads if isinstance(heads, tuple) else (heads,)
    return tuple(f"{path}." for path, module in model.named_modules() if any(module is head for head in heads))


def timm_fitted_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` as timm fits pretrained weights to `model`: its family's own `checkpoint_filter_fn`
    (position embeddings resized to the model's side, keys of the original releases renamed)."""
    fit: Callable[..., dict[str, torch.Tensor]] | None = getattr(sys.modules[type(model).__module__],
                                                                 "checkpoint_filter_fn", None)
    return fit(state, model) if fit else state


def timm_preprocessing(backbone: str) -> Preprocessing:
    """The preprocessing of the weights `backbone`'s tag names (timm's pretrained config).

    Validation's crop is always the centre: the few weights whose config says `squash` or
    `border` are validated as their centre crop (docs/models.md, "timm")."""
    config = timm_module().models.get_pretrained_cfg(timm_name(backbone))
    if config is None:
        return Preprocessing()
    return Preprocessing(resize_per_crop=1 / config.crop_pct, interpolation=config.interpolation,
                         mean=tuple(config.mean), std=tuple(config.std))
