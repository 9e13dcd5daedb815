"""Rank 0's writes off the training path: the gang waits for a copy in memory, not for storage.

A checkpoint written in the training thread stalls every rank for its serialisation and
upload (δ in docs/scaling.md: about 2 s for ResNet-50 at 64 GPUs, 12 s for ViT-L). Here the
blocking part is `to_cpu`, a copy of the state into memory that the training cannot change
any more; `BackgroundWriter` serialises and writes it in a thread of its own while training
goes on. Writes run one at a time in the order they were given, so `model.pt` never lands
before the checkpoint whose history names its epoch (tasks/training/best_weights.py).
Each write is whole or absent (tasks/data/storage.py, `write_bytes`), so a write that fails
or is cut off leaves the checkpoint before it intact. Once one fails, the writes queued after
it are skipped, not run: a `model.pt` written after a failed checkpoint would name an epoch
that no checkpoint holds. The failure is raised at the next epoch boundary (`check`) or when
training ends, and the gang re-forms from the last checkpoint written.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import copy
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

import torch

from prefect_ddp.tasks.gang import GangError
from prefect_ddp.tasks.reporting import run_logger


class CheckpointWriteError(RuntimeError):
    """A background write of rank 0 failed; the checkpoint before it is intact."""


def to_cpu(state: Any) -> Any:
    """A copy of `state` (nested dicts, lists and tuples of tensors and plain values) that owns its
    memory on the CPU: training may change every tensor in place once this returns."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return with_versions_of(state, {key: to_cpu(value) for key, value in state.items()})
    if isinstance(state, (list, tuple)):
        return type(state)(to_cpu(value) for value in state)
    return copy.deepcopy(state)


def with_versions_of(source: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """`state` carrying `source`'s `_metadata`, where it has one: a state_dict's record of each
    module's state format, which `load_state_dict` hands the modules (MNASNet refuses to load
    without it), and which a plain dict of the same tensors loses."""
    metadata = getattr(source, "_metadata", None)
    if metadata is None:
        return state
    kept: OrderedDict[str, Any] = OrderedDict(state)
    kept._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
    return kept


class BackgroundWriter:
    """Writes in one thread, in order; `wait` for those given so far, raising the first failure.

    `before_write` runs in the writing thread right before each write: the rank's
    `check_lease`, so that a rank whose gang lost its worker writes nothing more, also what it
    queued before (tasks/gang/fencing.py). It raises GangStopped there (or a GangError where
    the scheduler could not be asked), which ends the writes as a failure does. Each write runs in the context (Dask worker, Prefect run) of the call that
    gave it.

    Use it as a context manager: leaving the block waits for every write, and raises a
    failure unless the block itself is raising (then the failure is logged: the block's own
    error is the one to see).
    """

    def __init__(self, before_write: Callable[[], None] = lambda: None) -> None:
        self._before_write = before_write
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefect-ddp-writer")
        self._pending: list[Future[float]] = []
        self._failed = threading.Event()  # set by the writing thread once a write failed
        self.write_s: list[float] = []  # each finished write's seconds in the background

    def submit(self, what: str, write: Callable[[], None]) -> None:
        """Run `write` after the writes given before it, unless one of those failed; `what` names it
        in an error."""
        context = contextvars.copy_context()  # get_worker() and the run logger, in the writing thread
        self._pending.append(self._pool.submit(context.run, self._run, what, write))

    def check(self) -> None:
        """Raise CheckpointWriteError now if a write has failed; returns at once otherwise.

        Called at every epoch boundary, so a failed write ends the attempt within an epoch,
        not at the next checkpoint (which may be `max_lost_min` away).
        """
        if self._failed.is_set():
            self.wait()  # the writes after the failed one are skipped: this returns at once

    def finished(self, timeout_s: float) -> bool:
        """Whether every write given so far is done (failed or not), waiting up to `timeout_s`
        for them; `wait` then raises a failure."""
        _, pending = concurrent.futures.wait(self._pending, timeout=timeout_s)
        return not pending

    def wait(self) -> None:
        """Until every write given so far is done; raises the first failure: CheckpointWriteError,
        or a GangError from `before_write` (GangStopped where the gang lost the worker, a plain
        GangError where the scheduler could not be asked: tasks/gang/fencing.py)."""
        pending, self._pending = self._pending, []
        failures: list[Exception] = []
        for future in pending:
            try:
                self.write_s.append(future.result())
            except (CheckpointWriteError, GangError) as failure:
                failures.append(failure)
        if failures:
            raise failures[0]

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        try:
            self.wait()
        except (CheckpointWriteError, GangError):
            if kind is None:
                raise
            run_logger().exception("A background write failed while the rank was already failing")
        finally:
            self._pool.shutdown(wait=True)


    def _run(self, what: str, write: Callable[[], None]) -> float:
        """In the writing thread: `write`, timed; skipped once an earlier write failed."""
        if self._failed.is_set():
            raise CheckpointWriteError(f"Rank 0 did not write {what}: a write before it failed.")
        try:
            self._before_write()
        except BaseException:
            self._failed.set()
            raise
        started = time.monotonic()
        try:
            write()
        except BaseException as exc:  # a cancelled upload too: nothing may be written after it
            self._failed.set()
            raise CheckpointWriteError(
                f"Rank 0 could not write {what}: {exc!r}. What was written before it is intact (each write "
                "is whole or absent); the gang re-forms from the last checkpoint written. Free space on the "
                "output, or fix its access, and the run's retry goes on from there."
            ) from exc
        return time.monotonic() - started
