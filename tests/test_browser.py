"""The Run form as people see it, in headless Chromium against the session's `prefect server start`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from playwright.sync_api import expect
from prefect.client.orchestration import get_client

from tests.support.browser import (
    HOW_TO_GET_CHROMIUM,
    chromium_path,
    flow_run_by_name,
    prefect_ui,
    wait_for_final_state,
)
from tests.support.flow_runs import TINY_TRAINING

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ui(deployments, prefect_api):
    if chromium_path() is None:
        pytest.skip(f"the browser test needs Chromium; enable it with: {HOW_TO_GET_CHROMIUM}")
    with prefect_ui(prefect_api.removesuffix("/api")) as ui:
        yield ui


@pytest.fixture(scope="module")
def on_demand_id(deployments) -> str:
    with get_client(sync_client=True) as api:
        return str(api.read_deployment_by_name("transfer-learning/on-demand").id)


def test_the_run_form_renders_typed_fields_with_their_help_text(ui, on_demand_id):
    ui.open_run_form(on_demand_id)
    training = ui.field("training (Optional)")
    expect(ui.description(training)).to_contain_text("epochs, batch size, optimizer")
    expect(ui.description(ui.field("Epochs (Optional)", training))).to_have_text("Passes over the training images.")
    expect(ui.field("Lr (Optional)", training).locator("input[type=number]")).to_have_count(1)
    expect(ui.description(ui.field("epochs (Optional)"))).to_contain_text("Shortcut: sets training.epochs")
    data = ui.field("data (Optional)")
    ui.choose(data, "DataConfig")
    # The help text that once showed as '//.jpg': every word must reach the screen.
    expect(ui.description(ui.field("Url (Optional)", data))).to_contain_text(
        "Image folder laid out as URL/CLASS/IMAGE.jpg: s3://bucket/prefix")
    optimizer = ui.field("Optimizer (Optional)", training).locator(".p-select-button__control")
    expect(optimizer).to_have_text("sgd")


def test_a_custom_run_from_the_form_completes_with_its_artifacts(ui, on_demand_id, tmp_path_factory):
    output = tmp_path_factory.mktemp("browser-run")
    # The tiny recipe arrives prefilled; a person types the data block and the epochs.
    ui.open_run_form(on_demand_id, prefill={
        "training": {"batch_size": 4, "image_size": 32, "num_workers": 0, "epochs": 3},
        "cluster": {"n_workers": 2, "init_timeout_s": 60},
        "output": {"url": str(output)},
    })
    data = ui.field("data (Optional)")
    ui.choose(data, "DataConfig")
    block = ui.field("Block (Optional)", data)
    ui.choose(block, "str")
    block.locator("textarea").fill("test-images")
    ui.field("Epochs (Optional)", ui.field("training (Optional)")).locator("input").fill("1")
    name = ui.submit_run(on_demand_id, output_url=str(output))

    run = flow_run_by_name(name)
    assert run.parameters["data"]["block"] == "test-images" and run.parameters["training"]["epochs"] == 1
    assert wait_for_final_state(run.id, timeout_s=300) == "COMPLETED"
    ui.open_flow_run(str(run.id))
    report = ui.open_artifact("training-report")
    expect(report).to_contain_text("Transfer learning report")
    expect(report).to_contain_text("now points to")
    curves = report.locator("img.markdown-renderer__image").first
    expect(curves).to_be_visible()
    assert curves.evaluate("img => img.naturalWidth") > 300  # the PNG decoded, not a broken icon


def test_a_sweep_over_two_backbones_runs_from_the_form_and_each_trial_trains_its_own(ui, deployments, dask_cluster,
                                                                                     tmp_path_factory):
    """The sweep's form as people use it: its space and settings described, a space over a torchvision
    and a timm backbone submitted, and each trial's kept model built from the backbone it drew. On the
    session's cluster, by its address: a cluster of the sweep's own took longer to start than to train."""
    output = tmp_path_factory.mktemp("browser-sweep")
    backbones = ["mobilenet_v3_small", "timm/convnext_atto"]
    with get_client(sync_client=True) as api:
        sweep_id = str(api.read_deployment_by_name("hyperparameter-sweep/ui-sweep").id)
    ui.open_run_form(sweep_id, prefill={
        "space": {"model.backbone": {"kind": "grid", "values": backbones}},
        "settings": {"name": "ui-backbones", "n_trials": 2, "concurrency": 2, "ranks_per_trial": 1, "sampler": "grid"},
        "data": {"block": "test-images", "index_cache_minutes": 0},
        "training": TINY_TRAINING,
        "cluster": {"address": dask_cluster.scheduler_address, "init_timeout_s": 60},
        "output": {"url": str(output)},
    })
    expect(ui.description(ui.field("space"))).to_contain_text("Per dotted path (training.lr, training.batch_size")
    settings = ui.field("settings (Optional)")
    expect(ui.description(ui.field("Pruner (Optional)", settings))).to_contain_text("median")
    name = ui.submit_run(sweep_id, output_url=str(output))

    run = flow_run_by_name(name)
    assert run.parameters["space"]["model.backbone"]["values"] == backbones
    assert wait_for_final_state(run.id, timeout_s=600) == "COMPLETED"
    (record,) = [json.loads(path.read_text()) for path in output.rglob("sweep.json")]
    trained = {row["params"]["model.backbone"]: Path(row["model_url"]).parent for row in record["trials"]}
    assert sorted(trained) == sorted(backbones)
    for backbone, folder in trained.items():
        assert json.loads((folder / "model.json").read_text())["backbone"] == backbone
