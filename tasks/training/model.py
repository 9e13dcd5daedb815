"""Backbones (torchvision's classifiers, timm's with the extra) with a new classifier head, and the
saved model format.

A saved model is two files side by side: `model.pt` (the state_dict, loaded with
weights_only=True) and `model.json` (backbone, classes and preprocessing), so that
`load_model` can rebuild it without trusting pickled code from storage.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.parse
import urllib.request
import uuid
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import IO, Any

import torch
import torchvision
from prefect import task
from pydantic import BaseModel
from safetensors.torch import load as load_safetensors
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer, interpolate_embeddings

from prefect_ddp.tasks.backbone_names import is_timm
from prefect_ddp.tasks.config import ModelConfig
from prefect_ddp.tasks.data.preprocessing import Preprocessing
from prefect_ddp.tasks.data.storage import GARBLED, exists, garbled_text, load_torch, read_bytes, torch_from_bytes
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.retries import retry_transient
from prefect_ddp.tasks.training.checkpoint_writer import with_versions_of
from prefect_ddp.tasks.training.timm_models import (
    is_timm_model,
    pretrained_config,
    timm_fitted_state,
    timm_head_prefixes,
    timm_model,
    timm_preprocessing,
    weights_folder,
    weights_url,
)
from prefect_ddp.tasks.urls import child_url

# torchvision classifiers built with auxiliary heads unless told otherwise, and the heads' modules.
AUXILIARY_HEADS = ("googlenet", "inception_v3")
AUXILIARY_MODULES = ("aux1", "aux2", "AuxLogits")
# torchvision classifiers built for one input side, given by keyword: a ViT's position embeddings
# are made for it, MaxViT sizes its attention grids by it. They are built for the run's side and
# their pretrained weights, made for the weights' own side, fitted to it (`fitted_state`).
SIDE_KEYWORDS: dict[str, Callable[[int], dict[str, Any]]] = {
    "vit_": lambda side: {"image_size": side},
    "maxvit_": lambda side: {"input_size": (side, side)},
}
# torchvision's families with stochastic depth (drop-path), which `training.drop_path` sets; their
# builders' own rates are the default.
STOCHASTIC_DEPTH = ("convnext_", "efficientnet_", "swin_", "maxvit_")
# A saved model's files, in the order they are copied: the card last, so a copy that has it is whole.
SAVED_MODEL_FILES = ("model.pt", "model.json")
# torchvision weights are downloaded in chunks of this size, each one progress.
DOWNLOAD_CHUNK_BYTES = 1 << 20
# A download that receives no byte for this long fails (urllib would wait for ever), well
# within the hang limit (60 s by default), so the rank says why first.
DOWNLOAD_STALL_S = 30.0


def classifier_path(model: nn.Module) -> tuple[nn.Module, str]:
    """The module holding the classifier's last layer and that layer's attribute name.

    The last `nn.Linear` in the model's module order (resnets' `fc`, `classifier[-1]` of
    mobilenets, efficientnets, convnexts and maxvit, `heads.head` of ViTs, `head` of Swin
    transformers), or, in a model without one (SqueezeNet), the last 1x1 convolution: checked for
    every torchvision classifier (tests/test_backbones.py).
    """
    modules = list(model.named_modules())
    linear = [name for name, module in modules if isinstance(module, nn.Linear)]
    pointwise = [name for name, module in modules if isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1)]
    if not (linear or pointwise):
        raise ValueError(f"Cannot find the classifier head of {type(model).__name__}: it has no Linear layer "
                         "and no 1x1 convolution.")
    parent, _, name = (linear or pointwise)[-1].rpartition(".")
    return model.get_submodule(parent), name


def replace_head(model: nn.Module, num_classes: int) -> nn.Module:
    """A new last layer for `num_classes`, of the kind and width of the one it replaces (timm's
    models: their own `reset_classifier`)."""
    if is_timm_model(model):
        model.reset_classifier(num_classes)  # type: ignore[operator]
        heads = model.get_classifier()  # type: ignore[operator]
        return heads[0] if isinstance(heads, tuple) else heads
    parent, name = classifier_path(model)
    old = getattr(parent, name)
    if isinstance(old, nn.Linear):
        head: nn.Module = nn.Linear(old.in_features, num_classes)
    else:
        head = nn.Conv2d(old.in_channels, num_classes, kernel_size=1)
    setattr(parent, name, head)
    return head


def head_prefix(model: nn.Module) -> str:
    """The state_dict prefix of a torchvision head's parameters (`fc.`, `classifier.3.`, `heads.head.`)."""
    parent, name = classifier_path(model)
    path = next(path for path, module in model.named_modules() if module is parent)
    return f"{path}.{name}." if path else f"{name}."


