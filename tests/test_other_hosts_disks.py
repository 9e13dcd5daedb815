"""Workers that do not share the flow's disk, as on another host or in a container.

Two `dask worker`s run in a mount namespace of their own, where an empty tmpfs covers this
module's folder: the flow's files there are invisible to them, as a local folder of the
flow's host is to a remote GPU box. A local output is then refused before training (the
ranks would write their own disk, and the flow find no model after the whole training),
and a sweep whose study is in that folder still works: only the sweep's process opens it.
batch-predict's workers read the model copy from the run's folder and write their chunks
there, so it refuses such an output before scoring as well.
Needs root and util-linux's `unshare`, as CI has; skips with the reason elsewhere.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_ddp.tasks.data.check_memory import CHECKS_FOLDER
from prefect_ddp.flows.batch_predict import batch_predict
from prefect_ddp.flows.sweep import hyperparameter_sweep
from prefect_ddp.tasks.config import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    OutputConfig,
    TrainingConfig,
)
from prefect_ddp.tasks.data.storage import save_torch, write_json
from prefect_ddp.tasks.gang import GangRefused
from prefect_ddp.tasks.prediction.workers import ScoringRefused
from prefect_ddp.tasks.sweeps.settings import SweepSettings
from prefect_ddp.tasks.training.model import build_model
from tests.support.api_helpers import rank_task_runs
from tests.support.external_dask import TRAINING_ENV, dask_processes, owner_environment
from tests.support.flow_runs import assert_failed_cleanly, run_tiny_flow

if os.geteuid() != 0 or shutil.which("unshare") is None:
    pytestmark = pytest.mark.skip(reason="needs root and unshare(1) for workers in a mount namespace")


@pytest.fixture(scope="module")
def flow_only(tmp_path_factory) -> Path:
    """A folder of the flow's that the remote workers cannot see."""
    return tmp_path_factory.mktemp("flow-only")


@pytest.fixture(scope="module")
def remote_disk_cluster(tmp_path_factory, flow_only: Path, prefect_home: Path, prefect_api: str) -> Iterator[str]:
    """A scheduler and two workers set up for training whose view of `flow_only` is an empty tmpfs."""
    own_disk = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                'mount -t tmpfs tmpfs "$0" && exec "$@"', str(flow_only)]
    settings = TRAINING_ENV | {"PREFECT_API_URL": prefect_api}
    with dask_processes(tmp_path_factory.mktemp("remote-disk-cluster"), 2, nanny=True,
                        env=owner_environment(prefect_home, settings), worker_prefix=own_disk) as address:
        yield address


def test_a_local_output_the_workers_cannot_see_is_refused_before_training(remote_disk_cluster, flow_only,
                                                                          image_location):
    image_location.save("test-images", overwrite=True)
    output = flow_only / "outputs"
    state = run_tiny_flow(output, {"address": remote_disk_cluster})
    assert_failed_cleanly(state, GangRefused, rf"output {output}.*does not see the flow's files there.*"
                          r"Fix: give an s3:// output .*output.shared=true")
    assert rank_task_runs(state.state_details.flow_run_id, expected=0) == []  # no rank trained
    # Beside the run folder, only the flow's own decode-check memory (tasks/data/check_memory.py).
    (run_folder,) = (entry for entry in output.iterdir() if entry.name != CHECKS_FOLDER)
    assert sorted(p.name for p in run_folder.iterdir()) == ["run.json"]  # nothing but the claim


def test_batch_predict_refuses_a_local_output_the_workers_cannot_see_before_scoring(remote_disk_cluster, flow_only,
                                                                                    image_location, tmp_path):
    image_location.save("test-images", overwrite=True)
    model = tmp_path / "model"  # a model that loads (keep_model checks it), refused before any worker loads it
    model.mkdir()
    save_torch(str(model / "model.pt"), build_model(ModelConfig(backbone="mobilenet_v3_small"), 2).state_dict(), {})
    write_json(str(model / "model.json"), {"backbone": "mobilenet_v3_small", "classes": ["a", "b"], "image_size": 32},
               {})
    output = flow_only / "predictions"
    state = batch_predict(model=str(model), data_block="test-images", output_url=str(output),
                          cluster={"address": remote_disk_cluster}, return_state=True)
    assert_failed_cleanly(state, ScoringRefused, rf"The run folder {output}/\S+ is local to the flow's host, and "
                          r"worker\(s\) .* do not see the flow's files there.*Fix: give an s3:// output_url.*"
                          r"output_shared=true")
    (run_folder,) = output.iterdir()
    assert sorted(p.name for p in run_folder.iterdir()) == ["keys.json", "model", "run.json"]  # no chunk scored


def test_a_sweep_works_where_the_workers_cannot_reach_its_study(remote_disk_cluster, flow_only, image_location,
                                                                s3_fs):
    """The study is SQLite in the flow's folder; the trials write to S3; every report reaches the study."""
    image_location.save("test-images", overwrite=True)
    study = flow_only / "studies" / "study.db"
    study.parent.mkdir()
    record = hyperparameter_sweep(
        space={"training.lr": {"kind": "grid", "values": [0.001, 0.002]}},
        settings=SweepSettings(name="remote", n_trials=2, concurrency=2, sampler="grid", pruner="none",
                               storage=f"sqlite:///{study}"),
        data=DataConfig(block="test-images", index_cache_minutes=0),
        model=ModelConfig(backbone="mobilenet_v3_small"),
        training=TrainingConfig(epochs=1, batch_size=4, image_size=32, num_workers=0),
        cluster=ClusterConfig(address=remote_disk_cluster, init_timeout_s=60),
        output=OutputConfig(url=f"s3://{image_location.url.split('/')[2]}/sweep-outputs"),
    )
    trials = {row["trial"]: row for row in record["trials"]}
    assert [trials[n]["state"] for n in (0, 1)] == ["completed", "completed"], trials
    assert all([p["epoch"] for p in row["curve"]] == [1] for row in trials.values())  # every report reached it
    assert record["best"]["model_url"].startswith("s3://") and s3_fs.exists(record["best"]["model_url"])
    assert study.stat().st_size > 0
