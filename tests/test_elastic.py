"""An elastic gang on an existing cluster (`dask scheduler` and `dask worker` processes): it
shrinks when a worker is lost mid-epoch, grows back at an epoch's end when a new one joins,
and hands its state over in memory both ways (tasks/gang/resizing.py, handover.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import distributed
import pytest

from prefect_ddp.flows.transfer_learning import transfer_learning
from prefect_ddp.tasks.gang import GangError
from prefect_ddp.tasks.gang.grow_watch import GrowWatch, free_workers
from prefect_ddp.tasks.gang.lease import leased_workers
from prefect_ddp.tasks.config import ClusterConfig, DataConfig, ModelConfig, OutputConfig, TrainingConfig
from tests.support.elastic_functions import IMAGES, elastic_flow
from tests.support.image_folders import local_image_folder
from tests.support.external_dask import TRAINING_ENV, dask_processes, owner_environment, stop_all

pytestmark = pytest.mark.slow

EPOCHS, BATCH = 5, 2
KILL_AT = [1, 4]  # rank 1 of the first formation is lost before step 4 of epoch 1 (from 0)


def records(marks: Path, pattern: str) -> list[dict]:
    return [json.loads(line) for path in sorted(marks.glob(pattern)) for line in path.read_text().splitlines()]


def start_worker_once_shrunk(address: str, marks: Path, env: dict[str, str], started: list) -> None:
    """Once the gang trains on 2 ranks, a new worker joins (a replaced spot instance)."""
    deadline = time.monotonic() + 300
    while not any(r["world_size"] == 2 for r in records(marks, "trained-*")):
        if time.monotonic() > deadline:
            return
        time.sleep(0.5)
    with open(marks / "new-worker.log", "wb") as log:
        started.append(subprocess.Popen(
            [sys.executable, "-m", "dask", "worker", address, "--host", "127.0.0.1", "--nthreads", "1",
             "--no-dashboard", "--no-nanny"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))


def test_a_gang_shrinks_on_a_lost_worker_grows_back_on_a_new_one_and_trains_each_image_once(
        tmp_path, prefect_home, prefect_api):
    marks = tmp_path / "marks"
    marks.mkdir()
    env = owner_environment(prefect_home, TRAINING_ENV | {"PREFECT_API_URL": prefect_api})
    joined: list[subprocess.Popen] = []
    with dask_processes(tmp_path, 3, nanny=False, env=env) as address:
        watcher = threading.Thread(target=start_worker_once_shrunk, args=(address, marks, env, joined))
        watcher.start()
        try:
            outcome = elastic_flow(address, {"marks": str(marks), "epochs": EPOCHS, "batch": BATCH, "step_s": 0.4,
                                             "kill_at": KILL_AT}, world_size=3, min_world_size=2)
        finally:
            watcher.join()
            stop_all(joined)
    sizes = [a["world_size"] for a in outcome["attempts"]]
    assert sizes[:3] == [3, 2, 3], outcome["attempts"]
    assert "left the cluster" in outcome["attempts"][0]["ended"]
    assert outcome["attempts"][1]["ended"].startswith("regrouped"), outcome["attempts"]
    assert [r["world_size"] for r in outcome["results"]] == [3, 3, 3]
    # Every epoch trained each image once, up to the sampler's bounded remainder: fewer than
    # world-size repeats from padding, and at most world-size left out with a last batch of one.
    trained = records(marks, "trained-*")
    for epoch in range(EPOCHS):
        counts = Counter(i for r in trained if r["epoch"] == epoch for i in r["images"])
        skipped = IMAGES - len(counts)
        repeated = sum(n - 1 for n in counts.values())
        assert skipped <= 3 and repeated < 3, (epoch, skipped, repeated)
    # No checkpoint exists: each formation after the first took the state a survivor parked, the same on every rank.
    taken, parked = records(marks, "taken"), records(marks, "parked")
    for attempt in (1, 2):
        took = {r["checksum"] for r in taken if r["attempt"] == attempt}
        left = {r["checksum"] for r in parked if r["attempt"] == attempt - 1}
        assert len(took) == 1 and took <= left, (attempt, took, left)
    assert len({r["checksum"] for r in outcome["results"]}) == 1  # DDP kept the ranks' weights equal


def kill_a_worker_in_epoch_2_then_add_one(address: str, output: Path, env: dict[str, str], folder: Path,
                                          started: list) -> None:
    """Once the run has checkpointed epoch 1, SIGKILL one worker (no nanny: it stays lost), then a new
    worker joins."""
    deadline = time.monotonic() + 300
    while not list(output.glob("*/checkpoints/checkpoint.pt")):
        if time.monotonic() > deadline:
            return
        time.sleep(0.2)
    time.sleep(1.0)  # into epoch 2
    with distributed.Client(address, timeout=30) as client:
        pids = client.run(os.getpid)
    os.kill(sorted(pids.values())[-1], signal.SIGKILL)
    time.sleep(3.0)  # the gang shrinks first
    with open(folder / "new-worker.log", "wb") as log:
        started.append(subprocess.Popen(
            [sys.executable, "-m", "dask", "worker", address, "--host", "127.0.0.1", "--nthreads", "1",
             "--no-dashboard", "--no-nanny"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))


def test_the_training_flow_shrinks_and_grows_back_handing_its_state_over_in_memory(tmp_path, prefect_home, prefect_api):
    images, output = tmp_path / "images", tmp_path / "output"
    local_image_folder(images, per_class=60)
    env = owner_environment(prefect_home, TRAINING_ENV | {"PREFECT_API_URL": prefect_api})
    joined: list[subprocess.Popen] = []
    with dask_processes(tmp_path, 3, nanny=False, env=env) as address:
        chaos = threading.Thread(target=kill_a_worker_in_epoch_2_then_add_one,
                                 args=(address, output, env, tmp_path, joined))
        chaos.start()
        try:
            state = transfer_learning(
                data=DataConfig(url=str(images), val_fraction=0.25, seed=1, index_cache_minutes=0),
                model=ModelConfig(backbone="mobilenet_v3_small"),
                # Asked every 3 steps: the gang grows mid-epoch or at an epoch's end, whichever comes first.
                training=TrainingConfig(epochs=8, batch_size=2, image_size=32, num_workers=0, regroup_every_steps=3),
                cluster=ClusterConfig(address=address, world_size=3, min_world_size=2, init_timeout_s=60,
                                      max_restarts=2),
                output=OutputConfig(url=str(output)),
                return_state=True,
            )
        finally:
            chaos.join()
            stop_all(joined)
    summary = state.result()
    sizes = [a["world_size"] for a in summary["attempts"]]
    assert sizes[:2] == [3, 2] and 3 in sizes[2:], summary["attempts"]
    assert [a["handed_over"] for a in summary["attempts"]][1:] == [True] * (len(sizes) - 1), summary["attempts"]
    assert summary["world_size"] == 3 and len(summary["history"]) == 8
    # Each epoch trained the training set once, the one taken over mid-epoch too (both formations' images),
    # up to the sampler's bounded remainder (fewer than 3 repeats, at most 3 left out).
    size = summary["train_size"]
    assert all(size - 3 <= h["train_samples"] < size + 3 for h in summary["history"]), summary["history"]
    run_dir = Path(summary["files"]["model.pt"]).parent
    assert json.loads((run_dir / "model.json").read_text())["epoch"] == summary["best_epoch"]
    assert "Its size changed: 3 -> 2 ranks, 2 -> 3 ranks" in (run_dir / "report.md").read_text()


def test_a_size_range_s_minimum_holds_without_a_top_a_gang_never_grows_onto_another_s_worker_and_a_worker_a_regroup_did_not_get_is_not_asked_for_again():
    with (distributed.LocalCluster(n_workers=2, processes=False, protocol="tcp", dashboard_address=":0") as cluster,
          distributed.Client(cluster) as client):
        with pytest.raises(GangError, match=r"min_world_size=3 needs 3 Dask workers .* the cluster has 2"):
            with leased_workers(client, None, "a gang", timeout_s=2, min_world_size=3):
                pass
        with leased_workers(client, None, "a gang", timeout_s=30, min_world_size=1) as leases:
            assert len(leases) == 2  # no top: every free worker
        with leased_workers(client, 1, "another sweep trial", timeout_s=30) as held:
            (others,) = held
            beside = GrowWatch(client, "prefect-ddp-stop:test", 1, None)
            beside._next_check = 0
            beside.check()
            assert beside.requested and others not in beside.requested  # only the worker no gang holds
            beside.close()
        free = free_workers(client)
        assert others in free  # given back
        refused = GrowWatch(client, "prefect-ddp-stop:test", 1, None, not_growing=set(free))
        refused._next_check = 0
        refused.check()
        assert refused.requested is None
        wanted = GrowWatch(client, "prefect-ddp-stop:test", 1, None)
        wanted._next_check = 0
        wanted.check()
        assert wanted.requested == free
        wanted.close()
