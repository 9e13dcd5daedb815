"""What a person types into the CLI or the Run form: shortcuts, refusals, and help text the UI shows whole."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prefect.utilities.callables import parameter_schema
from pydantic import ValidationError

from prefect_ddp.blocks.cluster import DaskCluster
from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.flows.sweep import hyperparameter_sweep
from prefect_ddp.flows.transfer_learning import kept_model_name, transfer_learning
from prefect_ddp.tasks.config import (
    DataConfig,
    ModelConfig,
    OutputConfig,
    TrainingConfig,
    with_overrides,
)

REPO = Path(__file__).resolve().parent.parent
# What the UI's markdown would read as an HTML tag and drop: `<url>`, `</x>`, `<a b>`.
HTML_TAG = re.compile(r"</?[A-Za-z][^>]*>")


@pytest.mark.unit
def test_a_shortcut_changes_one_field_and_keeps_the_others():
    deployed = TrainingConfig(epochs=10, batch_size=64, lr=0.1)
    changed = with_overrides(deployed, epochs=2, lr=None, batch_size=None)
    assert (changed.epochs, changed.batch_size, changed.lr) == (2, 64, 0.1)


@pytest.mark.unit
def test_shortcuts_are_validated_like_the_fields_they_set():
    with pytest.raises(ValidationError, match=r"lr\n  Input should be greater than 0"):
        with_overrides(TrainingConfig(), lr=0)


@pytest.mark.unit
def test_data_url_alone_is_enough_and_neither_names_both_ways():
    assert with_overrides(DataConfig.model_construct(), url="s3://b/p", block=None).url == "s3://b/p"
    with pytest.raises(ValidationError, match="Set data.url or data.block, or the shortcuts data_url or data_block"):
        with_overrides(DataConfig.model_construct(), url=None, block=None)


@pytest.mark.parametrize("parameters, field", [
    ({"lr": 0}, "lr"),
    ({"training": {"lr": -1}}, "lr"),
    ({"backbone": "vgg12"}, "backbone"),
    ({"model": {"backbone": "vgg12"}}, "backbone"),
    ({"training": {"epoch": 3}}, "epoch"),
])
def test_the_flow_refuses_bad_parameters_before_any_cluster_starts(prefect_api, parameters, field):
    from prefect.exceptions import ParameterTypeError

    state = transfer_learning(data=DataConfig(url="s3://nowhere/at-all"), **parameters, return_state=True)
    assert state.is_failed()
    with pytest.raises(ParameterTypeError, match=field):
        state.result()


@pytest.mark.unit
def test_warm_start_outside_a_deployment_needs_a_model_name():
    with pytest.raises(ValueError, match="model.warm_start=true .* sets no output.model_name"):
        kept_model_name(OutputConfig(), ModelConfig(warm_start=True))
    assert kept_model_name(OutputConfig(model_name="flowers"), ModelConfig(warm_start=True)) == "flowers"
    assert kept_model_name(OutputConfig(), ModelConfig()) is None


def ui_texts() -> dict[str, str]:
    """Every text the UI renders as markdown: help text, descriptions, deployment texts."""
    texts = {
        "flow parameters": json.dumps(parameter_schema(transfer_learning).model_dump()),
        "flow description": transfer_learning.description,
        "sweep parameters": json.dumps(parameter_schema(hyperparameter_sweep).model_dump()),
        "sweep description": hyperparameter_sweep.description,
        "data-location block": json.dumps(DataLocation.model_json_schema()) + DataLocation._description,
        "dask-cluster block": json.dumps(DaskCluster.model_json_schema()) + DaskCluster._description,
    }
    for deployment in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]:
        texts[f"deployment {deployment['name']}"] = deployment.get("description", "")
    return texts


@pytest.mark.unit
@pytest.mark.parametrize("name, text", ui_texts().items())
def test_no_text_the_ui_shows_holds_an_html_tag(name, text):
    assert not HTML_TAG.findall(text), f"{name} holds {HTML_TAG.findall(text)}, which the UI drops"


@pytest.mark.unit
@pytest.mark.parametrize("flow", [transfer_learning, hyperparameter_sweep], ids=lambda f: f.name)
def test_every_form_field_has_help_text(flow):
    schema = parameter_schema(flow).model_dump()
    missing = [name for name, field in schema["properties"].items() if not field.get("description")]
    for model_name, model in schema["definitions"].items():
        missing += [f"{model_name}.{f}" for f, spec in model["properties"].items() if not spec.get("description")]
    assert not missing
