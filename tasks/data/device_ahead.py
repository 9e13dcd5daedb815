"""The next encoded batch decoded on the device while the rank trains on this one
(docs/architecture.md, "Data: decode on device").

Decoding on the device (training.decode_on="device", or "auto" where it chose so) leaves the
rank's own thread work per batch: reading each JPEG's header for its orientation, drawing
each image's crop and flip, and queueing a few small kernels per image. Done between steps,
the GPU waits for all of it; on an H200 that held the device feed to 0.27x of its ceiling
(bench/RESULTS.md, "GPU"). So `batches_ahead` does it one batch ahead on a thread of its own,
on a CUDA stream of its own: the rank's thread takes each batch finished, and its stream
waits for that batch's work on the side stream (an event), never the host.

Order is kept (one thread, a queue of one), so every rank trains its batches in the sampler's
order. The thread ends with the pass. A pass that ran to the end joins it after its last batch,
so the next epoch's `iter()` never resets a loader a thread still reads. One that breaks off or
fails (the run stops, the gang regroups; the pass closes the iterator, `contextlib.closing`)
tells it to stop and waits for it at most `_LEAVE_S`, not for the batch the loader may still
be fetching: the rank then closes its train loader (EpochAhead.close terminates its processes),
which ends that wait, and the next formation reads through loaders of its own. (A validation pass
broken off leaves its thread to the val loader's next batch, at most training.fetch_timeout_s.) An error in the
thread (a loader process that died, a batch that does not decode) is raised in the rank's
thread, where the pass would have met it.

One thing differs from decoding between steps: the crops' and flips' draws come from torch's
CPU generator on that thread while the rank's thread draws from it too (MixUp, CutMix; dropout
on a CPU device), so with those on, a seed does not repeat a run on the device feed exactly:
the draws interleave in another order each time.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

Batch = tuple[torch.Tensor, torch.Tensor]
_DONE: Any = object()  # what the thread puts after the last batch
_POLL_S = 0.1  # how often a thread waiting to hand over a batch checks whether it should stop
_LEAVE_S = 1.0  # how long a pass that ends early waits for the thread (module docstring)


class _Failed:
    """An error raised on the thread, handed over to be raised on the rank's."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def batches_ahead(batches: Iterable[Any], finish: Callable[[Any, Any], Batch],
                  device: torch.device) -> Generator[Batch, None, None]:
    """`finish(images, labels)` of each of `batches`, run one batch ahead on a thread (module docstring).

    >>> list(batches_ahead([(1, 2), (3, 4)], lambda x, y: (x * 10, y), torch.device("cpu")))
    [(10, 2), (30, 4)]
    """
    handed: queue.Queue[Any] = queue.Queue(maxsize=1)
    stop = threading.Event()
    side = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
    thread = threading.Thread(target=_finish_all, args=(iter(batches), finish, side, handed, stop),
                              name="prefect-ddp-device-ahead", daemon=True)
    thread.start()
    try:
        while (item := handed.get()) is not _DONE:
            if isinstance(item, _Failed):
                raise item.error
            yield _on_current_stream(item, side)
        thread.join()  # it handed over its last batch and ends: the loader's iterator is free
    finally:
        stop.set()
        _drain(handed)
        # A pass that ends early does not wait for a batch the loader has yet to deliver: the rank's
        # leaving (EpochAhead.close) terminates the loader's processes, which ends the thread's wait.
        thread.join(timeout=_LEAVE_S)


def _finish_all(batches: Iterator[Any], finish: Callable[[Any, Any], Batch], side: torch.cuda.Stream | None,
                handed: queue.Queue[Any], stop: threading.Event) -> None:
    """The thread: each batch finished on the side stream, handed over with the event that ends its work."""
    try:
        with _on_side(side):
            while not stop.is_set():
                batch = next(batches, _DONE)
                if batch is _DONE:
                    break
                finished = finish(*batch)
                event = None if side is None else side.record_event()  # the end of this batch's work
                if not _hand_over(handed, (finished, event), stop):
                    return
        _hand_over(handed, _DONE, stop)
    except BaseException as error:  # raised on the rank's thread, where the pass meets it
        _hand_over(handed, _Failed(error), stop)


@contextmanager
def _on_side(side: torch.cuda.Stream | None) -> Iterator[None]:
    """The thread's work queued on `side` and its device: a new thread's current CUDA device is the
    first, whatever the rank's, and torchvision's decoder makes the thread's current stream wait for
    its own (so the batch's event covers the decode too)."""
    if side is None:
        yield
        return
    with torch.cuda.device(side.device), torch.cuda.stream(side):
        yield


def _hand_over(handed: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put `item` once there is room; False if told to stop first."""
    while not stop.is_set():
        try:
            handed.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _on_current_stream(item: tuple[Batch, torch.cuda.Event | None], side: torch.cuda.Stream | None) -> Batch:
    """A batch finished on the side stream, made safe to use on the rank's current stream: that
    stream waits for the batch's work, and the allocator keeps its memory until that stream is done with it."""
    (images, labels), event = item
    if side is not None and event is not None:
        current = torch.cuda.current_stream(side.device)
        current.wait_event(event)
        images.record_stream(current)
        labels.record_stream(current)
    return images, labels


def _drain(handed: queue.Queue[Any]) -> None:
    """Empty the queue, so a thread waiting to put its batch sees there is room, then that it should stop."""
    while True:
        try:
            handed.get_nowait()
        except queue.Empty:
            return
