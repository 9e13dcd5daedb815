"""A plain script that runs the flow with no PREFECT_API_URL, as a new user's first try does.

    python -m tests.support.plain_script_run IMAGES OUTPUT

Prefect then starts a temporary server for this process. Before exiting (which stops that
server) it prints, as JSON, what the server recorded of the run: the rank task runs and
the artifacts of the flow run, and the API URL every rank reported to.
"""

from __future__ import annotations

import json
import sys

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from prefect_ddp.flows.transfer_learning import transfer_learning
from prefect_ddp.tasks.config import (
    ClusterConfig,
    DataConfig,
    OutputConfig,
    TrainingConfig,
)
from tests.support.api_helpers import rank_task_runs


def main(images: str, output: str) -> None:
    state = transfer_learning(
        data=DataConfig(url=images, index_cache_minutes=0),
        training=TrainingConfig(epochs=1, batch_size=4, image_size=32, num_workers=0),
        cluster=ClusterConfig(n_workers=2, init_timeout_s=60),
        output=OutputConfig(url=output),
        return_state=True,
    )
    flow_run_id = state.state_details.flow_run_id
    ranks = rank_task_runs(flow_run_id, 2)
    with get_client(sync_client=True) as api:
        artifacts = api.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        api_url = str(api.api_url)
    print(json.dumps({
        "state": state.type.value,
        "api_url": api_url,
        "rank_task_runs": [{"name": r.name, "state": r.state.type.value, "flow_run_id": str(r.flow_run_id)}
                           for r in ranks],
        "artifacts": sorted(a.key for a in artifacts if a.key),
        "flow_run_id": str(flow_run_id),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:3])
