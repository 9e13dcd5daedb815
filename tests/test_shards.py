"""Tar shards: written once and reused, read with equal steps on every rank, each image once.

Real moto S3 (through the counting front where requests are counted), real DataLoaders with
0 and 2 forked workers, two real gloo processes, and one flow run on the session's cluster.
Images are PNGs whose first pixel's red value is the image's number, so a batch tells which
images it holds.
"""

from __future__ import annotations

import io
import json
import math
import tarfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
)

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.data.dataset import (
    FetchTimeout,
    forget_parent_exit_hooks,
    forked_workers,
)
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.shard_reader import ShardDataset, ShardLoader, open_shards, read_samples
from prefect_ddp.tasks.data.shard_writer import INDEX, ShardFormat, ShardIndex, shard_folder, write_shards
from prefect_ddp.tasks.data.storage import read_json
from prefect_ddp.tasks.gang import free_port, process_group
from prefect_ddp.tasks.urls import child_url
from tests.conftest import BUCKET
from tests.support.faulty_s3 import S3_READERS, FaultyS3
from tests.support.flow_runs import block_copy, run_tiny_flow
from tests.support.fresh_process import in_child

CLASSES = ["a", "b", "c"]


def numbered_png(number: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (number, 7, 7)).save(buffer, format="PNG")
    return buffer.getvalue()


def image_number(image: Image.Image) -> torch.Tensor:
    """The test's transform: the image's number, read back from its first pixel."""
    return torch.tensor(image.getpixel((0, 0))[0])


@pytest.fixture(scope="module")
def numbered(image_location: DataLocation, s3_fs) -> tuple[DataLocation, Manifest]:
    """24 numbered images in 3 classes on moto, and their manifest (label = number % 3)."""
    files = {f"{CLASSES[n % 3]}/{n:03d}.png": numbered_png(n) for n in range(24)}
    s3_fs.pipe({f"{BUCKET}/numbered/{key}": data for key, data in files.items()})
    paths = sorted(files)
    manifest = Manifest(root=f"s3://{BUCKET}/numbered", classes=CLASSES, paths=paths,
                        sizes=[len(files[p]) for p in paths], labels=[CLASSES.index(p[0]) for p in paths])
    return image_location.with_url(manifest.root), manifest


def write(location: DataLocation, manifest: Manifest, output: str, per_shard: int, positions=None):
    positions = list(range(len(manifest))) if positions is None else positions
    options = location.storage_options()
    return write_shards(manifest, positions, options, output, options, ShardFormat(images_per_shard=per_shard),
                        "split-digest", fetch_threads=8)


def output_url(request) -> str:
    return f"s3://{BUCKET}/shard-out/{request.node.name.replace('[', '-').rstrip(']')}"


def source_gets(front: FaultyS3) -> int:
    return sum(count for key, count in front.gets.items() if key.startswith(f"{BUCKET}/numbered/"))


def read_epoch(dataset: ShardDataset, epoch: int, num_workers: int) -> tuple[list[int], list[int], int]:
    """(image numbers in order, labels, batches) of one epoch through a real DataLoader."""
    options = forked_workers() if num_workers else {}
    loader = ShardLoader(dataset, num_workers=num_workers, **options)
    loader.sampler.set_epoch(epoch)
    numbers, labels, batches = [], [], 0
    for images, batch_labels in loader:
        numbers += images.tolist()
        labels += batch_labels.tolist()
        batches += 1
    assert batches == len(loader)
    return numbers, labels, batches


def dataset(location: DataLocation, output: str, manifest: Manifest, index, rank: int, world: int,
            workers: int, batch: int = 3) -> ShardDataset:
    folder = shard_folder(output, manifest, range(len(manifest)), ShardFormat(images_per_shard=index.images_per_shard), 0)
    return ShardDataset(folder, index, location.storage_options(), image_number, batch, rank, world, workers)


def index_of(images: list[int]) -> ShardIndex:
    """The index of a shard set with these images per shard; its shards are never read."""
    return ShardIndex(key="k", split_digest="d", classes=CLASSES, images_per_shard=max(images), images=images,
                      shards=[f"shard-{n:06d}.tar" for n in range(len(images))], bytes=[1] * len(images),
                      paths=[f"a/{n}.png" for n in range(sum(images))])


