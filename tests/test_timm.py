"""timm's models as backbones, `model.backbone="timm/NAME"` (issue 58): named and refused as
torchvision's are, built for the run's side, their heads (two for a distilled DeiT) swapped and
frozen, their pretrained weights read from timm's cache or a URI (safetensors too) and fitted to
the side, each tag's preprocessing; `drop_path` for timm's and torchvision's families.

The gloo run of a few timm models beside torchvision's families is in tests/test_backbones.py.
Nothing here downloads: this machine reaches no model hub, so "downloaded" weights are put where
the download would leave them.
"""

from __future__ import annotations

import json
import sys
import pytest
import timm
import torch
from pydantic import ValidationError
from safetensors.torch import save_file
from torch import nn
from torchvision.ops import StochasticDepth

from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.preprocessing import Preprocessing
from prefect_ddp.tasks.sweeps.search_space import Dimension
from prefect_ddp.tasks.training.backbone_checks import require_backbone_takes
from prefect_ddp.tasks.training.input_side import parameters_on_meta, require_drop_path, side_problem
from prefect_ddp.tasks.training.optimization import build_optimizer
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.training.model import (
    WarmStart,
    backbone_model,
    build_model,
    download_weights,
    freeze_all_but_head,
    head_prefixes,
    load_model,
    load_warm_start,
    model_card,
    named_weights,
    preprocessing_for,
)
from prefect_ddp.tasks.training.timm_models import weights_folder
from prefect_ddp.flows.sweep import check_space_values

VIT = "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k"
SMALL = ("timm/resnet18", "timm/convnext_atto", "timm/deit_tiny_distilled_patch16_224", "timm/efficientnet_b0",
         "timm/swin_tiny_patch4_window7_224", VIT)


@pytest.mark.unit
@pytest.mark.parametrize("backbone", SMALL)
def test_a_timm_model_swaps_its_heads_freezes_and_rebuilds_from_its_card(backbone):
    with parameters_on_meta():
        model = build_model(ModelConfig(backbone=backbone, freeze_backbone=True), 7, side=64)
        trainable = {name for name, param in model.named_parameters() if param.requires_grad}
        prefixes = head_prefixes(model)
        assert trainable == {f"{prefix}{part}" for prefix in prefixes for part in ("weight", "bias")}
        assert model(torch.empty(2, 3, 64, 64, device="meta")).shape == (2, 7)
        card = model_card(ModelConfig(backbone=backbone), list("abcdefg"), 64)
        load_model(card, model.state_dict())  # every key and shape, at the side the card records
    assert (len(prefixes) == 2) is ("distilled" in backbone)


@pytest.mark.unit
@pytest.mark.parametrize(("backbone", "refused"), [
    ("timm/convnext_tinyy", "is not a timm model; the closest: timm/convnext_tiny"),
    ("timm/convnext_tiny.fb_in23k", "no weights tagged 'fb_in23k' for convnext_tiny; the closest: timm/convnext_tiny.fb_in22k"),
    ("timm/resnet18.", "no weights tagged '' for resnet18; the closest: timm/resnet18"),
])
def test_a_misspelt_timm_name_or_tag_is_refused_with_the_closest(backbone, refused):
    with pytest.raises(ValidationError, match=refused):
        ModelConfig(backbone=backbone)


@pytest.mark.unit
def test_without_timm_a_timm_name_says_to_install_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # what `import timm` meets where it is not installed
    with pytest.raises(ValidationError, match=r"timm is not installed here.*pip install 'prefect-ddp\[timm\]'"):
        ModelConfig(backbone="timm/resnet18")


@pytest.mark.unit
@pytest.mark.parametrize(("backbone", "weights", "refused"), [
    ("timm/convnext_tiny", "IMAGENET1K_V1", "chosen by its name's tag"),
    ("timm/beit3_giant_patch14_224", "DEFAULT", "no pretrained weights"),
])
def test_weights_a_timm_model_cannot_have_are_refused_before_training(backbone, weights, refused):
    with pytest.raises(ValueError, match=refused):
        named_weights(ModelConfig(backbone=backbone, weights=weights))


@pytest.mark.unit
@pytest.mark.parametrize("backbone", ["timm/convnext_tiny.fb_in22k", VIT, "timm/resnet50"])
def test_a_timm_model_s_weights_bring_their_tag_s_preprocessing_and_random_init_torchvision_s(backbone):
    made = timm.data.resolve_data_config({}, model=timm.create_model(backbone.removeprefix("timm/"), pretrained=False))
    for weights in ("DEFAULT", "s3://bucket/weights.safetensors"):
        preprocessing = preprocessing_for(ModelConfig(backbone=backbone, weights=weights))
        assert preprocessing.interpolation == made["interpolation"]
        assert (preprocessing.mean, preprocessing.std) == (made["mean"], made["std"])
        assert preprocessing.resize(224) == round(224 / made["crop_pct"])
    assert preprocessing_for(ModelConfig(backbone=backbone)) == Preprocessing()


