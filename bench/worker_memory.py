"""Issue 33: does a Dask worker's memory stay flat over many training runs?

    .venv/bin/python -m bench.worker_memory [--runs 30] [--backbone mobilenet_v3_small]

The training flow (`transfer_learning`, 2 epochs, 2 ranks of 32 px images, a loader process
each) `--runs` times on `dask scheduler` + 2 nanny workers (tests/support/external_dask.py), one
Prefect server. After each run, each worker's resident memory, then what a `malloc_trim(0)` run
on it from outside would still give back: the baseline in the same run, for memory glibc kept
that the ranks' own trim (tasks/gang/freed_memory.py) missed. Prints a JSON line per run, then
a summary: MB per run over the second half (a leak's slope), last / first run, the most an
outside trim gave back. Record it in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import tempfile
from pathlib import Path

import distributed
from prefect.settings import PREFECT_API_URL, temporary_settings

from prefect_ddp.deployments.local_services import prefect_server
from prefect_ddp.flows.transfer_learning import transfer_learning
from prefect_ddp.tasks.config import ClusterConfig, DataConfig, ModelConfig, OutputConfig, TrainingConfig
from tests.support.external_dask import TRAINING_ENV, dask_processes, owner_environment
from tests.support.gang_functions import resident_mb
from tests.support.image_folders import local_image_folder


def trimmed_mb() -> int:
    """Resident memory after glibc's `malloc_trim(0)` in this process (run on a worker)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return resident_mb()


def train_once(images: Path, output: Path, address: str, backbone: str) -> str:
    """One 2-rank training run on the cluster at `address`; its final state's name."""
    state = transfer_learning(
        data=DataConfig(url=str(images), val_fraction=0.25, seed=1, index_cache_minutes=0),
        model=ModelConfig(backbone=backbone),
        training=TrainingConfig(epochs=2, batch_size=8, image_size=32, num_workers=1),
        cluster=ClusterConfig(address=address, world_size=2, init_timeout_s=60),
        output=OutputConfig(url=str(output)),
        return_state=True,
    )
    return state.type.value


def slope(values: list[int]) -> float:
    """Least-squares MB per run of `values` (one per run)."""
    runs = range(len(values))
    return statistics.linear_regression(runs, values).slope if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--backbone", default="mobilenet_v3_small")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="worker-memory-"))
    images = work / "images"
    local_image_folder(images, per_class=60)
    home = work / "prefect-home"
    home.mkdir()
    os.environ["PREFECT_HOME"] = str(home)
    with prefect_server(home, database=home / "prefect.db") as api:
        env = owner_environment(home, TRAINING_ENV | {"PREFECT_API_URL": api})
        with temporary_settings({PREFECT_API_URL: api}), dask_processes(work, 2, nanny=True, env=env) as address, \
                distributed.Client(address, timeout=30) as client:
            rows = []
            for run in range(1, args.runs + 1):
                state = train_once(images, work / f"out-{run}", address, args.backbone)
                resident = client.run(resident_mb)
                trimmed = client.run(trimmed_mb)
                rows.append({"run": run, "state": state, "resident_mb": resident, "after_outside_trim_mb": trimmed})
                print(json.dumps(rows[-1]), flush=True)
    workers = sorted(rows[0]["resident_mb"])
    second_half = rows[len(rows) // 2:]
    print(json.dumps({
        "runs": len(rows),
        "completed": sum(row["state"] == "COMPLETED" for row in rows),
        "mb_per_run_second_half": {w: round(slope([row["resident_mb"][w] for row in second_half]), 2) for w in workers},
        "last_over_first": {w: round(rows[-1]["resident_mb"][w] / rows[0]["resident_mb"][w], 3) for w in workers},
        "most_an_outside_trim_gave_back_mb": max(row["resident_mb"][w] - row["after_outside_trim_mb"][w]
                                                 for row in rows for w in workers),
    }), flush=True)


if __name__ == "__main__":
    main()