def head_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The state_dict prefixes of the model's classifier heads: one, or two for timm's distilled DeiTs."""
    return timm_head_prefixes(model) if is_timm_model(model) else (head_prefix(model),)


def pretrained_weights(backbone: str, weights: str | None) -> Any:
    """The pretrained weights `weights` names for `backbone`: torchvision's Weights, or timm's
    pretrained config (None: random init); refused where the backbone has none of that name."""
    return pretrained_config(backbone, weights) if is_timm(backbone) else torchvision_weights(backbone, weights)


def torchvision_weights(backbone: str, weights: str | None) -> Any:
    """torchvision's weights `weights` names for `backbone` (None: random init); refused naming those it has."""
    if weights is None:
        return None
    classifying = [w.name for w in torchvision.models.get_model_weights(backbone) if w.meta.get("categories")]
    try:
        chosen = torchvision.models.get_model_weights(backbone)[weights.split(".")[-1]]
    except KeyError:
        chosen = None
    if chosen is None or not chosen.meta.get("categories"):  # VGG-16's IMAGENET1K_FEATURES: no trained classifier
        what = (f"Weights {weights!r} for {backbone} are not a classifier's (its classifier layers hold no trained "
                "values)" if chosen else f"Unknown weights {weights!r} for {backbone}")
        raise ValueError(
            f"{what}: use one of {classifying + ['DEFAULT']}, a state_dict URI (s3://... or a local .pt path), "
            "or leave it empty for random init."
        )
    return chosen


def side_keywords(backbone: str, side: int | None) -> dict[str, Any]:
    """The keywords that build `backbone` for square images of `side` (`SIDE_KEYWORDS`); none for
    the families that take any side their layers allow, or when `side` is None (torchvision's default).

    >>> side_keywords("vit_b_16", 384), side_keywords("resnet18", 384), side_keywords("vit_b_16", None)
    ({'image_size': 384}, {}, {})
    """
    prefix = next((prefix for prefix in SIDE_KEYWORDS if backbone.startswith(prefix)), None)
    return SIDE_KEYWORDS[prefix](side) if prefix and side else {}


