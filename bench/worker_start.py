"""How long the project's local CPU cluster takes to start its workers and to restart them:
forked from a forkserver that imported torch (blocks/worker_forkserver.py) against spawned,
each importing torch itself (the baseline, as `create_local_cluster` started them before).

    .venv/bin/python -m bench.worker_start [--workers 2] [--rounds 3]

Each round starts a cluster of `--workers` and waits until every worker has run a task, then
restarts every worker through its nanny (as the gang does after a stop) and waits again.
Prints a JSON line per round and method, then the medians and the forkserver / spawn ratios.
The CPU column is the workers' own CPU seconds when they first answer: a forked worker's
count starts at its fork. Record it in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import dask
import psutil
from distributed import Client, LocalCluster
from prefect.settings import PREFECT_API_URL, temporary_settings

from prefect_ddp.blocks.cluster import (
    LOOPBACK_DASHBOARD,
    PRELOADED_MODULES,
    TRAINING_DASK_CONFIG,
    create_local_cluster,
    worker_environment,
)
from prefect_ddp.blocks.worker_forkserver import SPAWN_CONFIG


def spawned_cluster(n_workers: int) -> LocalCluster:
    """The baseline: `create_local_cluster` as it was, each worker spawned and importing torch."""
    dask.config.set({**TRAINING_DASK_CONFIG, **SPAWN_CONFIG})
    return LocalCluster(n_workers=n_workers, threads_per_worker=1, preload=PRELOADED_MODULES,
                        dashboard_address=LOOPBACK_DASHBOARD, env=worker_environment())


def own_cpu_s() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


def one_round(start: Callable[[int], LocalCluster], n_workers: int) -> dict[str, Any]:
    began = time.perf_counter()
    with start(n_workers) as cluster, Client(cluster) as client:
        client.wait_for_workers(n_workers)
        cpu = client.run(own_cpu_s)
        started_s = time.perf_counter() - began
        began = time.perf_counter()
        client.restart_workers(list(client.scheduler_info(n_workers=-1)["workers"]), timeout=120)
        client.wait_for_workers(n_workers)
        client.run(own_cpu_s)
        restarted_s = time.perf_counter() - began
    return {"start_s": round(started_s, 2), "restart_s": round(restarted_s, 2),
            "worker_cpu_s": round(sum(cpu.values()) / n_workers, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    methods = {"spawn": spawned_cluster, "forkserver": lambda n: create_local_cluster(n_workers=n)}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in methods}
    # Workers are told a Prefect API they never call: without one, this process would start a
    # temporary Prefect server to name its URL (blocks/cluster.py, worker_environment).
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        for number in range(args.rounds):
            for name, start in methods.items():
                measured = one_round(start, args.workers)
                rounds[name].append(measured)
                print(json.dumps({"round": number, "method": name, **measured}), flush=True)
    medians = {name: {key: statistics.median(r[key] for r in measured) for key in measured[0]}
               for name, measured in rounds.items()}
    ratios = {key: round(medians["forkserver"][key] / medians["spawn"][key], 2) for key in medians["spawn"]}
    print(json.dumps({"workers": args.workers, "rounds": args.rounds, "median": medians,
                      "forkserver_over_spawn": ratios}))


if __name__ == "__main__":
    main()
