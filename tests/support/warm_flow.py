"""A flow run in its own process, as `prefect-ddp worker` starts one, that reports which workers ran its ranks.

    python -m tests.support.warm_flow OUT.json

It takes its cluster as the project's flows do (`ClusterLifetime.of` a 2-worker
`DaskCluster`) and writes {"warm": used the warm cluster, "pids": each rank's process id}.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

from prefect import flow

from prefect_ddp.blocks.cluster import DaskCluster
from prefect_ddp.blocks.cluster_lifetime import ClusterLifetime
from prefect_ddp.tasks.gang import RankContext, run_gang


def rank_pid(ctx: RankContext, config: None) -> int:
    return os.getpid()


@flow(name="warm-cluster-check")
def warm_flow() -> dict:
    with ClusterLifetime.of(DaskCluster(n_workers=2)) as cluster:
        pids = list(run_gang(rank_pid, None, task_runner=cluster.ready(), init_timeout=timedelta(seconds=60)))
        return {"warm": cluster.is_warm, "pids": sorted(pids)}


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(warm_flow()))
