"""Fetching the next batches while this one decodes: still one GET per image, more in flight.

Units check which batches each loader process is told follow its own, and that a batch
fetched ahead is the one used (or, on a wrong guess, dropped and fetched again). The S3 test
reads every image through the front at 0 and 2 forked loader workers, with every GET held
a moment: each image is fetched exactly once per epoch, by the client asked for, and more than
one batch's GETs are held at once (one batch at a time before).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.data.dataset import S3ImageFolder, eval_transform, forked_workers
from prefect_ddp.tasks.data.fetch_ahead import AHEAD, AheadBatch, AheadBatches, FetchAheadLoader, FetchesAhead
from prefect_ddp.tasks.data.indexing import build_manifest, list_folder
from tests.support.faulty_s3 import S3_READERS, FaultyS3
from tests.support.flow_runs import block_copy
from tests.support.fresh_process import PausePoint, in_child


@pytest.mark.unit
@pytest.mark.parametrize("processes", [0, 1, 2, 3])
def test_each_batch_is_told_the_batches_its_loader_process_gets_next(processes):
    batches = list(AheadBatches(range(10), batch_size=2, drop_last=False, loader_processes=processes))
    assert [list(b) for b in batches] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    stride = max(1, processes)
    for number, batch in enumerate(batches):
        given_next = [tuple(b) for b in batches[number + stride::stride]][:AHEAD]
        assert list(batch.following) == given_next


@pytest.mark.unit
def test_a_batch_fetched_ahead_is_used_and_a_wrong_guess_is_dropped_and_said(caplog):
    fetched: list[tuple[int, ...]] = []
    lock = threading.Lock()

    def fetch(indices: list[int]) -> list[int]:
        with lock:
            fetched.append(tuple(indices))
        return [10 * i for i in indices]

    ahead = FetchesAhead()
    assert ahead.take([0, 1], fetch) == [0, 10]  # a plain batch: fetched where asked
    assert ahead.take(AheadBatch([0, 1], ((2, 3), (4, 5))), fetch) == [0, 10]
    assert ahead.take(AheadBatch([2, 3], ((4, 5),)), fetch) == [20, 30]
    assert sorted(fetched) == [(0, 1), (0, 1), (2, 3), (4, 5)]  # (2, 3) and (4, 5) once, ahead
    with caplog.at_level(logging.WARNING):
        assert ahead.take(AheadBatch([6, 7], ()), fetch) == [60, 70]  # not (4, 5), as it was told
    assert "fetched 1 batch(es) ahead that it was then not given" in caplog.text


@pytest.fixture(scope="module")
def manifest(image_location: DataLocation):
    return build_manifest(image_location.url, list_folder(image_location))


def epochs_read(root: str, keys: list[str], labels: list[int], options: dict, workers: int,
                at_epoch_end: Callable[[], None]) -> list[list[int]]:
    """Each of two epochs' labels, in order, read through a FetchAheadLoader with `workers` loader
    processes; `at_epoch_end` called after each epoch, before the next starts."""
    dataset = S3ImageFolder(root, keys, labels, options, eval_transform(32), fetch_threads=4)
    loader_options = {**forked_workers(), "persistent_workers": True} if workers else {}
    loader = FetchAheadLoader(dataset, list(range(len(dataset))), batch_size=4, num_workers=workers, **loader_options)
    epochs = []
    for _ in range(2):
        epochs.append(torch.cat([batch_labels for _, batch_labels in loader]).tolist())
        at_epoch_end()
    return epochs


@pytest.mark.parametrize("reader", S3_READERS)  # under s3fs, its connection pool bounds what is in flight
@pytest.mark.parametrize("workers", [0, 2])
def test_every_image_is_fetched_once_per_epoch_with_batches_in_flight_together(
        image_location, manifest, front: FaultyS3, workers, reader):
    good = [i for i, p in enumerate(manifest.paths) if "broken" not in p]
    location = block_copy(image_location, endpoint_url=front.endpoint)
    args = (manifest.root, [manifest.paths[i] for i in good], [manifest.labels[i] for i in good],
            location.storage_options() | S3_READERS[reader], workers)
    prefix = image_location.url.removeprefix("s3://")
    front.stall_gets(f"{prefix}/*", seconds=0.2)
    gets_by_epoch: list[Counter[str]] = []

    def count_gets() -> None:
        gets_by_epoch.append(Counter(front.gets))

    # obstore's loader processes forked from a process of their own: this one started obstore (its
    # listing), and a loader forked after that reads with s3fs. It pauses after each epoch for the count.
    if workers and reader == "obstore":
        pause = PausePoint("spawn")
        pause.looking(count_gets, pauses=2)
        epochs = in_child("spawn", epochs_read, *args, pause)
    else:
        epochs = epochs_read(*args, count_gets)
    assert epochs == [args[2], args[2]]  # every image, in order, once an epoch
    # Once each an epoch: none fetched twice, and none of the second epoch's fetched ahead in the first.
    assert [set(gets.values()) for gets in gets_by_epoch] == [{1}, {2}], gets_by_epoch
    assert len(front.gets) == len(good), front.gets
    # obstore only in loader processes: a rank with none fetches with s3fs (object_reads.fetch_objects).
    assert set(front.readers) == {reader if workers else "s3fs"}, front.readers
    # One loader process fetching a batch at a time would hold 4 GETs at once (8 with two).
    assert front.most_stalled > 4 * max(1, workers), front.most_stalled