def planned(dataset: ShardDataset, epoch: int) -> list[list[tuple[int, int]]]:
    """(shard, member) of every image each of the rank's loader workers reads in `epoch`, from its plan."""
    return [[(shard, member) for shard, first, end in pieces for member in range(first, end)]
            for pieces in dataset.plan(epoch)]


MIXES = [  # shard sizes, world size, each rank's loader workers, batch size
    ([500, 500, 10], 2, [2, 2], 32),  # issue 18's case
    ([500, 500, 10], 2, [2, 2], 2),
    ([3, 2, 3, 1, 3], 2, [1, 3], 4),  # every shard smaller than a batch
    ([7, 40], 3, [2, 2, 2], 8),  # more ranks than shards
    ([1, 60, 2, 33, 5, 17], 4, [4, 1, 2, 3], 3),
    ([100], 2, [8, 8], 2),  # one shard, more loader workers than batches
    ([9, 9, 5], 2, [2, 2], 2),  # 11 images a rank would end in a batch of one
    ([4, 4, 4, 4, 4, 1], 5, [2, 2, 2, 2, 2], 1),  # batch size 1: every batch is one image
]


@pytest.mark.unit
@pytest.mark.parametrize(("images", "world", "workers", "batch"), MIXES)
def test_the_plan_trains_every_image_but_fewer_than_world_times_batch(images, world, workers, batch):
    total = sum(images)
    ranks = [ShardDataset("s3://never-read/shards", index_of(images), {}, None, batch, rank, world, workers[rank])
             for rank in range(world)]
    for epoch in range(3):
        for rank in ranks:
            rank.set_epoch(epoch)
        steps = [len(rank) for rank in ranks]
        assert len(set(steps)) == 1, f"ranks take {steps} steps"
        assert world * steps[0] * batch > total - world * batch, f"{steps[0]} steps of {batch} for {total} images"
        trained = []
        for rank in ranks:
            workers_images = planned(rank, epoch)
            assert sum(math.ceil(len(held) / batch) for held in workers_images) == len(rank)
            assert batch == 1 or all(len(held) % batch != 1 for held in workers_images)  # no batch of one
            trained += [image for held in workers_images for image in held]
        assert len(set(trained)) == len(trained) and all(member < images[shard] for shard, member in trained)
        # Left out: total mod world, plus world where a rank's share would end in a batch of one.
        assert total - world * min(batch, 2) < len(trained) <= total, f"trained {len(trained)} of {total} images"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_image_once_per_epoch_across_ranks_and_workers(numbered, request, num_workers):
    location, manifest = numbered
    output = output_url(request)
    index, reused = write(location, manifest, output, per_shard=6)
    assert (reused, index.images) == (False, [6, 6, 6, 6])
    seen, steps = [], []
    for rank in (0, 1):
        numbers, labels, batches = read_epoch(dataset(location, output, manifest, index, rank, 2, num_workers), 0,
                                              num_workers)
        assert labels == [n % 3 for n in numbers]
        seen += numbers
        steps.append(batches)
    assert sorted(seen) == list(range(24))
    assert steps == [4, 4]


def test_the_shuffle_differs_by_epoch_and_repeats_for_the_same_epoch(numbered, request):
    location, manifest = numbered
    output = output_url(request)
    index, _ = write(location, manifest, output, per_shard=4)
    orders = [read_epoch(dataset(location, output, manifest, index, 0, 1, 0), epoch, 0)[0] for epoch in (0, 1, 1)]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(24))
    assert orders[0] != orders[1]
    assert orders[1] == orders[2]


EPOCHS = 3


