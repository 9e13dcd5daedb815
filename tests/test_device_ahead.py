"""The next encoded batch decoded on a thread of its own while the rank trains on this one
(prefect_ddp.tasks.data.device_ahead): the same batches in the same order, errors raised where
the pass meets them, and a thread that ends with the pass however it ends."""

from __future__ import annotations

import threading
import time
from contextlib import closing

import pytest
import torch

from prefect_ddp.tasks.data.dataset import train_transform
from prefect_ddp.tasks.data.device_ahead import batches_ahead
from prefect_ddp.tasks.data.device_batches import ToDevice
from tests.test_device_batches import PHOTO_SIZES, encoded, photo_bytes

DEADLINE_S = 60
THREAD = "prefect-ddp-device-ahead"


def ahead_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == THREAD]


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class CountedBatches:
    """Batches (i, i) that count how many were taken, and fail at `fail_at` if given."""

    def __init__(self, count: int, fail_at: int | None = None) -> None:
        self.count, self.fail_at, self.taken = count, fail_at, 0

    def __iter__(self):
        for number in range(self.count):
            if number == self.fail_at:
                raise RuntimeError("DataLoader worker (pid 123) exited unexpectedly")
            self.taken += 1
            yield torch.tensor([number]), torch.tensor([number])


def finish_on_thread(seen: list[str]):
    def finish(images, labels):
        seen.append(threading.current_thread().name)
        return images * 10, labels
    return finish


@pytest.mark.unit
def test_encoded_batches_come_finished_in_order_the_same_as_between_steps():
    transform = train_transform(24)
    batches = [encoded([photo_bytes(w, h, seed + 10 * number) for seed, (w, h) in enumerate(PHOTO_SIZES)])
               for number in range(3)]
    to_device = ToDevice(torch.device("cpu"), transform=transform)
    torch.manual_seed(3)
    between_steps = [to_device(images, labels) for images, labels in batches]
    torch.manual_seed(3)  # one thread draws every crop and flip, batch after batch: the same draws
    ahead = list(to_device.batches(batches))
    assert len(ahead) == 3
    for (images, labels), (expected_images, expected_labels) in zip(ahead, between_steps):
        assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)
    assert not ahead_threads()


@pytest.mark.unit
def test_the_work_runs_on_the_thread_and_finished_batches_only_skip_it():
    seen: list[str] = []
    assert [labels.item() for _, labels in batches_ahead(CountedBatches(4), finish_on_thread(seen),
                                                        torch.device("cpu"))] == [0, 1, 2, 3]
    assert seen == [THREAD] * 4
    uint8 = [(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([0, 1]))]
    to_device = ToDevice(torch.device("cpu"), transform=train_transform(4))
    for _ in to_device.batches(uint8):  # finished on the rank's thread: no thread runs for it
        assert not ahead_threads()


@pytest.mark.unit
def test_a_loader_error_on_the_thread_is_raised_in_the_pass_after_the_batches_before_it():
    batches = CountedBatches(5, fail_at=2)
    got = []
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        for _, labels in batches_ahead(batches, finish_on_thread([]), torch.device("cpu")):
            got.append(labels.item())
    assert got == [0, 1]
    wait_for(lambda: not ahead_threads(), "the thread to end")


@pytest.mark.unit
def test_a_pass_that_ends_early_ends_the_thread_before_it_reads_on():
    batches = CountedBatches(100)
    with closing(batches_ahead(batches, finish_on_thread([]), torch.device("cpu"))) as on_device:
        next(on_device)
        # One batch waits in the queue and the thread holds the next: it reads no further ahead.
        wait_for(lambda: batches.taken == 3, "the thread to fill the queue")
        time.sleep(0.3)
        assert batches.taken == 3
    assert not ahead_threads()  # joined as the pass closed it, not whenever the generator is collected
    assert batches.taken == 3


@pytest.mark.unit
def test_a_pass_that_fails_ends_the_thread_even_while_its_traceback_is_kept():
    batches = CountedBatches(100)
    kept: list[BaseException] = []
    try:
        with closing(batches_ahead(batches, finish_on_thread([]), torch.device("cpu"))) as on_device:
            for _ in on_device:
                raise ConnectionError("a peer left the gang")  # DDP's all-reduce failing mid-pass
    except ConnectionError as error:
        kept.append(error)  # the traceback holds the pass's frame, and the generator with it
    assert kept and not ahead_threads()
    taken = batches.taken
    time.sleep(0.3)
    assert batches.taken == taken <= 3


@pytest.mark.unit
def test_a_failed_pass_leaves_without_waiting_for_the_batch_the_loader_is_still_fetching():
    fetched = threading.Event()  # the storage's answer for the second batch, given only at the end

    def slow_after_the_first():
        yield torch.tensor([0]), torch.tensor([0])
        fetched.wait(DEADLINE_S)
        yield torch.tensor([1]), torch.tensor([1])

    try:
        with pytest.raises(ConnectionError):
            with closing(batches_ahead(slow_after_the_first(), finish_on_thread([]), torch.device("cpu"))) as on_device:
                for _ in on_device:
                    raise ConnectionError("a peer left the gang")
        assert not fetched.is_set()  # the pass left while the thread still waited on the loader
    finally:
        fetched.set()  # as EpochAhead.close ends the wait, terminating the loader's processes
    wait_for(lambda: not ahead_threads(), "the thread to end once the loader answers")


@pytest.mark.unit
def test_a_pass_that_ran_to_its_end_leaves_no_thread_reading_the_loader():
    for _ in batches_ahead(CountedBatches(3), finish_on_thread([]), torch.device("cpu")):
        pass
    assert not ahead_threads()  # joined before the next epoch's iter() may reset the loader


@pytest.mark.gpu
def test_a_batch_finished_on_the_side_stream_is_whole_on_the_current_stream():
    device = torch.device("cuda")

    def finish(images, labels):  # long enough on the side stream that reading early would see zeros
        big = torch.zeros(4096, 4096, device=device)
        for _ in range(20):
            big = big + 1
        return big[:1, :1] * images.to(device), labels.to(device)

    batches = [(torch.tensor([[float(number)]]), torch.tensor([number])) for number in range(1, 5)]
    sums = [(images.item(), labels.item()) for images, labels in batches_ahead(batches, finish, device)]
    assert sums == [(20.0 * number, number) for number in range(1, 5)]