def timm_state(backbone: str) -> dict[str, torch.Tensor]:
    """A state of timm's `backbone` as pretrained (its classes, its side), every tensor set to a known value."""
    model = timm.create_model(backbone.removeprefix("timm/"), pretrained=False)
    return {name: torch.full_like(tensor, 0.5) if tensor.is_floating_point() else tensor
            for name, tensor in model.state_dict().items()}


def assert_started_from(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every tensor but the heads' holds the state's values, the position embeddings resized to the model's side."""
    prefixes = head_prefixes(model)
    for name, tensor in model.state_dict().items():
        if not name.startswith(prefixes) and tensor.is_floating_point():
            assert torch.all(tensor == 0.5) or name == "pos_embed", name
    assert model.pos_embed.shape[1] == (64 // 16) ** 2 + 1  # 224's 197 positions, resized for 64 px
    assert torch.allclose(model.pos_embed, torch.tensor(0.5), atol=1e-5)


@pytest.mark.unit
def test_downloaded_timm_weights_are_read_from_the_cache_and_fitted_to_the_run_s_side(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    config = ModelConfig(backbone=VIT, weights="DEFAULT")
    folder = weights_folder(named_weights(config))
    folder.mkdir(parents=True)
    state = timm_state(VIT)
    save_file(state, folder / "model.safetensors")  # where download_weights leaves it
    download_weights(config, on_progress=lambda: pytest.fail("downloaded again"))
    model = build_model(config, 3, side=64)
    assert_started_from(model, state)
    assert model(torch.rand(1, 3, 64, 64)).shape == (1, 3)


@pytest.mark.unit
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_timm_weights_file_given_as_a_uri_starts_the_run_fitted_to_its_side(suffix, tmp_path):
    state = timm_state(VIT)
    path = tmp_path / f"weights{suffix}"
    save_file(state, path) if suffix == ".safetensors" else torch.save(state, path)
    model = build_model(ModelConfig(backbone=VIT, weights=str(path)), 3, side=64)
    assert_started_from(model, state)


@pytest.mark.unit
def test_a_torchvision_state_dict_as_safetensors_starts_a_run(tmp_path):
    state = {name: torch.full_like(tensor, 0.25) if tensor.is_floating_point() else tensor
             for name, tensor in backbone_model("resnet18", None).state_dict().items()}
    save_file(state, tmp_path / "resnet18.safetensors")
    model = build_model(ModelConfig(backbone="resnet18", weights=str(tmp_path / "resnet18.safetensors")), 3)
    assert torch.all(model.conv1.weight == 0.25) and model.fc.out_features == 3


@pytest.mark.unit
def test_drop_path_sets_timm_s_rate_and_torchvision_s_stochastic_depth_and_is_refused_where_there_is_none():
    with parameters_on_meta():
        timm_model = backbone_model("timm/convnext_atto", None, drop_path=0.3)
        torchvision_model = backbone_model("convnext_tiny", None, drop_path=0.3)
        default = backbone_model("convnext_tiny", None)
    assert max(block.drop_path.drop_prob for block in timm_model.stages[-1].blocks) == pytest.approx(0.3)
    assert max(m.p for m in torchvision_model.modules() if isinstance(m, StochasticDepth)) == pytest.approx(0.3)
    assert max(m.p for m in default.modules() if isinstance(m, StochasticDepth)) == pytest.approx(0.1)  # its builder's
    with pytest.raises(ValueError, match="resnet18, which has no drop-path"):
        require_drop_path("resnet18", 0.1)
    with pytest.raises(ValidationError):
        TrainingConfig(drop_path=1)


@pytest.mark.unit
def test_layer_decay_gives_each_of_a_timm_vit_s_layers_a_rate_the_head_s_times_a_power_and_only_timm_s():
    model = backbone_model(VIT, None)
    optimizer = build_optimizer(model, TrainingConfig(lr=0.1, layer_decay=0.5, weight_decay=0.05), world_size=1)
    rate = {id(param): group["lr"] for group in optimizer.param_groups for param in group["params"]}
    decay = {id(param): group["weight_decay"] for group in optimizer.param_groups for param in group["params"]}
    depth = len(model.blocks) + 1  # the embeddings below the blocks, the head above them
    assert rate[id(model.head.weight)] == pytest.approx(0.1)
    assert rate[id(model.blocks[-1].mlp.fc1.weight)] == pytest.approx(0.1 * 0.5)
    assert rate[id(model.patch_embed.proj.weight)] == pytest.approx(0.1 * 0.5 ** depth)
    assert decay[id(model.pos_embed)] == decay[id(model.head.bias)] == 0 and decay[id(model.head.weight)] == 0.05
    assert len(rate) == sum(1 for _ in model.parameters())  # every parameter trains, once
    with pytest.raises(ValueError, match="only timm's models have"):
        require_backbone_takes("vit_b_16", TrainingConfig(layer_decay=0.75))


@pytest.mark.unit
def test_a_drop_path_of_0_turns_off_a_timm_builder_s_own_rate():
    """timm's FasterNet builds with 0.2 of its own: 0 was taken for "empty" (review of issue 58)."""
    with parameters_on_meta():
        rates = {given: max(getattr(module, "drop_prob", 0.0) for module in backbone_model(
            "timm/fasternet_m", None, drop_path=given).modules()) for given in (None, 0.0, 0.1)}
    assert rates == {None: pytest.approx(0.2), 0.0: 0.0, 0.1: pytest.approx(0.1)}


@pytest.mark.unit
def test_a_torchvision_state_given_to_a_timm_backbone_is_refused_in_the_project_s_words(tmp_path):
    """timm's ConvNeXt filter met torchvision's keys with a bare KeyError (review of issue 58)."""
    torch.save(backbone_model("convnext_tiny", None).state_dict(), tmp_path / "torchvision.pt")
    with pytest.raises(ValueError, match=r"torchvision.pt does not fit this backbone: fitting it raised KeyError.*"
                                         r"Save it from the same model"):
        build_model(ModelConfig(backbone="timm/convnext_tiny", weights=str(tmp_path / "torchvision.pt")), 3)


@pytest.mark.unit
def test_a_kept_timm_model_that_cannot_be_fitted_to_another_side_is_refused_saying_how_to_start(tmp_path):
    """LeViT's attention biases are sized by the side and timm does not resize them (review of issue 58)."""
    torch.save(build_model(ModelConfig(backbone="timm/levit_128s"), 3, side=64).state_dict(), tmp_path / "model.pt")
    warm = WarmStart(model=Location(url=str(tmp_path / "model.pt")), with_head=True, origin="run `kept`",
                     preprocessing=Preprocessing())
    with pytest.raises(ValueError, match=r"does not fit this backbone: .*size mismatch.*train at its own image_size"):
        load_warm_start(build_model(ModelConfig(backbone="timm/levit_128s"), 3, side=96), warm)


@pytest.mark.unit
def test_a_sweep_over_timm_and_torchvision_backbones_is_checked_before_any_trial():
    space = {"model.backbone": Dimension(kind="choice", values=["resnet18", "timm/convnext_atto"]),
             "training.drop_path": Dimension(kind="grid", values=[0.0, 0.1])}
    with pytest.raises(ValueError, match="resnet18, which has no drop-path"):
        check_space_values(space, ModelConfig(), TrainingConfig(image_size=64))
    space["model.backbone"] = Dimension(kind="choice", values=["convnext_tiny", "timm/convnext_atto"])
    check_space_values(space, ModelConfig(), TrainingConfig(image_size=64))
    space["training.layer_decay"] = Dimension(kind="choice", values=[0.65, 0.75])
    with pytest.raises(ValueError, match="convnext_tiny: layer-wise decay needs timm's layer groups"):
        check_space_values(space, ModelConfig(), TrainingConfig(image_size=64))
    space["training.layer_decay"] = Dimension(kind="uniform", low=0.6, high=0.9)  # a range: checked at its ends
    with pytest.raises(ValueError, match="convnext_tiny: layer-wise decay needs timm's layer groups"):
        check_space_values(space, ModelConfig(), TrainingConfig(image_size=64))
    del space["training.layer_decay"]
    space["training.drop_path"] = Dimension(kind="uniform", low=0.0, high=1.0)
    with pytest.raises(ValueError, match=r"offers training.drop_path=1.0, .* less than 1"):
        check_space_values(space, ModelConfig(), TrainingConfig(image_size=64))
    space["training.drop_path"] = Dimension(kind="uniform", low=0.0, high=0.3)
    space["model.backbone"] = Dimension(kind="choice", values=["timm/convnext_atto", "timm/convnext_attoo"])
    with pytest.raises(ValueError, match="the closest: timm/convnext_atto"):
        check_space_values(space, ModelConfig(), TrainingConfig(image_size=64))


@pytest.mark.unit
def test_a_side_a_timm_model_cannot_take_is_found_on_meta():
    assert side_problem("timm/convnext_atto", 24) is not None  # its last stage's 2x2 downsampling of a 1x1 map
    assert side_problem("timm/convnext_atto", 32) is None
    assert side_problem("timm/deit_tiny_distilled_patch16_224", 16) is None  # built for the side: one patch
    assert "not a classifier" in side_problem("timm/qwen3_vit_88m_enc", 224)  # an image encoder: scores per patch


@pytest.mark.unit
def test_model_json_of_a_timm_model_names_it_and_its_tag_s_preprocessing():
    card = json.loads(json.dumps(model_card(ModelConfig(backbone=VIT, weights="DEFAULT"), ["a", "b"], 64)))
    assert (card["backbone"], card["interpolation"], card["resize"], card["mean"]) == (VIT, "bicubic", 71, [0.5] * 3)
