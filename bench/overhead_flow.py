"""The flow side of bench/overhead.py, started as its own process, as a user's flow file is.

`python -m bench.overhead_flow --out DIR --config JSON` runs one flow that takes its
cluster as the project's flows do (`ClusterLifetime.of` a 2-worker `DaskCluster`: the warm
cluster of the process that started it where there is one, else a LocalCluster started and
closed by the run), calling `run_gang` on bench/overhead_rank.py's `gang_rank`. It writes what the
ranks measured and the flow's own marks to DIR/flow.json. Started this way the flow pays
what torchrun pays: a fresh interpreter and its imports, then the ranks' processes.
"""

from __future__ import annotations

import argparse
import json
import time

PROCESS_START = time.time()  # before the imports below, which are part of what a flow costs

from pathlib import Path
from typing import Any

from prefect import flow

from bench.overhead_rank import gang_rank
from prefect_ddp.blocks.cluster import DaskCluster
from prefect_ddp.blocks.cluster_lifetime import ClusterLifetime
from prefect_ddp.tasks.gang import run_gang

WORLD_SIZE = 2


@flow(name="overhead-bench", log_prints=False)
def gang_flow(config: dict[str, Any]) -> dict[str, Any]:
    """The flow a user would write: one run_gang call on the cluster the project's flows would use."""
    body_start = time.time()
    with ClusterLifetime.of(DaskCluster(n_workers=WORLD_SIZE)) as cluster:
        runner = cluster.ready()
        cluster_ready = time.time()
        ranks = list(run_gang(gang_rank, config, world_size=WORLD_SIZE, task_runner=runner))
        gang_returned = time.time()
    marks = {"body_start": body_start, "cluster_ready": cluster_ready, "gang_returned": gang_returned,
             "warm": cluster.is_warm}
    return {"ranks": ranks, "marks": marks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", type=json.loads, required=True)
    args = parser.parse_args()
    imported = time.time()
    result = gang_flow(args.config)
    result["marks"] |= {"process_start": PROCESS_START, "imported": imported, "flow_returned": time.time()}
    (args.out / "flow.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
