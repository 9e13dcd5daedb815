import hashlib
import json
import os
import stat

import pytest
import torch
import torchvision
from PIL import Image
from torchvision.transforms import InterpolationMode, v2

from prefect_ddp.tasks.backbone_names import backbone_names
from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.dataset import eval_transform, train_transform
from prefect_ddp.tasks.data.preprocessing import Preprocessing
from prefect_ddp.tasks.data.storage import load_torch, save_torch
from prefect_ddp.tasks.results.tracking_run import preprocessing
from prefect_ddp.tasks.training.model import (
    DOWNLOAD_CHUNK_BYTES,
    build_model,
    download_to_cache,
    download_weights,
    head_prefix,
    load_model,
    model_card,
    preprocessing_for,
)

pytestmark = pytest.mark.unit


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


@pytest.mark.parametrize("side", [224, 448, 1024])
def test_validation_batch_predict_and_the_mlflow_model_resize_as_the_card_says(side):
    """One constant (8/7, torchvision's 256 for 224) in the transform, the card, batch-predict and
    the logged model's metadata."""
    card = model_card(ModelConfig(backbone="mobilenet_v3_small"), ["a", "b"], side)
    assert card["resize"] == {224: 256, 448: 512, 1024: 1170}[side]
    resize, crop = [t for t in eval_transform(side).transforms if isinstance(t, (v2.Resize, v2.CenterCrop))]
    assert resize.size == [card["resize"]] and crop.size == (side, side)
    assert Preprocessing.of_card(card).resize(side) == card["resize"]
    metadata = preprocessing(card)
    assert (metadata["resize"], metadata["image_size"]) == (card["resize"], side)
    assert f"resized to {card['resize']} px (bilinear, antialiased), centre crop of {side} px" in metadata["steps"]
    assert eval_transform(side)(Image.new("RGB", (side * 3 // 2, side * 9 // 8))).shape == (3, side, side)


def test_a_card_from_before_resize_was_recorded_is_scored_as_it_was_validated():
    assert Preprocessing.of_card({"image_size": 224}) == Preprocessing(resize_per_crop=255 / 224)
    assert Preprocessing.of_card({"image_size": 224}).resize(224) == 255


def every_torchvision_weight() -> list[tuple[str, str]]:
    return [(name, weights.name) for name in backbone_names() for weights in torchvision.models.get_model_weights(name)
            if weights.meta.get("categories")]  # not VGG-16's IMAGENET1K_FEATURES, refused


@pytest.mark.parametrize("side", [32, 224, 299, 384, 518])
def test_every_weight_s_preprocessing_is_trained_with_and_scored_from_its_card_alike(side):
    """Training's and validation's transforms come from the job (`TrainJob.preprocessing`), batch-predict's,
    the champion's and the MLflow model's from model.json: for every torchvision weight, the same."""
    for backbone, weights in every_torchvision_weight():
        config = ModelConfig(backbone=backbone, weights=weights)
        trained, card = preprocessing_for(config), model_card(config, ["a", "b"], side)
        made = torchvision.models.get_model_weights(backbone)[weights].transforms()
        assert (trained.interpolation, trained.mean, trained.std) == (made.interpolation.value, tuple(made.mean),
                                                                      tuple(made.std))
        scored = Preprocessing.of_card(json.loads(json.dumps(card)))  # as read back from storage
        assert (scored.resize(side), scored.mode, scored.mean, scored.std) == (
            trained.resize(side), trained.mode, trained.mean, trained.std), (backbone, weights)
        assert trained.resize(made.crop_size[0]) == made.resize_size[0], (backbone, weights)  # at its own crop, torchvision's


def test_weights_without_a_trained_classifier_are_refused_naming_those_that_have_one():
    """VGG-16's IMAGENET1K_FEATURES hold no trained values in the classifier layers below the head:
    the run downloaded 528 MB and trained on them."""
    with pytest.raises(ValueError, match=r"'IMAGENET1K_FEATURES' for vgg16 are not a classifier's .*\['IMAGENET1K_V1', 'DEFAULT'\]"):
        build_model(ModelConfig(backbone="vgg16", weights="IMAGENET1K_FEATURES"), num_classes=2)


def test_a_warm_started_run_trains_validates_and_records_the_kept_model_s_preprocessing(tmp_path):
    """Not its own model.weights' (the nightly deployment leaves them empty): a kept EfficientNetV2-L
    goes on with its bicubic resize and 0.5 statistics (review of issue 58)."""
    from prefect_ddp.blocks.data_location import DataLocation
    from prefect_ddp.tasks.data.splitting import stratified_split
    from prefect_ddp.tasks.results.promotion import warm_start_from
    from prefect_ddp.tasks.training.job import RunFiles, TrainJob
    from tests.support.image_folders import local_image_folder

    kept = tmp_path / "kept"
    kept.mkdir()
    card = model_card(ModelConfig(backbone="efficientnet_v2_l", weights="DEFAULT"), ["a", "b"], 480)
    (kept / "model.json").write_text(json.dumps(card))
    warm = warm_start_from(DataLocation(url=str(kept)), "efficientnet_v2_l", ["a", "b"], "run `x`")
    manifest = local_image_folder(tmp_path / "images", per_class=2)
    job = TrainJob(source=DataLocation(url=str(tmp_path / "images")), output=DataLocation(url=str(tmp_path / "out")),
                   manifest=manifest, split=stratified_split(manifest, 0.5, 0), warm_start=warm,
                   model=ModelConfig(backbone="efficientnet_v2_l", warm_start=True), training=TrainingConfig(image_size=64))
    assert job.preprocessing == Preprocessing.of_card(card) != preprocessing_for(job.model)
    written = RunFiles.of(job, {}).card_fields
    assert (written["interpolation"], written["mean"], written["resize"]) == ("bicubic", (0.5,) * 3, 64)


def test_a_weight_s_own_preprocessing_drives_training_validation_and_the_card():
    """ResNet-50's second weights resize to 232 for 224, EfficientNet's interpolate bicubic, EfficientNetV2-L's
    normalise by 0.5, and random init or a state_dict URI keep torchvision's usual."""
    v2_weights = preprocessing_for(ModelConfig(backbone="resnet50", weights="IMAGENET1K_V2"))
    assert v2_weights.resize(224) == 232 and v2_weights.interpolation == "bilinear"
    bicubic = preprocessing_for(ModelConfig(backbone="efficientnet_b0", weights="DEFAULT"))
    crop = next(t for t in train_transform(64, bicubic).transforms if isinstance(t, v2.RandomResizedCrop))
    resize = next(t for t in eval_transform(64, bicubic).transforms if isinstance(t, v2.Resize))
    assert crop.interpolation == resize.interpolation == InterpolationMode.BICUBIC
    halves = preprocessing_for(ModelConfig(backbone="efficientnet_v2_l", weights="DEFAULT"))
    black = eval_transform(32, halves)(Image.new("RGB", (40, 40)))
    assert torch.allclose(black, torch.full_like(black, -1.0))  # (0 - 0.5) / 0.5
    assert preprocessing_for(ModelConfig(backbone="efficientnet_v2_l")) == Preprocessing()
    assert preprocessing_for(ModelConfig(backbone="efficientnet_v2_l", weights="s3://b/start.pt")) == Preprocessing()
    card = model_card(ModelConfig(backbone="efficientnet_v2_l", weights="DEFAULT"), ["a"], 96)
    assert (card["mean"], card["interpolation"], preprocessing(card)["interpolation"]) == ((0.5,) * 3, "bicubic", "bicubic")


def test_loading_refuses_pickled_code(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"payload": print}, path)  # a callable: weights_only must refuse it
    with pytest.raises(Exception, match="Weights only load failed"):
        load_torch(str(path), {})


def published(folder, data: bytes, named_hash: str | None = None) -> str:
    """`data` as a file whose name carries a SHA-256 prefix, as torchvision names its weights; its URL."""
    path = folder / f"tiny-{named_hash or hashlib.sha256(data).hexdigest()[:8]}.pth"
    path.write_bytes(data)
    return path.as_uri()


def test_weights_are_downloaded_into_torchs_cache_with_progress_as_their_bytes_arrive(tmp_path):
    (tmp_path / "published").mkdir()
    state = build_model(ModelConfig(backbone="mobilenet_v3_small"), num_classes=3).state_dict()
    save_torch(str(tmp_path / "state.pth"), state, {})
    data = (tmp_path / "state.pth").read_bytes()
    url = published(tmp_path / "published", data)
    cache = tmp_path / "hub" / "checkpoints"
    calls = []
    path = download_to_cache(url, cache, lambda: calls.append(1))
    chunks = -(-len(data) // DOWNLOAD_CHUNK_BYTES)
    assert len(calls) == chunks > 1  # once per chunk, not once at the end
    assert path.read_bytes() == data and sorted(p.name for p in cache.iterdir()) == [path.name]
    # Readable as torch.hub's own downloads are (the umask's permissions), in a cache other users share.
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    # What torchvision's own loading then finds in its cache, without a download of its own.
    loaded = torch.hub.load_state_dict_from_url(url, model_dir=str(cache), weights_only=True)
    assert torch.equal(loaded["classifier.3.weight"], state["classifier.3.weight"])
    assert download_to_cache(url, cache, lambda: calls.append(1)) == path and len(calls) == chunks  # cached


def test_a_download_that_does_not_match_the_hash_in_its_name_is_refused_and_leaves_nothing(tmp_path):
    url = published(tmp_path, b"not the weights", named_hash="00000000")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"have SHA-256 [0-9a-f]{8}\.\.\., but their name tiny-00000000.pth says "
                                         r"00000000\.\.\.: the download was cut short.*Run again"):
        download_to_cache(url, cache, lambda: None)
    assert list(cache.iterdir()) == []


def test_weights_already_cached_random_init_and_state_dict_uris_download_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    cached = tmp_path / "hub" / "checkpoints" / torchvision.models.ResNet18_Weights.DEFAULT.url.rsplit("/", 1)[1]
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"cached")
    for config in (ModelConfig(backbone="resnet18", weights="DEFAULT"), ModelConfig(backbone="resnet18"),
                   ModelConfig(backbone="resnet18", weights=str(tmp_path / "mine.pt"))):
        download_weights(config, lambda: pytest.fail(f"{config.weights!r} was downloaded"))
    assert cached.read_bytes() == b"cached"
