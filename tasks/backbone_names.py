"""The backbones `model.backbone` names: torchvision's classifiers, and timm's models as `timm/NAME`.

Checked when the parameters are read, before any cluster starts; torchvision and timm are
imported only then (the flows' parameters are read without torch), timm only for a `timm/` name
(an optional extra that takes seconds to import).
"""

from __future__ import annotations

import difflib
import functools
from typing import Any

TIMM_PREFIX = "timm/"


@functools.cache
def backbone_names() -> list[str]:
    """The classification models of the installed torchvision (not its detection or video models)."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def known_backbone(value: str | None) -> str | None:
    """`value` when torchvision has a classifier of that name, or timm a model of the name after `timm/`
    (or it is left empty, as a shortcut may be)."""
    if value is not None and is_timm(value):
        return known_timm_backbone(value)
    known = backbone_names()
    if value is None or value in known:
        return value
    raise ValueError(
        f"model.backbone={value!r} is not a torchvision classification model; {closest(value, known)}. Every "
        "name: torchvision.models.list_models(module=torchvision.models); timm's models as timm/NAME."
    )


def closest(name: str, known: list[str]) -> str:
    """The names in `known` closest to `name`, for an error message.

    >>> closest("resnet51", ["resnet18", "resnet50", "vgg11"]), closest("x", ["vgg11"])
    ('the closest: resnet50, resnet18', 'e.g. vgg11')
    """
    found = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
    return f"the closest: {', '.join(found)}" if found else f"e.g. {', '.join(known[:5])}"


def is_timm(backbone: str) -> bool:
    return backbone.startswith(TIMM_PREFIX)


def timm_name(backbone: str) -> str:
    """The timm model name of a `timm/NAME` backbone."""
    return backbone.removeprefix(TIMM_PREFIX)


def timm_module() -> Any:
    """timm, or an error that says how to install it."""
    try:
        import timm
    except ImportError:
        raise ValueError(
            "model.backbone names a timm model (timm/NAME), but timm is not installed here. Install the "
            "extra on the flow's machine and on every Dask worker: pip install 'prefect-ddp[timm]'."
        ) from None
    return timm


def known_timm_backbone(backbone: str) -> str:
    """`backbone` when timm has its architecture, and its pretrained tag if it names one; refused with
    the closest names otherwise."""
    timm, name = timm_module(), timm_name(backbone)
    architecture, tag = timm.models.split_model_name_tag(name)
    if not timm.is_model(architecture):
        raise ValueError(f"model.backbone={backbone!r} is not a timm model; "
                         f"{closest(backbone, timm_names(timm.list_models()))}. Every name: timm.list_models().")
    tags = timm.list_pretrained(f"{architecture}.*")
    if "." in name and name not in tags:  # an unknown tag, or none after the dot
        raise ValueError(f"timm has no weights tagged {tag!r} for {architecture}; {closest(backbone, timm_names(tags))}. "
                         f"Or give the architecture alone (timm/{architecture}) for timm's default weights.")
    return backbone


def timm_names(names: list[str]) -> list[str]:
    """timm's model names as `model.backbone` takes them."""
    return [f"{TIMM_PREFIX}{name}" for name in names]
