"""The flow side of bench/overhead.py, started as its own process, as a user's flow file is.

`python -m bench.overhead_flow --out DIR --config JSON` runs one flow whose task runner is
the one a `DaskCluster` block makes (a 2-worker LocalCluster started and closed by the
run), calling `run_gang` on bench/overhead_rank.py's `gang_rank`. It writes what the
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
from prefect_ddp.tasks.gang import current_dask_runner, run_gang

WORLD_SIZE = 2


@flow(name="overhead-bench", log_prints=False)
def gang_flow(config: dict[str, Any]) -> dict[str, Any]:
    """The flow a user would write: one run_gang call on the flow's own Dask cluster."""
    body_start = time.time()
    current_dask_runner().client  # the runner's cluster is up once it has a client: here, to time it
    cluster_ready = time.time()
    ranks = list(run_gang(gang_rank, config, world_size=WORLD_SIZE))
    marks = {"body_start": body_start, "cluster_ready": cluster_ready, "gang_returned": time.time()}
    return {"ranks": ranks, "marks": marks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", type=json.loads, required=True)
    args = parser.parse_args()
    imported = time.time()
    runner = DaskCluster(n_workers=WORLD_SIZE).task_runner()
    result = gang_flow.with_options(task_runner=runner)(args.config)
    result["marks"] |= {"process_start": PROCESS_START, "imported": imported, "flow_returned": time.time()}
    (args.out / "flow.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