def rank_of_two(rank: int, port: int, folder: str, index: dict, storage_options: dict, results: Path) -> None:
    """One gloo rank, EPOCHS epochs: a collective after every batch, as DDP's backward.

    Rank 0 has 2 persistent loader workers and rank 1 has 3, as hosts with other core counts
    would (training.num_workers empty): the ranks' batches must not depend on them. Forked
    from this test process, it drops the Prefect exit hooks it inherited, as a loader worker
    does (else it ends with code 1 when the session has run a flow before).
    """
    forget_parent_exit_hooks(rank)
    with process_group(backend="gloo", rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                       timeout=timedelta(seconds=30)):
        workers = 2 + rank
        shards = ShardDataset(folder, ShardIndex.model_validate(index), storage_options, image_number, 2, rank, 2,
                              workers)
        loader = ShardLoader(shards, num_workers=workers, persistent_workers=True, **forked_workers())
        epochs = []
        for epoch in range(EPOCHS):
            loader.sampler.set_epoch(epoch)
            steps, numbers = 0, []
            for images, _ in loader:
                dist.all_reduce(torch.ones(1))  # a rank with fewer batches would leave the other waiting here
                steps += 1
                numbers += images.tolist()
            epochs.append({"steps": steps, "len": len(loader), "numbers": numbers})
    (results / f"rank{rank}.json").write_text(json.dumps(epochs))


def test_uneven_shards_train_every_image_but_fewer_than_world_times_batch_each_epoch(numbered, request, tmp_path):
    location, manifest = numbered
    output = output_url(request)
    train = list(range(23))  # shards of 9, 9 and 5 images: no split of whole shards evens out 2 ranks
    index, _ = write(location, manifest, output, per_shard=9, positions=train)
    assert index.images == [9, 9, 5]
    folder = shard_folder(output, manifest, train, ShardFormat(images_per_shard=9), 0)
    # fork, not spawn: a spawned child imports torch and this module again (50 s here, 4 s forked).
    mp.start_processes(rank_of_two, args=(free_port(), folder, index.model_dump(), location.storage_options(), tmp_path),
                       nprocs=2, start_method="fork")
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    for epoch0, epoch1 in zip(rank0, rank1, strict=True):
        assert epoch0["steps"] == epoch1["steps"] == epoch0["len"] == epoch1["len"]
        trained = epoch0["numbers"] + epoch1["numbers"]
        assert len(set(trained)) == len(trained) and set(trained) <= set(train)
        # 11 images a rank would end in a batch of one: each rank trains 10, and 3 of 23 sit out (< 2 x 2).
        assert len(trained) == 20, f"trained {len(trained)} of {len(train)} images"
    assert len({tuple(sorted(epoch["numbers"])) for epoch in rank0}) > 1  # a different part each epoch


def test_a_complete_set_is_reused_and_a_half_written_one_finished_from_its_first_missing_shard(
        numbered, request, s3_fs, front):
    location, manifest = numbered
    through_front = block_copy(location, endpoint_url=front.endpoint)
    output = output_url(request)
    index, reused = write(through_front, manifest, output, per_shard=8)
    assert not reused and source_gets(front) >= 24  # one GET per image (a retry on a loaded machine adds one)
    before = source_gets(front)
    again, reused = write(through_front, manifest, output, per_shard=8)
    assert reused and again == index and source_gets(front) == before
    folder = shard_folder(output, manifest, range(24), ShardFormat(images_per_shard=8), 0)
    s3_fs.rm(f"{folder[5:]}/{INDEX}")  # as if the writer had died before its last step
    finished, reused = write(through_front, manifest, output, per_shard=8)
    assert not reused and source_gets(front) == before  # every shard was there: no image read again
    assert finished.shards == index.shards and finished.bytes == index.bytes and finished.paths == index.paths
    s3_fs.rm(f"{folder[5:]}/{INDEX}")
    s3_fs.rm(f"{folder[5:]}/{index.shards[1]}")  # died after the first shard
    finished, reused = write(through_front, manifest, output, per_shard=8)
    assert not reused and before + 8 <= source_gets(front) < before + 16  # the missing shard's 8 images only
    assert finished.bytes == index.bytes and finished.paths == index.paths  # the same shard, byte for byte
    s3_fs.rm(f"{folder[5:]}/{index.shards[1]}")  # an index whose shard is gone is not trusted either
    assert not write(through_front, manifest, output, per_shard=8)[1]


def test_reading_a_set_that_was_never_written_names_the_folder_and_the_fix(numbered):
    location, manifest = numbered
    from prefect_ddp.tasks.data.splitting import stratified_split

    split = stratified_split(manifest, 0.25, 0)
    with pytest.raises(FileNotFoundError, match=r"No complete shard set for this split and format at s3://.*/shards/"
                                                r"\w+ \(training.images_per_shard=6, shard_side=None\).*write-shards"):
        open_shards(f"s3://{BUCKET}/never-written/run-1", location.storage_options(), manifest, split,
                    ShardFormat(images_per_shard=6))


