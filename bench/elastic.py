"""Issue 32: what a change of an elastic gang's size costs, and the state handed over in memory
against a reload from storage.

    .venv/bin/python -m bench.elastic [--model resnet50] [--repeats 5] [--part boundary]

1. Hand-over: 3 gloo ranks on this machine; rank 0 holds the state of `--model` with SGD
   momentum, serialised as the recipe parks it. In memory: `hand_over` (an all-gather of
   positions, then a broadcast of the bytes from the rank that parked them). From storage:
   rank 0 reads the same bytes from a local file and broadcasts them, as a resume from a
   checkpoint does. Median of `--repeats` each.
2. Shrink and grow: tests/support/elastic_functions.py's gang on `dask scheduler` + 3
   `dask worker --no-nanny` processes and a Prefect server of its own: rank 1 of the first
   formation kills its worker mid-epoch, a new worker joins once the gang trains on 2, the gang
   grows back at the next epoch's end. Seconds lost per change: from the last step of the
   formation before to the first step of the next, less one step's own time.

3. Boundary: what asking "grow now?" costs, against what waiting for the epoch's end costs.
   An ask is `RankContext.regroup_requested`: a broadcast of one integer from rank 0 (timed
   here on 3 gloo ranks, median of 2,000), and rank 0's read of the grow flag in the scheduler
   (a `distributed.Event` round trip to a local scheduler, median of 200), made at most once a
   second. For an epoch of 1,000 steps of `t` seconds, asking every REGROUP_EVERY_STEPS steps
   costs (1000 / N) broadcasts plus at most one read a second; a worker that comes free waits
   on average N·t/2 for the gang instead of half an epoch.

Prints one JSON line per part; record them in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torchvision

from prefect_ddp.tasks.config import REGROUP_EVERY_STEPS
from prefect_ddp.tasks.data.storage import read_bytes
from prefect_ddp.tasks.gang import broadcast_bytes, free_port, process_group
from prefect_ddp.tasks.gang.process_group import broadcast_flag
from prefect_ddp.tasks.gang.handover import hand_over, park
from tests.support.external_dask import TRAINING_ENV, dask_processes, owner_environment, stop_all

RANKS = 3
STEP_S = 0.3


def state_bytes(model_name: str) -> bytes:
    model = getattr(torchvision.models, model_name)(weights=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    return buffer.getvalue()


def rank_times(rank: int, port: int, model_name: str, repeats: int, folder: str) -> None:
    torch.set_num_threads(1)
    data = state_bytes(model_name) if rank == 0 else b""
    path = Path(folder) / "checkpoint.pt"
    if rank == 0:
        path.write_bytes(data)
    memory, storage = [], []
    with process_group(backend="gloo", rank=rank, world_size=RANKS, master_addr="127.0.0.1", master_port=port,
                       timeout=timedelta(seconds=120)):
        for _ in range(repeats):
            if rank == 0:
                park("bench", (1, 0), data)
            torch.distributed.barrier()
            started = time.perf_counter()
            handed = hand_over("bench")
            memory.append(time.perf_counter() - started)
            assert handed is not None and len(handed.data) == len(data) or rank != 0
            torch.distributed.barrier()
            started = time.perf_counter()
            broadcast_bytes(read_bytes(str(path), {}) if rank == 0 else None)
            storage.append(time.perf_counter() - started)
    if rank == 0:
        (Path(folder) / "times.json").write_text(json.dumps({"memory": memory, "storage": storage, "mb": len(data) / 1e6}))


def hand_over_against_storage(model_name: str, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(rank_times, args=(free_port(), model_name, repeats, folder), nprocs=RANKS,
                           start_method="spawn")
        times = json.loads((Path(folder) / "times.json").read_text())
    memory, storage = statistics.median(times["memory"]), statistics.median(times["storage"])
    return {"part": "hand-over", "model": model_name, "state_mb": round(times["mb"], 1), "ranks": RANKS,
            "in_memory_s": round(memory, 3), "from_local_storage_s": round(storage, 3),
            "memory_vs_storage": round(memory / storage, 2)}


def shrink_and_grow() -> dict:
    from prefect.testing.utilities import prefect_test_harness

    from tests.support.elastic_functions import elastic_flow

    with tempfile.TemporaryDirectory() as folder, prefect_test_harness():
        from prefect.settings import PREFECT_API_URL

        marks = Path(folder) / "marks"
        marks.mkdir()
        env = owner_environment(Path(folder) / "home", TRAINING_ENV | {"PREFECT_API_URL": PREFECT_API_URL.value()})
        joined: list[subprocess.Popen] = []
        with dask_processes(Path(folder), RANKS, nanny=False, env=env) as address:
            def join_once_shrunk() -> None:
                while not any('"world_size": 2' in p.read_text() for p in marks.glob("trained-*")):
                    time.sleep(0.2)
                joined.append(subprocess.Popen(
                    [sys.executable, "-m", "dask", "worker", address, "--host", "127.0.0.1", "--nthreads", "1",
                     "--no-dashboard", "--no-nanny"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                    start_new_session=True))

            watcher = threading.Thread(target=join_once_shrunk, daemon=True)
            watcher.start()
            try:
                outcome = elastic_flow(address, {"marks": str(marks), "epochs": 6, "batch": 2, "step_s": STEP_S,
                                                 "kill_at": [1, 4]}, world_size=RANKS, min_world_size=2)
            finally:
                stop_all(joined)
        steps = [json.loads(line) | {"attempt": int(p.name.split("-")[1])}
                 for p in marks.glob("trained-*") for line in p.read_text().splitlines()]
    sizes = [a["world_size"] for a in outcome["attempts"]]
    lost = []
    for attempt in range(1, len(sizes)):
        last = max(s["at"] for s in steps if s["attempt"] == attempt - 1)
        first = min(s["at"] for s in steps if s["attempt"] == attempt)
        lost.append(round(first - last - STEP_S, 1))
    return {"part": "shrink and grow", "sizes": sizes, "seconds_lost": lost,
            "ended": [a["ended"][:60] for a in outcome["attempts"]], "load_average": os.getloadavg()}


def broadcast_times(rank: int, port: int, calls: int, folder: str) -> None:
    torch.set_num_threads(1)
    times = []
    with process_group(backend="gloo", rank=rank, world_size=RANKS, master_addr="127.0.0.1", master_port=port,
                       timeout=timedelta(seconds=120)):
        for _ in range(calls):
            started = time.perf_counter()
            broadcast_flag(False)
            times.append(time.perf_counter() - started)
    if rank == 0:
        (Path(folder) / "broadcast.json").write_text(json.dumps(statistics.median(times)))


def flag_read_s(reads: int = 200) -> float:
    import distributed

    with (distributed.LocalCluster(n_workers=1, processes=True, dashboard_address=":0") as cluster,
          distributed.Client(cluster) as client):
        event = distributed.Event("bench-grow-flag", client=client)
        times = []
        for _ in range(reads):
            started = time.perf_counter()
            event.is_set()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def boundary(steps_per_epoch: int = 1000) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(broadcast_times, args=(free_port(), 2000, folder), nprocs=RANKS, start_method="spawn")
        broadcast = json.loads((Path(folder) / "broadcast.json").read_text())
    read = flag_read_s()
    every = REGROUP_EVERY_STEPS
    cases = []
    for step_s in (0.02, 0.1, 0.5):
        epoch_s = steps_per_epoch * step_s
        asks_s = steps_per_epoch / every * broadcast + min(epoch_s, steps_per_epoch / every) * read
        cases.append({"step_s": step_s, "epoch_s": epoch_s, "asks_share_of_epoch": round(asks_s / epoch_s, 6),
                      "newcomer_waits_s": {"every_steps": round(every * step_s / 2, 2), "epoch_end": epoch_s / 2}})
    return {"part": "boundary", "ranks": RANKS, "broadcast_ms": round(broadcast * 1e3, 3),
            "flag_read_ms": round(read * 1e3, 3), "every_steps": every, "steps_per_epoch": steps_per_epoch,
            "cases": cases, "load_average": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--part", choices=["all", "boundary"], default="all")
    args = parser.parse_args()
    print(json.dumps({"cpus": os.cpu_count(), "load_average": os.getloadavg()}), flush=True)
    print(json.dumps(boundary()), flush=True)
    if args.part == "all":
        print(json.dumps(hand_over_against_storage(args.model, args.repeats)), flush=True)
        print(json.dumps(shrink_and_grow()), flush=True)


if __name__ == "__main__":
    main()
