"""The kept model's writes and a rank's, against a store that fails (issue 46's fault matrix).

Each cell breaks one kind of request to one object the product writes, through the S3 front
in front of moto (tests/support/faulty_s3.py), and asserts what a user relies on:

- the pointer (`NAME/latest.json`, a conditional PUT) and the version folder it names
  (`NAME/versions/RUN/model.pt`, ...): the promotion says kept, the pointer names this run's
  version, and that version's model loads;
- the checkpoint and `attempts.json` (`RUN/checkpoints/`): the run, retried where the fault
  failed it, trains every epoch exactly once when the checkpoint was kept whole, and
  its checkpoint and model load.

The other write paths' cells are in tests/test_write_faults_data.py; docs/testing.md lists
every cell.
"""

from __future__ import annotations

import json
import re

import pytest

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.deployments.local_services import MOTO_CREDENTIALS, MOTO_REGION, create_bucket
from prefect_ddp.tasks.config import ModelConfig
from prefect_ddp.tasks.data.storage import (
    READ_PART_BYTES,
    WRITE_PART_BYTES,
    read_bytes,
    read_bytes_reporting,
    save_torch,
    torch_from_bytes,
    write_bytes,
    write_json,
)
from prefect_ddp.tasks.results.promotion import kept_location, promote, read_pointer
from prefect_ddp.tasks.training.model import build_model, model_card, model_problem
from prefect_ddp.tasks.training.recipe import train_classifier
from tests.support.faulty_s3 import FaultyS3
from tests.test_promotion import CLASSES, summary_of
from tests.test_training import CTX, local_job

BUCKET = "store-faults"
# What each write meets once: the kinds a PUT can meet. 412 only where the PUT is conditional.
PUT_FAULTS = ["reset", "drop reply", "503", "500", "stall", "cut"]


@pytest.fixture(scope="module")
def bucket(s3_endpoint: str) -> str:
    create_bucket(s3_endpoint, BUCKET)
    return BUCKET


@pytest.fixture
def prefix(request) -> str:
    """The test's own folder in the bucket, named plainly (a pattern reads brackets as a set)."""
    return re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")


def through(front: FaultyS3, prefix: str) -> DataLocation:
    return DataLocation(url=f"s3://{BUCKET}/{prefix}", endpoint_url=front.endpoint, region_name=MOTO_REGION,
                        **MOTO_CREDENTIALS)


def finished_run(output: DataLocation, name: str) -> DataLocation:
    """A run folder as the flow leaves it: a real model.pt and model.json."""
    run = output.with_url(f"{output.url}/{name}")
    config = ModelConfig(backbone="mobilenet_v3_small")
    save_torch(f"{run.url}/model.pt", build_model(config, len(CLASSES)).state_dict(), run.storage_options())
    write_json(f"{run.url}/model.json", model_card(config, CLASSES, 32), run.storage_options())
    return run


def arm(front: FaultyS3, pattern: str, how: str) -> None:
    front.fault("PUT", pattern, how, times=1, seconds=0.5 if how == "stall" else 0.0)


@pytest.mark.parametrize(("target", "how"), [
    *(("latest.json", how) for how in [*PUT_FAULTS, "412"]),  # S3 answers 412 only to a conditional PUT
    *((f"versions/*/{name}", how) for name in ("model.pt", "model.json", "metrics.json") for how in PUT_FAULTS),
])
def test_a_promotion_keeps_a_model_that_loads_whatever_one_write_meets(bucket, front, prefix, target, how):
    output = through(front, prefix)
    kept = kept_location(output, "nightly")
    first, second = finished_run(output, "run-1"), finished_run(output, "run-2")
    promote.fn(summary_of(0.5), first, kept, {"name": "run-1", "flow_run_id": "1"}, kept_at_start=None)
    arm(front, f"{BUCKET}/{prefix}/nightly/{target}", how)
    result = promote.fn(summary_of(0.9), second, kept, {"name": "run-2", "flow_run_id": "2"},
                        kept_at_start=read_pointer(kept)["version"])
    assert front.rules_left() == 0, "the fault never fired"
    assert result.promoted and result.previous_run == "run-1", result  # decided against the model kept before
    pointer = read_pointer(kept)
    assert pointer["run"]["name"] == "run-2" and pointer["version"] == result.kept_url
    assert model_problem(kept.with_url(pointer["version"])) is None  # the kept model loads
    metrics = json.loads(read_bytes(f"{pointer['version']}/metrics.json", kept.storage_options()))
    assert metrics["run"]["name"] == "run-2"


@pytest.mark.parametrize("how", PUT_FAULTS)
@pytest.mark.parametrize("target", ["checkpoint.pt", "attempts.json"])
def test_a_retried_run_trains_each_epoch_once_whatever_a_checkpoint_write_meets(bucket, front, prefix, tmp_path,
                                                                                target, how):
    output = through(front, prefix)
    job = local_job(tmp_path, epochs=1).model_copy(update={"output": output})
    arm(front, f"{BUCKET}/{prefix}/checkpoints/{target}", how)
    try:
        train_classifier(CTX, job)
    except Exception:  # a write the store did not take: the gang's attempt fails, and it re-forms
        pass
    assert front.rules_left() == 0, "the fault never fired"
    again = train_classifier(CTX, local_job(tmp_path, epochs=2).model_copy(update={"output": output}))
    assert [row["epoch"] for row in again.history] == [1, 2]
    assert again.local_train_samples and len(again.local_train_samples) == 1  # epoch 1 was not trained again
    options = output.storage_options()
    checkpoint = torch_from_bytes(read_bytes(f"{output.url}/checkpoints/checkpoint.pt", options))
    assert [row["epoch"] for row in checkpoint["history"]] == [1, 2]
    assert model_problem(output) is None  # the run's model loads
    assert again.attempts[-1]["resumed_after_epoch"] == 1


def test_a_large_read_shows_progress_as_its_parts_arrive(bucket, front, prefix):
    """A rank reading the kept model for the champion's scoring reports each part (issue 46: it was
    silent for the whole download, which a model of gigabytes can make longer than the hang limit)."""
    output = through(front, prefix)
    data = bytes(range(256)) * (READ_PART_BYTES * 2 // 256 + 1)  # three parts
    write_bytes(f"{output.url}/model.pt", data, output.storage_options())
    parts: list[float] = []
    read = read_bytes_reporting(f"{output.url}/model.pt", output.storage_options(), lambda: parts.append(1.0))
    assert read == data and len(parts) == 3


def test_a_large_write_shows_progress_per_part_and_lands_whole_though_a_part_is_cut(bucket, front, prefix):
    """A rank writing a large checkpoint reports each part sent (a stuck write reports none, and is
    taken for a hang); a part the store keeps short fails the upload's completion: sent again."""
    output = through(front, prefix)
    data = bytes(range(256)) * (WRITE_PART_BYTES * 2 // 256 + 1)  # three parts
    arm(front, f"{BUCKET}/{prefix}/checkpoint.pt", "cut")
    parts: list[float] = []
    write_bytes(f"{output.url}/checkpoint.pt", data, output.storage_options(), on_part=lambda: parts.append(1.0))
    assert front.rules_left() == 0 and read_bytes(f"{output.url}/checkpoint.pt", output.storage_options()) == data
    assert len(parts) == 6  # three parts, twice
