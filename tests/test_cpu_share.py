"""The CPU-bound steps outside training decode on every CPU their worker may use (tasks/data/cpu_share.py).

A GPU cluster's worker has one thread (dask-cuda's LocalCUDACluster): decode-check, shard
writing and batch-predict's decoding must not run on that thread alone. Nothing here is
faked: the CPUs are the calling thread's real affinity (on Linux `sched_setaffinity(0)` sets
the calling thread's, which the threads it starts inherit), the worker threads those of a
real in-process Dask worker.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import distributed
import pytest
import torch

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.data import shard_writer, validation
from prefect_ddp.tasks.data.check_memory import DecodeResult
from prefect_ddp.tasks.data.cpu_share import cpu_threads
from prefect_ddp.tasks.data.dataset import S3ImageFolder, eval_transform
from prefect_ddp.tasks.data.shard_writer import ShardChunk, ShardFormat, pack
from prefect_ddp.tasks.gang.plan import cpu_set
from prefect_ddp.tasks.prediction import scoring
from tests.conftest import truncated_jpeg
from tests.test_photos import photo_jpeg

CPUS = cpu_set()
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2 or not hasattr(os, "sched_setaffinity"),
                                    reason="needs 2 CPUs and Linux's sched_setaffinity")
GOOD = {"a/0.jpg": (48, 40), "a/1.jpg": (40, 48), "b/0.jpg": (36, 30), "b/1.jpg": (64, 48), "b/2.jpg": (50, 50),
        "b/3.jpg": (30, 36)}
UNREADABLE = {"a/broken.jpg": truncated_jpeg(), "a/README.jpg": b"not an image"}
MISSING = "b/gone.jpg"
KEYS = [*GOOD, *UNREADABLE, MISSING]
# Each recorded decode waits this long (the GIL released): a step on one thread takes all of
# them in turn, a step on two overlaps them, so both threads take part.
DECODE_PAUSE_S = 0.05


@pytest.fixture
def image_folder(tmp_path: Path) -> DataLocation:
    """Six good JPEGs, a truncated one, one that is no image; MISSING is not there."""
    files = {key: photo_jpeg(*size) for key, size in GOOD.items()} | UNREADABLE
    for key, data in files.items():
        (tmp_path / key).parent.mkdir(exist_ok=True)
        (tmp_path / key).write_bytes(data)
    return DataLocation(url=str(tmp_path))


@pytest.fixture
def decoding_threads(monkeypatch: pytest.MonkeyPatch) -> Callable[[ModuleType, str], set[int]]:
    """`record(module, name)`: from then on `module.name` (a decoder a step calls) notes the thread
    of each call in the set it returns, and pauses DECODE_PAUSE_S."""
    def record(module: ModuleType, name: str) -> set[int]:
        threads: set[int] = set()
        decode = getattr(module, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            threads.add(threading.get_ident())
            time.sleep(DECODE_PAUSE_S)
            return decode(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)
        return threads
    return record


def in_thread_on(cpus: set[int], step: Callable[[], Any]) -> Any:
    """`step()` in a thread of its own that may run on `cpus` only (the threads it starts inherit them)."""
    outcome: list[Any] = []

    def run() -> None:
        os.sched_setaffinity(0, cpus)
        outcome.append(step())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert outcome, "the step raised in its thread (see the warning above)"
    return outcome[0]


def without_addresses(results: list[DecodeResult]) -> list[DecodeResult]:
    """`results` with the object addresses PIL's errors name ("<_io.BytesIO object at 0x7f...>") left out."""
    return [r.model_copy(update={"error": r.error and re.sub(r" at 0x[0-9a-f]+", "", r.error)}) for r in results]


@pytest.fixture
def one_thread_worker() -> Iterator[distributed.Client]:
    """A real Dask worker of one thread, as dask-cuda makes one per GPU, in this process."""
    with (distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None)
          as cluster, distributed.Client(cluster) as client):
        yield client


@pytest.mark.unit
@needs_two_cpus
def test_a_step_outside_a_worker_takes_every_cpu_its_thread_may_run_on():
    assert in_thread_on(set(CPUS[:1]), cpu_threads) == 1
    assert in_thread_on(set(CPUS[:2]), cpu_threads) == 2
    assert cpu_threads() == len(CPUS)