def fitted_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` fitted to `model`'s input side: a ViT's position embeddings interpolated (bicubic,
    as torchvision's `interpolate_embeddings` does) when they were made for another side; a timm
    model's as timm fits its pretrained weights."""
    if is_timm_model(model):
        return timm_fitted_state(model, state)
    if isinstance(model, VisionTransformer) and "encoder.pos_embedding" in state:
        return with_versions_of(state, interpolate_embeddings(model.image_size, model.patch_size, OrderedDict(state)))
    return state


def backbone_model(backbone: str, weights: Any, side: int | None = None, drop_path: float | None = None) -> nn.Module:
    """`backbone` with `weights` (`pretrained_weights`; None: random init) and the classes it was
    trained for, built for images of `side`, its drop-path rate `drop_path` (None: its own)."""
    if is_timm(backbone):
        return timm_model(backbone, cached_weights(weights, lambda: None) if weights else None, side, drop_path)
    return torchvision_model(backbone, weights, side, drop_path)


def drop_path_keywords(backbone: str, drop_path: float | None) -> dict[str, Any]:
    """The keyword that sets a torchvision family's drop-path rate (stochastic depth); refused for the
    families without it.

    >>> drop_path_keywords("convnext_tiny", 0.2), drop_path_keywords("resnet18", None)
    ({'stochastic_depth_prob': 0.2}, {})
    """
    if drop_path is None:
        return {}
    if not backbone.startswith(STOCHASTIC_DEPTH):
        raise ValueError(
            f"training.drop_path={drop_path} for {backbone}, which has no drop-path: of torchvision's models "
            f"only {', '.join(p.rstrip('_') for p in STOCHASTIC_DEPTH)} take it (and timm's). Leave it empty."
        )
    return {"stochastic_depth_prob": drop_path}


def torchvision_model(backbone: str, weights: Any, side: int | None = None, drop_path: float | None = None) -> nn.Module:
    """torchvision's `backbone`, with `weights` (None: random init) and 1000 classes as they were
    trained, built for images of `side` where its family is built for one side (`side_keywords`).

    GoogLeNet and Inception v3 always scale their input as their pretrained weights expect (so a
    model rebuilt without weights from its card computes what the trained one did), and lose their
    auxiliary heads, whose outputs a training step would take for the logits (torchvision keeps
    Inception's with weights, and refuses to be told otherwise then)."""
    sized = side_keywords(backbone, side)
    keywords = sized | drop_path_keywords(backbone, drop_path)
    if backbone in AUXILIARY_HEADS:
        keywords |= {"transform_input": True} | ({"init_weights": True} if weights is None else {})  # their note on defaults
    if weights is not None and sized:  # torchvision refuses another side with weights
        model = torchvision.models.get_model(backbone, weights=None, **keywords)
        model.load_state_dict(fitted_state(model, weights.get_state_dict(progress=False, check_hash=True,
                                                                         weights_only=True)))
    else:
        model = torchvision.models.get_model(backbone, weights=weights, **keywords)
    if backbone in AUXILIARY_HEADS:
        model.aux_logits = False
        for head in AUXILIARY_MODULES:  # set as torchvision drops them
            if hasattr(model, head):
                setattr(model, head, None)
    return model


def is_state_dict_uri(weights: str | None) -> bool:
    return weights is not None and ("://" in weights or weights.endswith((".pt", ".pth", ".safetensors")))


def named_weights(config: ModelConfig) -> Any:
    """The pretrained weights `config.weights` names; None for random init and a state_dict URI."""
    return None if is_state_dict_uri(config.weights) else pretrained_weights(config.backbone, config.weights)


def build_model(
    config: ModelConfig, num_classes: int, storage_options: dict[str, Any] | None = None, side: int | None = None,
    drop_path: float | None = None,
) -> nn.Module:
    """The backbone with starting weights loaded and a head for `num_classes`, for images of
    `side` (the run's `training.image_size`; None: the model's default), with `training.drop_path`."""
    uri = config.weights if is_state_dict_uri(config.weights) else None
    model = backbone_model(config.backbone, named_weights(config), side, drop_path)
    replace_head(model, num_classes)
    if uri:
        load_backbone_state(model, load_starting_weights(uri, storage_options or {}), uri)
    if config.freeze_backbone:
        freeze_all_but_head(model)
    return model


def freeze_all_but_head(model: nn.Module) -> None:
    """Only the head's parameters train (`model.freeze_backbone`)."""
    prefixes = head_prefixes(model)
    for name, param in model.named_parameters():
        param.requires_grad = name.startswith(prefixes)


def download_weights(config: ModelConfig, on_progress: Callable[[], None]) -> None:
    """Put the pretrained weights `config` names into torch's cache, calling `on_progress` as bytes arrive.

    torchvision and timm would download them inside build_model, saying nothing until the end: on a
    slow link longer than a rank may be silent (docs/architecture.md, "Gang: progress").
    build_model then finds them cached. Random init, a state_dict URI and weights already
    cached need nothing.
    """
    weights = named_weights(config)
    if weights is None:
        return
    if is_timm(config.backbone):
        cached_weights(weights, on_progress)
    else:
        download_to_cache(weights.url, Path(torch.hub.get_dir()) / "checkpoints", on_progress)


def cached_weights(config: Any, on_progress: Callable[[], None]) -> Path:
    """The file of timm's pretrained `config`, downloaded into torch's cache the first time."""
    return download_to_cache(weights_url(config), weights_folder(config), on_progress)


def download_to_cache(url: str, folder: Path, on_progress: Callable[[], None]) -> Path:
    """`url` in `folder` under its own file name, as torch.hub caches it; not fetched again once there.

    Checked against the SHA-256 prefix its name carries, as torch.hub checks a download,
    and written to a file of its own then renamed: ranks on one host downloading at once
    never read half a file.
    """
    path = folder / Path(urllib.parse.urlparse(url).path).name
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    # Created as torch.hub creates its downloads, with the umask's permissions (mkstemp's 0600
    # would leave a cache shared between users holding files the others cannot read).
    partial_name = str(folder / f".{path.name}.{uuid.uuid4().hex}.partial")
    handle = os.open(partial_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, "wb") as out, urllib.request.urlopen(url, timeout=DOWNLOAD_STALL_S) as response:
            sha256 = copy_reporting(response, out, on_progress)
        require_named_hash(url, path.name, sha256)
        os.replace(partial_name, path)
    finally:
        Path(partial_name).unlink(missing_ok=True)
    return path


def copy_reporting(source: IO[bytes], target: IO[bytes], on_progress: Callable[[], None]) -> str:
    """Copy `source` to `target` chunk by chunk, calling `on_progress` after each; the bytes' SHA-256."""
    digest = hashlib.sha256()
    for chunk in iter(partial(source.read, DOWNLOAD_CHUNK_BYTES), b""):
        target.write(chunk)
        digest.update(chunk)
        on_progress()
    return digest.hexdigest()


def require_named_hash(url: str, name: str, sha256: str) -> None:
    """Refuse a download whose SHA-256 does not start with the prefix in its file name (torch.hub's rule)."""
    named = torch.hub.HASH_REGEX.search(name)
    if named and not sha256.startswith(named[1]):
        raise ValueError(
            f"The weights downloaded from {url} have SHA-256 {sha256[:len(named[1])]}..., but their name "
            f"{name} says {named[1]}...: the download was cut short or altered on the way. Run again; if "
            "it persists, check what stands between the workers and the download (a proxy), or give "
            "model.weights as a state_dict URI you have checked."
        )


def load_starting_weights(uri: str, storage_options: dict[str, Any]) -> dict[str, torch.Tensor]:
    if not exists(uri, storage_options):
        raise FileNotFoundError(
            f"model.weights points at {uri}, which does not exist. Give the URI of a state_dict "
            "saved with torch.save(model.state_dict(), ...), a torchvision weights name "
            "(DEFAULT), or leave it empty for random init."
        )
    if uri.endswith(".safetensors"):  # tensors only, no pickle: timm's and Hugging Face's format
        return load_safetensors(read_bytes(uri, storage_options))
    return load_torch(uri, storage_options)


@task(name="check-model", retries=2, retry_delay_seconds=10, retry_condition_fn=retry_transient)
def check_starting_weights(config: ModelConfig, num_classes: int, location: Location, side: int) -> None:
    """Fail before the data check and training when the starting weights are missing or do not fit.

    A state_dict URI is loaded into the backbone here, once; a torchvision weights name is
    only checked by name (downloading it is the ranks' job).
    """
    if is_state_dict_uri(config.weights):
        build_model(config, num_classes, location.storage_options(), side)
    else:
        pretrained_weights(config.backbone, config.weights)


def load_backbone_state(model: nn.Module, state: dict[str, torch.Tensor], uri: str) -> None:
    """Load a backbone's state_dict, ignoring its head (trained for other classes) and the auxiliary
    heads the model was built without (a state saved from torchvision's GoogLeNet or Inception v3)."""
    prefixes = head_prefixes(model)
    dropped = (*prefixes, *(f"{name}." for name in AUXILIARY_MODULES
                         if hasattr(model, name) and getattr(model, name) is None))
    # A state saved as a plain dict (after DDP, `module.` stripped) lost its modules' versions: those of
    # the same torchvision modules, built here, stand in (MNASNet refuses to load without them).
    versions = state if hasattr(state, "_metadata") else model.state_dict()
    body = with_versions_of(versions, {k: v for k, v in fitted(model, state, uri).items() if not k.startswith(dropped)})
    try:
        missing, unexpected = model.load_state_dict(body, strict=False)
    except (RuntimeError, ValueError) as error:  # tensors of other shapes: another model of the family
        raise ValueError(does_not_fit(uri, str(error).splitlines()[-1].strip())) from None
    missing = [k for k in missing if not k.startswith(prefixes)]
    if missing or unexpected:
        raise ValueError(does_not_fit(uri, f"{len(missing)} missing keys (e.g. {missing[:3]}), {len(unexpected)} "
                                           f"unexpected (e.g. {unexpected[:3]})."))


# How to fix a starting state_dict that does not fit.
SAVE_FROM_THE_SAME_MODEL = "Save it from the same model (torch.save(model.state_dict(), ...))."


def does_not_fit(uri: str, why: str, fix: str = SAVE_FROM_THE_SAME_MODEL) -> str:
    return f"The state_dict at {uri} does not fit this backbone: {why} {fix}"


def fitted(model: nn.Module, state: dict[str, torch.Tensor], uri: str) -> dict[str, torch.Tensor]:
    """`fitted_state`, where a family's fitting meets another model's state (timm's filters index keys
    of their own family) refused in the project's words."""
    try:
        return fitted_state(model, state)
    except Exception as error:  # noqa: BLE001 - a KeyError, AttributeError... from the family's own code
        raise ValueError(does_not_fit(uri, f"fitting it raised {type(error).__name__}: {error}.")) from None


def preprocessing_for(config: ModelConfig) -> Preprocessing:
    """The preprocessing `config`'s starting weights were made with (`Weights.transforms()`, timm's
    pretrained config of the name's tag, for its weights and a URI of them): torchvision's usual for
    random init and a torchvision state_dict URI, whose making is not known."""
    if is_timm(config.backbone):
        return timm_preprocessing(config.backbone) if config.weights else Preprocessing()
    weights = named_weights(config)
    if weights is None:
        return Preprocessing()
    made = weights.transforms()
    return Preprocessing(resize_per_crop=made.resize_size[0] / made.crop_size[0], interpolation=made.interpolation.value,
                         mean=tuple(made.mean), std=tuple(made.std))


def model_card(config: ModelConfig, classes: list[str], image_size: int,
               preprocessing: Preprocessing | None = None) -> dict[str, Any]:
    """What `load_model` and whoever scores with the model need besides the weights; written as model.json.
    `preprocessing`: what the run trained with (`TrainJob.preprocessing`); by default its starting weights'."""
    made = preprocessing or preprocessing_for(config)
    return {"backbone": config.backbone, "classes": classes} | made.card(image_size)


def load_model(card: dict[str, Any], state: dict[str, torch.Tensor]) -> nn.Module:
    """Rebuild a trained classifier from its model card and state_dict, in eval mode."""
    model = backbone_model(card["backbone"], None, card.get("image_size"))
    replace_head(model, len(card["classes"]))
    model.load_state_dict(state)
    return model.eval()


def model_problem(folder: Location) -> str | None:
    """Why the saved model in `folder` (model.json, model.pt) cannot be loaded, or None when it can.

    Loaded whole, as a rank would load it: a file cut short by its store, or garbled, fails
    here, once, before training, instead of in every rank of every attempt after all of
    training (docs/after-training.md, "A kept model that cannot be read"). The store's own
    errors are not caught: they are retried or fail the run as they would anywhere.
    """
    options = folder.storage_options()
    read: dict[str, bytes] = {}
    for name in SAVED_MODEL_FILES:  # read, not checked with exists(): fsspec's local exists() says False for EIO
        try:
            read[name] = read_bytes(child_url(folder.url, name), options)
        except FileNotFoundError:
            pass
    if missing := [name for name in SAVED_MODEL_FILES if name not in read]:
        return f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing"
    return loading_problem(read["model.json"], read["model.pt"])


# What loading a card and state of the wrong shape raises besides GARBLED: a card that is a list,
# a field of another type.
SHAPE_ERRORS: tuple[type[Exception], ...] = (*GARBLED, TypeError, AttributeError)


def loading_problem(card: bytes, weights: bytes) -> str | None:
    """Why a model's card and weights, as read, do not make a model; None when they do."""
    try:
        described = json.loads(card)
        if not isinstance(described, dict):
            raise ValueError(f"not a JSON object but {type(described).__name__}")
    except GARBLED as error:
        return f"model.json cannot be read ({garbled_text(error)})"
    try:
        load_model(described, torch_from_bytes(weights))
    except SHAPE_ERRORS as error:  # a card or state of another shape too
        return f"model.pt cannot be loaded as model.json describes it ({garbled_text(error)})"
    return None


class WarmStart(BaseModel):
    """The kept model a run starts from: where its weights are and whether its head fits."""

    model: Location  # url: versions/RUN/model.pt (or a registered model's copy), with the output's credentials
    with_head: bool
    origin: str  # for the report: "run `NAME`" or the registered model's URI
    preprocessing: Preprocessing  # its model.json's: the model goes on being trained as it was made


def load_warm_start(model: nn.Module, warm: WarmStart) -> None:
    """Load the kept weights: all of them when the classes match, else all but the head."""
    url, state = warm.model.url, load_torch(warm.model.url, warm.model.storage_options())
    if not warm.with_head:
        load_backbone_state(model, state, url)
        return
    try:
        model.load_state_dict(fitted(model, state, url))
    except RuntimeError as error:  # a model built for another side whose state the family cannot fit (LeViT)
        raise ValueError(does_not_fit(url, str(error).splitlines()[-1].strip(), WARM_START_FIX)) from None


WARM_START_FIX = ("The kept model was trained otherwise (another training.image_size or drop-path): train at its "
                  "own image_size (its model.json), or start without it (model.warm_start=false).")
