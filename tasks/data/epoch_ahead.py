"""A train loader's next epoch started while the rank validates this one (docs/architecture.md,
"Data: the next epoch ahead").

With persistent loader processes, a DataLoader hands its processes an epoch's first batches only
when `iter()` is called for that epoch; until then they sit idle, and so the first steps of every
epoch wait for fetches and decodes that could have run during validation. On the GPU that cost
epochs of 15 steps most of their time (bench/RESULTS.md, "GPU"). So the recipe starts the next
epoch's iterator as soon as a training pass ends (`start`), and the next pass takes it over
(`batches`). An iterator started for an epoch that is then not trained from its beginning (the
gang regroups, the run stops) is dropped: the next `iter()` resets the persistent processes and
discards what they fetched meanwhile, so no batch of it is trained.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data._utils import signal_handling

from prefect_ddp.tasks.data.positioned_sampler import PositionedSampler


class EpochAhead:
    """`loader`'s epochs, the next one startable early.

    >>> epochs = EpochAhead(DataLoader(list(range(4)), batch_size=2))
    >>> [batch.tolist() for batch in epochs.batches(epoch=0)]
    [[0, 1], [2, 3]]
    """

    def __init__(self, loader: DataLoader[Any]) -> None:
        self.loader = loader
        self._started: tuple[int, Iterator[Any]] | None = None

    @property
    def starts_early(self) -> bool:
        """Whether starting early overlaps anything: only persistent loader processes work between epochs."""
        return bool(self.loader.num_workers) and self.loader.persistent_workers

    def start(self, epoch: int) -> None:
        """Have the loader's processes begin `epoch` now, from its first sample.

        A PositionedSampler is set back to the epoch under way once the iterator has drawn the next
        epoch's order (a DataLoader with loader processes draws it as its iterator starts): until the
        next pass begins, a state parked by a gang lost during validation takes its position from
        the sampler (prefect_ddp.tasks.training.regrouping.Position), and it must be the epoch trained.
        """
        if not self.starts_early:
            return
        sampler = self.loader.sampler
        if not isinstance(sampler, PositionedSampler):
            self._started = (epoch, self._iterator(epoch, 0))
            return
        under_way = (sampler.epoch, sampler.start)
        try:
            self._started = (epoch, self._iterator(epoch, 0))
        finally:  # also where the start fails (a loader process died): the rank then parks the epoch it trained
            sampler.set_epoch(*under_way)

    def batches(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """`epoch`'s batches from global sample position `start`: the ones `start` began, where it began this epoch.

        Otherwise begun at the first batch asked for, not here: a pass's step clock counts the
        loader's start as waiting for data (prefect_ddp.tasks.training.step_times)."""
        started, self._started = self._started, None
        if started is not None and started[0] == epoch and start == 0:
            if isinstance(self.loader.sampler, PositionedSampler):
                self.loader.sampler.set_epoch(epoch, 0)  # the epoch under way now
            return started[1]
        return self._begun_when_asked(epoch, start)

    def close(self) -> None:
        """Stop the loader's processes at once, as the rank leaves (done, stopped, pruned, regrouping or
        failed), whether busy on the epoch under way or on one started ahead.

        DataLoader would wait up to 5 s for each process busy on a batch before it terminates it, so a
        rank leaving beside 32 processes busy on large photos could wait minutes, and their temp
        folders stayed behind until a later rank on the host (prefect_ddp.tasks.data.loader_leftovers).
        Terminated and reaped here, the caller's `remove_dead_loader_folders` removes them. A later
        `iter()` starts new processes."""
        self._started = None
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is None or not getattr(iterator, "_workers", None):
            return
        if getattr(iterator, "_worker_pids_set", False):  # no "worker killed by signal" error for these
            signal_handling._remove_worker_pids(id(iterator))
            iterator._worker_pids_set = False
        for process in iterator._workers:
            process.terminate()
        iterator._shutdown_workers()
        self.loader._iterator = None

    def _begun_when_asked(self, epoch: int, start: int) -> Iterator[Any]:
        yield from self._iterator(epoch, start)

    def _iterator(self, epoch: int, start: int) -> Iterator[Any]:
        sampler = self.loader.sampler
        if isinstance(sampler, PositionedSampler):
            sampler.set_epoch(epoch, start)
        elif hasattr(sampler, "set_epoch"):  # tar shards: a state is parked only at an epoch's start (regrouping.Position)
            sampler.set_epoch(epoch)
        return iter(self.loader)
