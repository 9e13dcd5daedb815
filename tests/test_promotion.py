"""The promotion rule and warm start, on real files: a worse run never replaces the kept model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from blocks.data_location import DataLocation
from tasks.config import ModelConfig
from tasks.model import build_model, model_card
from tasks.promotion import find_warm_start, latest_location, load_warm_start, promote
from tasks.storage import save_torch, write_json

CLASSES = ["circle", "square", "triangle"]


def finished_run(tmp_path, name: str, final_val_acc: float, classes=CLASSES) -> tuple[dict, DataLocation]:
    """A run's summary and its folder as the flow leaves it: model.pt, model.json."""
    run = DataLocation(url=str(tmp_path / name))
    config = ModelConfig(backbone="mobilenet_v3_small")
    save_torch(f"{run.url}/model.pt", build_model(config, len(classes)).state_dict(), {})
    write_json(f"{run.url}/model.json", model_card(config, classes, 32), {})
    history = [{"epoch": 1, "val_acc": final_val_acc, "val_loss": 1 - final_val_acc}]
    summary = {"final_val_acc": final_val_acc, "best_val_acc": final_val_acc, "best_epoch": 1,
               "final_val_loss": 1 - final_val_acc, "history": history}
    return summary, run


def kept(latest: DataLocation) -> dict:
    return json.loads(Path(latest.url, "metrics.json").read_text())


def test_a_worse_run_does_not_replace_latest_and_a_better_one_does(tmp_path):
    latest = latest_location(DataLocation(url=str(tmp_path)), "nightly")
    for name, acc, expect_promoted, expect_kept in [
        ("first", 0.80, True, "first"),
        ("worse", 0.70, False, "first"),
        ("better", 0.90, True, "better"),
        ("tie", 0.90, True, "tie"),  # "at least as good" keeps the newer model
    ]:
        summary, run = finished_run(tmp_path, name, acc)
        promotion = promote.fn(summary, run, latest, {"name": name, "flow_run_id": "id-" + name})
        assert promotion.promoted is expect_promoted, promotion.reason
        assert kept(latest)["run"]["name"] == expect_kept
    assert kept(latest)["run"]["url"] == str(tmp_path / "tie") and kept(latest)["final_val_acc"] == 0.90
    assert sorted(p.name for p in (tmp_path / "nightly" / "latest").iterdir()) == ["metrics.json", "model.json", "model.pt"]


def test_the_reason_says_what_was_compared(tmp_path):
    latest = latest_location(DataLocation(url=str(tmp_path)), "nightly")
    promote.fn(*finished_run(tmp_path, "good", 0.8), latest, {"name": "good", "flow_run_id": "1"})
    promotion = promote.fn(*finished_run(tmp_path, "bad", 0.5), latest, {"name": "bad", "flow_run_id": "2"})
    assert promotion.reason == "final_val_acc 0.5000 is worse than 0.8000 of good, which stays"
    assert (promotion.previous_run, promotion.previous_metric) == ("good", 0.8)


def test_a_deployment_name_cannot_escape_the_output_prefix(tmp_path):
    latest = latest_location(DataLocation(url="s3://bucket/out"), "../../etc")
    assert latest.url == "s3://bucket/out/etc/latest"


def test_warm_start_loads_every_weight_when_the_classes_match(tmp_path):
    latest = latest_location(DataLocation(url=str(tmp_path)), "nightly")
    summary, run = finished_run(tmp_path, "kept", 0.9)
    promote.fn(summary, run, latest, {"name": "kept", "flow_run_id": "1"})
    warm = find_warm_start(latest, "mobilenet_v3_small", CLASSES)
    assert warm is not None and warm.with_head and warm.run == "kept"
    model = build_model(ModelConfig(backbone="mobilenet_v3_small"), len(CLASSES))
    load_warm_start(model, warm)
    saved = torch.load(tmp_path / "kept" / "model.pt", weights_only=True)
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved)


def test_warm_start_keeps_a_fresh_head_when_the_classes_changed(tmp_path):
    latest = latest_location(DataLocation(url=str(tmp_path)), "nightly")
    summary, run = finished_run(tmp_path, "kept", 0.9)
    promote.fn(summary, run, latest, {"name": "kept", "flow_run_id": "1"})
    classes = CLASSES + ["star"]
    warm = find_warm_start(latest, "mobilenet_v3_small", classes)
    assert warm is not None and not warm.with_head
    model = build_model(ModelConfig(backbone="mobilenet_v3_small"), len(classes))
    load_warm_start(model, warm)
    saved = torch.load(tmp_path / "kept" / "model.pt", weights_only=True)
    assert torch.equal(model.state_dict()["features.0.0.weight"], saved["features.0.0.weight"])
    assert model.state_dict()["classifier.3.weight"].shape[0] == 4


@pytest.mark.parametrize("backbone, promoted", [("mobilenet_v3_small", False), ("resnet18", True)])
def test_no_warm_start_without_a_kept_model_of_that_backbone(tmp_path, backbone, promoted):
    latest = latest_location(DataLocation(url=str(tmp_path)), "nightly")
    if promoted:
        promote.fn(*finished_run(tmp_path, "kept", 0.9), latest, {"name": "kept", "flow_run_id": "1"})
    assert find_warm_start(latest, backbone, CLASSES) is None
