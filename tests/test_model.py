import pytest
import torch

from prefect_ddp.tasks.config import BACKBONES, ModelConfig
from prefect_ddp.tasks.data.storage import load_torch, save_torch
from prefect_ddp.tasks.training.model import (
    build_model,
    classifier_path,
    head_prefix,
    load_model,
    model_card,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("backbone", BACKBONES)
def test_head_is_replaced_for_every_backbone(backbone):
    model = build_model(ModelConfig(backbone=backbone), num_classes=5).eval()
    parent, name = classifier_path(model)
    assert getattr(parent, name).out_features == 5
    with torch.no_grad():
        assert model(torch.rand(2, 3, 32, 32)).shape == (2, 5)


@pytest.mark.parametrize("backbone", ["resnet18", "mobilenet_v3_small"])
def test_freeze_backbone_trains_only_the_head(backbone):
    model = build_model(ModelConfig(backbone=backbone, freeze_backbone=True), num_classes=3)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(head_prefix(model)) for n in trainable)


def test_state_dict_uri_loads_the_backbone_and_ignores_its_head(tmp_path):
    pretrained = build_model(ModelConfig(backbone="resnet18"), num_classes=1000)
    path = str(tmp_path / "resnet18.pt")
    save_torch(path, pretrained.state_dict(), {})
    model = build_model(ModelConfig(backbone="resnet18", weights=path), num_classes=4)
    assert torch.equal(model.conv1.weight, pretrained.conv1.weight)
    assert model.fc.out_features == 4


def test_state_dict_of_another_backbone_is_a_clear_error(tmp_path):
    path = str(tmp_path / "mobilenet.pt")
    save_torch(path, build_model(ModelConfig(backbone="mobilenet_v3_small"), 10).state_dict(), {})
    with pytest.raises(ValueError, match="does not fit this backbone: .* missing keys"):
        build_model(ModelConfig(backbone="resnet18", weights=path), num_classes=4)


def test_unknown_weights_name_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"Unknown weights 'IMAGENET9K' for resnet18: use one of \['IMAGENET1K_V1'"):
        build_model(ModelConfig(backbone="resnet18", weights="IMAGENET9K"), num_classes=2)


def test_saved_model_round_trips_through_its_card(tmp_path):
    model = build_model(ModelConfig(backbone="mobilenet_v3_small"), num_classes=3).eval()
    save_torch(str(tmp_path / "model.pt"), model.state_dict(), {})
    card = model_card(ModelConfig(backbone="mobilenet_v3_small"), ["a", "b", "c"], 32)
    loaded = load_model(card, load_torch(str(tmp_path / "model.pt"), {}))
    x = torch.rand(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(loaded(x), model(x))


def test_loading_refuses_pickled_code(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"payload": print}, path)  # a callable: weights_only must refuse it
    with pytest.raises(Exception, match="Weights only load failed"):
        load_torch(str(path), {})