@pytest.mark.parametrize("worker_threads", [1, 2])
def test_a_step_on_a_dask_worker_shares_its_cpus_with_the_worker_s_threads(worker_threads):
    with (distributed.LocalCluster(n_workers=1, threads_per_worker=worker_threads, processes=False,
                                   dashboard_address=None) as cluster, distributed.Client(cluster) as client):
        assert client.submit(cpu_threads, pure=False).result() == max(1, len(CPUS) // worker_threads)


@needs_two_cpus
def test_decode_check_on_a_one_thread_worker_decodes_on_every_cpu_with_the_same_results(
        image_folder, one_thread_worker, decoding_threads):
    one_by_one = [validation.decode_result(i, (Path(image_folder.url) / key).read_bytes())
                  for i, key in enumerate(KEYS[:-1])]
    threads = decoding_threads(validation, "decode_check")
    results = one_thread_worker.submit(validation.decode_chunk.fn, image_folder, KEYS, list(range(len(KEYS)))).result()
    assert without_addresses(results[:-1]) == without_addresses(one_by_one)
    assert [r.error is None for r in one_by_one] == [True] * len(GOOD) + [False] * len(UNREADABLE)
    assert results[-1].position == len(KEYS) - 1 and results[-1].error.startswith("FileNotFoundError")
    assert 1 < len(threads) <= len(CPUS)


@pytest.mark.unit
@needs_two_cpus
def test_shard_writing_resizes_on_the_cpus_its_process_may_use_and_no_more(image_folder, decoding_threads):
    source = S3ImageFolder(image_folder.url, list(GOOD), [0] * len(GOOD), {}, transform=None)
    chunk = ShardChunk(number=0, first=0, paths=list(GOOD), labels=[0] * len(GOOD))
    fmt = ShardFormat(images_per_shard=len(GOOD), side=32)
    packed, _ = pack(source, chunk, fmt)
    larger = sum(min(size) > fmt.side for size in GOOD.values())
    threads = decoding_threads(shard_writer, "stored_resized")
    for cpus in (CPUS[:1], CPUS[:2]):
        threads.clear()
        data, written = in_thread_on(set(cpus), lambda: pack(source, chunk, fmt))
        assert len(threads) == len(cpus)
        assert (data, written.images, written.resized) == (packed, len(GOOD), larger)


@pytest.mark.unit
@needs_two_cpus
def test_batch_predict_decodes_on_every_cpu_and_names_what_it_cannot_read(image_folder, decoding_threads):
    threads = decoding_threads(scoring, "open_rgb")
    images, unreadable = scoring.fetch_images(image_folder, KEYS, eval_transform(32), 30)
    assert list(images) == list(GOOD) and all(image.shape == (3, 32, 32) for image in images.values())
    assert list(unreadable) == [*UNREADABLE, MISSING]
    assert unreadable[MISSING].startswith("FileNotFoundError") and unreadable["a/README.jpg"].startswith(
        "UnidentifiedImageError")
    assert len(threads) > 1


@pytest.mark.unit
@needs_two_cpus
def test_batch_predict_s_threads_times_their_torch_threads_stay_within_the_cpus(image_folder):
    """On a worker whose torch threads are its CPUs (a rank trained there: rank.limit_threads), each of
    batch-predict's decoding threads ran its transform's operators on a team of that many: CPUs x CPUs
    threads (96 x 96 on a 96-CPU worker). One torch thread each; the worker's own number comes back after."""
    seen: dict[int, int] = {}  # decoding thread -> its torch threads
    transform = eval_transform(32)
    # The first two threads wait for each other: on a busy machine one thread could otherwise take every image.
    two_met = threading.Barrier(2, timeout=60)

    def recorded(image: Any) -> Any:
        first_call = threading.get_ident() not in seen
        seen[threading.get_ident()] = torch.get_num_threads()
        if first_call and len(seen) <= 2:
            two_met.wait()
        return transform(image)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(len(CPUS))
        images, _ = scoring.fetch_images(image_folder, KEYS, recorded, 30)
        assert len(images) == len(GOOD) and len(seen) > 1
        assert len(seen) * max(seen.values()) <= len(CPUS)
        assert torch.get_num_threads() == len(CPUS)  # this thread's, and a new one's
        new_thread: list[int] = []
        thread = threading.Thread(target=lambda: new_thread.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert new_thread == [len(CPUS)]
    finally:
        torch.set_num_threads(threads)
