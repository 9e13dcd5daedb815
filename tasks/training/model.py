"""torchvision backbones with a new classifier head, and the saved model format.

A saved model is two files side by side: `model.pt` (the state_dict, loaded with
weights_only=True) and `model.json` (backbone, classes and preprocessing), so that
`load_model` can rebuild it without trusting pickled code from storage.
"""

from __future__ import annotations

from typing import Any

import torch
import torchvision
from prefect import task
from pydantic import BaseModel
from torch import nn

from prefect_ddp.tasks.config import BACKBONES, ModelConfig
from prefect_ddp.tasks.data.dataset import IMAGENET_MEAN, IMAGENET_STD
from prefect_ddp.tasks.data.storage import exists, load_torch
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.retries import retry_transient

# A saved model's files, in the order they are copied: the card last, so a copy that has it is whole.
SAVED_MODEL_FILES = ("model.pt", "model.json")


def classifier_path(model: nn.Module) -> tuple[nn.Module, str]:
    """The module holding the final Linear layer and that layer's attribute name.

    resnets end in `fc`; mobilenet_v3 and efficientnet in `classifier[-1]`.
    """
    if isinstance(getattr(model, "fc", None), nn.Linear):
        return model, "fc"
    classifier = getattr(model, "classifier", None)
    if isinstance(classifier, nn.Sequential) and isinstance(classifier[-1], nn.Linear):
        return classifier, str(len(classifier) - 1)
    raise ValueError(f"Cannot find the classifier head of {type(model).__name__}.")


def replace_head(model: nn.Module, num_classes: int) -> nn.Linear:
    parent, name = classifier_path(model)
    old: nn.Linear = getattr(parent, name)
    head = nn.Linear(old.in_features, num_classes)
    setattr(parent, name, head)
    return head


def head_prefix(model: nn.Module) -> str:
    parent, name = classifier_path(model)
    return "fc." if parent is model else f"classifier.{name}."


def _torchvision_weights(backbone: str, weights: str | None) -> Any:
    if weights is None:
        return None
    try:
        return torchvision.models.get_model_weights(backbone)[weights.split(".")[-1]]
    except KeyError:
        allowed = [w.name for w in torchvision.models.get_model_weights(backbone)] + ["DEFAULT"]
        raise ValueError(
            f"Unknown weights {weights!r} for {backbone}: use one of {allowed}, a state_dict "
            "URI (s3://... or a local .pt path), or leave it empty for random init."
        ) from None


def is_state_dict_uri(weights: str | None) -> bool:
    return bool(weights) and ("://" in weights or weights.endswith((".pt", ".pth")))


def build_model(
    config: ModelConfig, num_classes: int, storage_options: dict[str, Any] | None = None
) -> nn.Module:
    """The backbone with starting weights loaded and a head for `num_classes`."""
    if config.backbone not in BACKBONES:
        raise ValueError(f"Unknown backbone {config.backbone!r}; supported: {', '.join(BACKBONES)}.")
    uri = config.weights if is_state_dict_uri(config.weights) else None
    weights = None if uri else _torchvision_weights(config.backbone, config.weights)
    model = torchvision.models.get_model(config.backbone, weights=weights)
    replace_head(model, num_classes)
    if uri:
        load_backbone_state(model, load_starting_weights(uri, storage_options or {}), uri)
    if config.freeze_backbone:
        prefix = head_prefix(model)
        for name, param in model.named_parameters():
            param.requires_grad = name.startswith(prefix)
    return model


def load_starting_weights(uri: str, storage_options: dict[str, Any]) -> dict[str, torch.Tensor]:
    if not exists(uri, storage_options):
        raise FileNotFoundError(
            f"model.weights points at {uri}, which does not exist. Give the URI of a state_dict "
            "saved with torch.save(model.state_dict(), ...), a torchvision weights name "
            "(DEFAULT), or leave it empty for random init."
        )
    return load_torch(uri, storage_options)


@task(name="check-model", retries=2, retry_delay_seconds=10, retry_condition_fn=retry_transient)
def check_starting_weights(config: ModelConfig, num_classes: int, location: Location) -> None:
    """Fail before the data check and training when the starting weights are missing or do not fit.

    A state_dict URI is loaded into the backbone here, once; a torchvision weights name is
    only checked by name (downloading it is the ranks' job).
    """
    if is_state_dict_uri(config.weights):
        build_model(config, num_classes, location.storage_options())
    else:
        _torchvision_weights(config.backbone, config.weights)


def load_backbone_state(model: nn.Module, state: dict[str, torch.Tensor], uri: str) -> None:
    """Load a backbone's state_dict, ignoring its head (trained for other classes)."""
    prefix = head_prefix(model)
    body = {k: v for k, v in state.items() if not k.startswith(prefix)}
    missing, unexpected = model.load_state_dict(body, strict=False)
    missing = [k for k in missing if not k.startswith(prefix)]
    if missing or unexpected:
        raise ValueError(
            f"The state_dict at {uri} does not fit this backbone: {len(missing)} missing keys "
            f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}). "
            "Save it from the same torchvision model (torch.save(model.state_dict(), ...))."
        )


def model_card(config: ModelConfig, classes: list[str], image_size: int) -> dict[str, Any]:
    """What `load_model` needs besides the weights; written as model.json."""
    return {
        "backbone": config.backbone,
        "classes": classes,
        "image_size": image_size,
        "mean": IMAGENET_MEAN,
        "std": IMAGENET_STD,
    }


def load_model(card: dict[str, Any], state: dict[str, torch.Tensor]) -> nn.Module:
    """Rebuild a trained classifier from its model card and state_dict, in eval mode."""
    model = torchvision.models.get_model(card["backbone"], weights=None)
    replace_head(model, len(card["classes"]))
    model.load_state_dict(state)
    return model.eval()


class WarmStart(BaseModel):
    """The kept model a run starts from: where its weights are and whether its head fits."""

    model: Location  # url: versions/RUN/model.pt (or a registered model's copy), with the output's credentials
    with_head: bool
    origin: str  # for the report: "run `NAME`" or the registered model's URI


def load_warm_start(model: nn.Module, warm: WarmStart) -> None:
    """Load the kept weights: all of them when the classes match, else all but the head."""
    state = load_torch(warm.model.url, warm.model.storage_options())
    if warm.with_head:
        model.load_state_dict(state)
    else:
        load_backbone_state(model, state, warm.model.url)
