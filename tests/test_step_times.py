"""Where training time goes: each step's parts add up to the training pass, and the verdict
names what bounds it.

The units check the verdict's rules on hand-made rows. The gloo test runs the real recipe
on two real ranks twice: on local images, then on S3 images whose every GET the front holds
for a moment, which must come out input-bound with the advice for an object store.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.indexing import build_manifest
from prefect_ddp.tasks.data.loaders import LoaderWorkers
from prefect_ddp.tasks.data.splitting import stratified_split
from prefect_ddp.tasks.gang import free_port
from prefect_ddp.tasks.data.dataset import train_transform
from prefect_ddp.tasks.training.decode_cost import DecodeCost, DecodeProbe, probe_decode
from prefect_ddp.tasks.training.job import TrainJob
from prefect_ddp.tasks.training import step_times
from prefect_ddp.tasks.training.step_times import PARTS, StepClock, epoch_timing, input_advice
from tests.support.faulty_s3 import FaultyS3
from tests.support.flow_runs import block_copy
from tests.support.image_folders import local_image_folder
from tests.support.rank_processes import start_ranks
from tests.support.two_ranks import train_as_rank

CPU = torch.device("cpu")


def row(data=1.0, forward=2.0, backward=4.0, sync=0.5, optimizer=0.4, other=0.1, images=100.0) -> list[float]:
    parts = [data, forward, backward, sync, optimizer, other]
    return parts + [1.0, sum(parts), images]


@pytest.mark.unit
def test_a_rank_that_waits_for_data_most_of_each_step_is_input_bound_with_the_object_store_advice():
    timing = epoch_timing([row(data=6.0), row(data=6.0)], input_advice(TrainingConfig(), from_object_store=True,
                                                                                 loader_processes=2, cached=False))
    assert timing.verdict.startswith("input-bound: 46% of each step waits for data; ")
    assert "training.images_per_shard" in timing.verdict and "training.cache_gb" in timing.verdict
    assert timing.images_per_s == round(200 / 13.0, 1)  # both ranks' images over the slower pass


@pytest.mark.unit
def test_input_advice_follows_the_run_settings():
    local = input_advice(TrainingConfig(num_workers=0), from_object_store=False, loader_processes=0, cached=False)
    assert "training.num_workers" in local and "images_per_shard" not in local
    sharded = input_advice(TrainingConfig(images_per_shard=64), from_object_store=True, loader_processes=3,
                           cached=True)
    assert "images_per_shard" not in sharded and "cache_gb" not in sharded and "more loader workers" in sharded


@pytest.mark.unit
def test_an_input_bound_rank_whose_loaders_are_busy_decoding_is_cpu_bound_with_the_cores_it_needs():
    # Each rank: 100 images in a 13 s pass (7.7/s), 6.4 s of compute (64 ms per image).
    busy = DecodeCost(megapixels=0.2, original_s=0.1, resized_s=0.04, side=96)  # 7.7 s of decoding: 1 process busy
    rows = [row(data=6.0), row(data=6.0)]
    timing = epoch_timing(rows, "advice", lambda: busy, LoaderWorkers(1, "", cpus=2))
    assert timing.verdict.startswith("CPU-bound: 46% of each step waits for data while its 1 loader process(es)")
    # 100 ms of decoding per image at 64 ms of compute: 2 loader processes, and the rank itself.
    assert "a rank needs about 3 cores (on a GPU host, 3 per GPU)" in timing.verdict
    assert "it has 2. Run fewer ranks per host" in timing.verdict
    # A rank that may use more cores than its loader processes and itself is told to use them.
    capped = epoch_timing(rows, "advice", lambda: busy, LoaderWorkers(1, "", cpus=96))
    assert capped.verdict.endswith("it may use 96 and uses 2: set training.num_workers=2.")
    # Never past training.num_workers's maximum, however many cores a rank has.
    huge = epoch_timing(rows, "advice", lambda: DecodeCost(0.2, 10.0, 9.0, 96), LoaderWorkers(32, "", cpus=192))
    assert huge.verdict.endswith("it may use 192 and uses 33: set training.num_workers=64.")
    at_most = epoch_timing(rows, "advice", lambda: DecodeCost(0.2, 10.0, 9.0, 96), LoaderWorkers(64, "", cpus=192))
    assert at_most.verdict.endswith("it uses 65 of its 192, the most training.num_workers allows (64): decode on "
                                    "the device (training.decode_on='device') or read pre-resized shards "
                                    "(training.images_per_shard).")
    alone = epoch_timing(rows, "advice", lambda: busy, LoaderWorkers(0, "", cpus=1))
    assert "while the rank decodes and augments its batches itself, 100.0 ms per image" in alone.verdict
    # The same decoding spread over 8 loader processes leaves them mostly idle: the storage is what it waits for.
    idle = epoch_timing(rows, "advice", lambda: busy, LoaderWorkers(8, "", cpus=9))
    assert idle.verdict.startswith("input-bound: 46% of each step waits for data; advice")


@pytest.mark.unit
def test_a_rank_slower_than_the_others_is_named_before_anything_else():
    # Ranks 0 and 2 wait for rank 1 in the sync: their own work is the same as each other's.
    timing = epoch_timing([row(sync=4.0), row(forward=4.0, backward=8.0), row(sync=4.0)], "")
    assert timing.slowest_rank == 1 and timing.slower_by == 1.8
    assert timing.verdict.startswith("rank 1 is 1.8x slower than the median of the others (most of it computing)")


@pytest.mark.unit
def test_a_step_mostly_waiting_in_gradient_sync_is_communication_bound():
    timing = epoch_timing([row(sync=5.0), row(sync=5.0)], "")
    assert timing.verdict.startswith("communication-bound: 40% of each step waits on gradient sync")


@pytest.mark.unit
def test_otherwise_the_step_is_compute_bound():
    assert epoch_timing([row(), row()], "").verdict == (
        "compute-bound: 80% of each step is forward, backward and optimizer; the input keeps up.")


@pytest.mark.unit
def test_backward_is_split_where_the_last_gradient_arrives(monkeypatch):
    # A clock that moves only when told: the split is asserted exactly, whatever the load.
    now = [100.0]
    monkeypatch.setattr(step_times, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def wait(seconds: float) -> None:
        now[0] += seconds

    clock = StepClock(CPU)
    clock.start()
    wait(0.02)
    clock.mark("data")
    wait(0.03)
    clock.gradient_ready()
    wait(0.05)
    clock.after_backward()
    wait(0.01)
    clock.after_backward()  # no bucket this time (no DDP): all of it is backward
    parts = clock.totals()
    assert parts["data"] == pytest.approx(0.02)
    assert parts["backward"] == pytest.approx(0.04) and parts["sync"] == pytest.approx(0.05)


def job(source: DataLocation, manifest, output: Path, epochs: int) -> TrainJob:
    return TrainJob(
        source=source, output=DataLocation(url=str(output)), manifest=manifest,
        split=stratified_split(manifest, 0.25, 0), model=ModelConfig(backbone="mobilenet_v3_small"),
        training=TrainingConfig(epochs=epochs, batch_size=4, image_size=32, num_workers=0, optimizer="adamw", lr=1e-3),
    )


def test_the_parts_add_up_to_the_training_pass_and_slow_reads_make_it_input_bound(
        tmp_path, image_location: DataLocation, front: FaultyS3, s3_fs):
    local = local_image_folder(tmp_path / "images", per_class=8)
    prefix = image_location.url.removeprefix("s3://")
    found = s3_fs.find(prefix, detail=True)
    remote = build_manifest(image_location.url, {path.removeprefix(prefix + "/"): info["size"]
                                                 for path, info in found.items() if "broken" not in path})
    via_front = block_copy(image_location, endpoint_url=front.endpoint, max_attempts=1)
    front.stall_gets(f"{prefix}/*", seconds=0.15)
    jobs = {"local": job(DataLocation(url=str(tmp_path / "images")), local, tmp_path / "local", epochs=2),
            "slow": job(via_front, remote, tmp_path / "slow", epochs=1)}
    start_ranks(train_as_rank, (free_port(), jobs, tmp_path, ("history",)), 2)
    histories = [{name: r["history"] for name, r in json.loads((tmp_path / f"rank{rank}.json").read_text()).items()}
                 for rank in (0, 1)]

    for epoch in histories[0]["local"] + histories[0]["slow"]:
        for rank in epoch["time"]["per_rank"]:
            assert rank["step_s"] == pytest.approx(sum(rank[p] for p in PARTS), abs=0.004)  # each rounded to ms
            assert rank["step_s"] == pytest.approx(rank["train_wall_s"], rel=0.05), rank
            assert rank["sync"] > 0, "the gradient hooks saw no gradient"
    local_data = max(e["time"]["shares"]["data"] for e in histories[0]["local"])
    (slow,) = histories[0]["slow"]
    assert slow["time"]["verdict"].startswith("input-bound: "), slow["time"]["verdict"]
    assert "training.images_per_shard" in slow["time"]["verdict"]
    assert slow["time"]["shares"]["data"] > 2 * local_data, (slow["time"]["shares"], local_data)
    assert slow["data_wait_pct"] == round(100 * slow["time"]["shares"]["data"], 1)
    assert histories[1]["local"][-1]["time"]["per_rank"] == histories[0]["local"][-1]["time"]["per_rank"]


@pytest.mark.unit
def test_camera_originals_make_the_verdict_decode_bound_with_the_cores_each_way():
    from tests.test_photos import photo_jpeg

    transform = train_transform(64)
    originals = probe_decode([photo_jpeg(2400, 1800)] * 2, 64, transform)
    assert originals.megapixels == pytest.approx(4.32) and originals.side == 96
    assert originals.resized_s * 3 < originals.original_s
    fast_model = originals.original_s / 2 * 100  # seconds of compute per 100 images: half the decode's
    starved = [row(data=8.0, forward=fast_model, backward=0.0, optimizer=0.0, images=100.0)] * 2
    text = epoch_timing(starved, "more loader workers", lambda: originals).verdict
    assert text.startswith("decode-bound: ") and "the originals average 4.3 MP" in text
    assert "a rank needs about 2 cores decoding originals, 1 core reading" in text
    # The figures it gives are those the cores follow from: a model's 0.4 ms once read "0 ms".
    assert f"cost {originals.original_s * 1e3:.1f} ms per image per core" in text
    assert f"At this model's {originals.original_s / 2 * 1e3:.2f} ms of compute per image" in text
    assert "training.images_per_shard" in text
    slow_model = [row(data=8.0, forward=originals.original_s * 200, images=100.0)] * 2
    assert epoch_timing(slow_model, "more loader workers", lambda: originals).verdict.startswith("input-bound")
    small = probe_decode([photo_jpeg(120, 90)] * 2, 64, transform)  # nothing to gain from storing them resized
    assert epoch_timing(starved, "more loader workers", lambda: small).verdict.startswith("input-bound")
    asked = []
    fast = [row(data=0.1)] * 2  # compute-bound: the probe is never taken
    epoch_timing(fast, "", lambda: asked.append(1))
    assert asked == []
    fetched = []
    probe = DecodeProbe(lambda: fetched.append(1) or [photo_jpeg(120, 90)], 64, transform)
    assert probe() == probe() and fetched == [1]  # taken once, then kept
    assert probe_decode([b"not an image"], 64, transform) is None