@pytest.mark.unit
def test_too_few_images_for_the_ranks_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"3 training images in 1 shard\(s\) for 2 ranks at batch size 4: a rank "
                                         r"would have none to train on. Every rank needs at least 2 images \(1 at "
                                         r"batch size 1\): add images or use fewer ranks."):
        ShardDataset("s3://never-read/shards", index_of([3]), {}, None, 4, 0, 2, 1)


def test_a_stalled_shard_fetch_fails_with_fetch_timeout(numbered, request, front):
    location, manifest = numbered
    output = output_url(request)
    index, _ = write(location, manifest, output, per_shard=12)
    folder = shard_folder(output, manifest, range(24), ShardFormat(images_per_shard=12), 0)
    through_front = block_copy(location, endpoint_url=front.endpoint)
    shards = ShardDataset(folder, index, through_front.storage_options(), image_number, 3, 0, 1, 0,
                          fetch_timeout_s=1)
    front.stall_gets(f"{BUCKET}/shard-out/*", seconds=10)
    with pytest.raises(FetchTimeout, match=r"Could not fetch shard .*shard-00000\d.tar .* within "
                                           r"fetch_timeout_s=1 s.*images_per_shard"):
        read_epoch(shards, 0, 0)
    front.clear()


@pytest.mark.parametrize("reader", S3_READERS)
def test_shards_are_fetched_ahead_several_at_once(numbered, request, front, reader):
    location, manifest = numbered
    output = output_url(request)
    index, _ = write(location, manifest, output, per_shard=4)
    folder = shard_folder(output, manifest, range(24), ShardFormat(images_per_shard=4), 0)
    through_front = block_copy(location, endpoint_url=front.endpoint)
    shards = ShardDataset(folder, index, through_front.storage_options() | S3_READERS[reader], image_number, 3,
                          0, 1, 1)
    front.stall_gets(f"{BUCKET}/shard-out/*", seconds=0.3)
    # Read in a loader process, as training reads shards; obstore's forked from a process of its own:
    # this one may have started obstore, and a loader forked after that reads with s3fs.
    numbers = in_child("spawn", epoch_numbers, shards) if reader == "obstore" else epoch_numbers(shards)
    front.clear()
    assert sorted(numbers) == list(range(24))
    assert set(front.readers) == {reader}, front.readers
    assert front.most_stalled == min(shards.ahead, len(index.shards)) > 1, (front.most_stalled, shards.ahead)


def epoch_numbers(shards: ShardDataset) -> list[int]:
    """The image numbers of `shards`' first epoch, read by one loader process."""
    return read_epoch(shards, 0, 1)[0]


@pytest.mark.slow  # about 60 s on 2 loaded cores: a whole flow run on the session cluster
def test_the_flow_trains_from_the_shards_it_wrote(image_location, dask_cluster, tmp_path):
    image_location.save("test-images", overwrite=True)
    state = run_tiny_flow(tmp_path, {"address": dask_cluster.scheduler_address},
                          training={"images_per_shard": 4, "num_workers": 2})
    summary = state.result()
    index = json.loads(next((tmp_path / "shards").rglob(INDEX)).read_text())
    assert sum(index["images"]) == summary["train_size"] and len(index["shards"]) == len(index["images"]) > 1
    # World size 1, 2 loader workers each holding whole batches: every training image, once.
    assert summary["history"][0]["train_samples"] == summary["train_size"]
    with get_client(sync_client=True) as api:
        artifacts = api.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]), key=ArtifactFilterKey(any_=["train-shards"])))
        task_runs = api.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    assert "Wrote 6 shards" in artifacts[0].data
    assert len([t for t in task_runs if t.name.startswith("write-shard-")]) == 6  # one task per shard, on the cluster


@pytest.mark.unit
def test_a_shard_not_written_by_pack_is_refused_with_the_fix():
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("é.jpg")  # a non-ASCII name takes a pax header, which pack never writes
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(ValueError, match="not a plain USTAR file: this shard was not written by prefect_ddp.tasks.data.shard_writer.pack. "
                                         "Delete the shard set"):
        list(read_samples(buffer.getvalue()))
