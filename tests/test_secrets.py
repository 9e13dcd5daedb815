"""A credential saved in a block appears nowhere a run leaves things: logs, artifacts, task
run states, the flow run's parameters, its result (returned and persisted), output files,
or what any process printed."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
)

from prefect_ddp.blocks.data_location import DataLocation
from tests.support.api_helpers import all_logs
from tests.support.flow_runs import block_copy, run_tiny_flow


def server_records(flow_run_id) -> dict[str, str]:
    """Everything the Prefect server keeps about the run, as text."""
    with get_client(sync_client=True) as api:
        flow_run = api.read_flow_run(flow_run_id)
        logs = all_logs(api, flow_run_id, "epoch 1/1")
        artifacts = api.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
        task_runs = api.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {
        "flow run": flow_run.model_dump_json(),
        "logs": "\n".join(log.message for log in logs),
        "artifacts": "\n".join(f"{a.description} {json.dumps(a.data)}" for a in artifacts),
        "task runs": "\n".join(t.model_dump_json() for t in task_runs),
    }


def test_a_blocks_secret_reaches_no_log_artifact_result_or_file(
    image_location: DataLocation, dask_cluster, s3_fs, prefect_home: Path, capfd, tmp_path,
):
    secret = f"never-show-{uuid.uuid4().hex}"
    block_copy(image_location, aws_secret_access_key=secret).save("secret-images", overwrite=True)
    output = "s3://test-images/secret-test-outputs"
    state = run_tiny_flow(output, {"address": dask_cluster.scheduler_address, "world_size": 2},
                          data={"block": "secret-images"})
    summary = state.result()
    assert summary["history"], "the run must have trained to show anything"
    places = server_records(state.state_details.flow_run_id)
    assert "epoch 1/1" in places["logs"] and places["artifacts"]  # the ranks' logs are in too
    places["returned result"] = json.dumps(summary, default=str)
    outputs = s3_fs.find(output.removeprefix("s3://"))
    assert any(key.endswith("model.pt") for key in outputs)
    places |= {f"output {key}": s3_fs.cat_file(key).decode("latin-1") for key in outputs}
    storage = Path(os.environ.get("PREFECT_LOCAL_STORAGE_PATH", prefect_home / "storage"))
    places |= {f"persisted {p}": p.read_bytes().decode("latin-1") for p in storage.rglob("*") if p.is_file()}
    printed = capfd.readouterr()
    places["stdout and stderr"] = printed.out + printed.err
    leaked = [where for where, text in places.items() if secret in text]
    assert not leaked, f"the secret was found in: {leaked}"
