"""Fetching a loader process's next batches while it decodes this one (docs/architecture.md,
"Data: per-image reads").

A loader process that fetches a batch and then decodes it waits one round trip per batch:
at 30 ms to S3, small images were latency-bound at a quarter of local disk's rate
(bench/RESULTS.md). Here each batch carries the indices of the next `AHEAD` batches the same
process will be given, and the dataset starts fetching those before it decodes, so their
round trips overlap with each other and with decoding. Still one GET per image: a batch
fetched ahead is the batch that process is given next.

That rests on how DataLoader hands out batches: in order, round robin over its worker
processes, starting again at worker 0 every epoch (torch.utils.data.dataloader,
`_worker_queue_idx_cycle`); with no worker processes, every batch goes to the main one.
A batch fetched ahead that is then not asked for (a guess gone wrong) is dropped and
logged; the test counts GETs per image to show that none is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, Sampler

AHEAD = 2  # batches each loader process fetches ahead of the one it decodes
BATCHES_AT_ONCE = AHEAD + 1  # a loader process's batch and those it fetches ahead, all in flight at once

logger = logging.getLogger(__name__)


class AheadBatch(list[int]):
    """A batch's indices, and those of the batches its loader process will be given next."""

    def __init__(self, indices: Sequence[int], following: tuple[tuple[int, ...], ...]) -> None:
        super().__init__(indices)
        self.following = following

    def __reduce__(self) -> tuple[Any, ...]:  # to the loader process through its index queue
        return AheadBatch, (list(self), self.following)


class AheadBatches(Sampler[list[int]]):
    """`BatchSampler(sampler, batch_size, drop_last)`'s batches, each told which ones follow it
    in its loader process: the batches `loader_processes`, 2 x `loader_processes`, ... later."""

    def __init__(self, sampler: Sampler[int] | Sequence[int], batch_size: int, drop_last: bool,
                 loader_processes: int) -> None:
        self.batches = BatchSampler(sampler, batch_size, drop_last)
        self.stride = max(1, loader_processes)

    def __iter__(self) -> Iterator[AheadBatch]:
        batches = [tuple(batch) for batch in self.batches]  # this epoch's: the sampler is seeded per epoch
        for number, batch in enumerate(batches):
            following = batches[number + self.stride:number + self.stride * (AHEAD + 1):self.stride]
            yield AheadBatch(batch, tuple(following))

    def __len__(self) -> int:
        return len(self.batches)


class FetchAheadLoader(DataLoader[Any]):
    """A DataLoader over `sampler` in batches that fetch ahead (the dataset must use
    `FetchesAhead`). Its `sampler` is the one given, so `loader.sampler.set_epoch(epoch)`
    reaches a DistributedSampler as with a plain DataLoader."""

    def __init__(self, dataset: Any, sampler: Sampler[int] | Sequence[int], batch_size: int,
                 drop_last: bool = False, **options: Any) -> None:
        self._given_sampler = sampler
        batches = AheadBatches(sampler, batch_size, drop_last, options.get("num_workers", 0))
        super().__init__(dataset, batch_sampler=batches, **options)

    @property
    def sampler(self) -> Sampler[int] | Sequence[int]:
        return self._given_sampler

    @sampler.setter
    def sampler(self, placeholder: Iterable[Any]) -> None:  # typed as DataLoader's attribute
        pass  # DataLoader.__init__ sets a placeholder sampler of its own when given batches


class FetchesAhead:
    """One process's batches in flight: `take` returns a batch's data, fetched ahead when
    its batch said so, and starts fetching the ones said to follow it."""

    def __init__(self) -> None:
        self._pool: tuple[int, ThreadPoolExecutor] | None = None
        self._in_flight: dict[tuple[int, ...], Future[list[Any]]] = {}

    def __getstate__(self) -> dict[str, Any]:  # threads and fetches stay in their process
        return {"_pool": None, "_in_flight": {}}

    def take(self, indices: Sequence[int], fetch: Callable[[list[int]], list[Any]]) -> list[Any]:
        """`fetch(indices)`'s result; fetches of the batches following `indices` are started first."""
        following = getattr(indices, "following", ())
        if not following and not self._in_flight:
            return fetch(list(indices))
        pool = self._threads()
        current = self._in_flight.pop(tuple(indices), None) or pool.submit(fetch, list(indices))
        wrong = [batch for batch in self._in_flight if batch not in following]
        if wrong:
            logger.warning("Process %d fetched %d batch(es) ahead that it was then not given; their "
                           "images are fetched again.", os.getpid(), len(wrong))
            for batch in wrong:
                del self._in_flight[batch]
        for batch in following:
            if batch not in self._in_flight:
                self._in_flight[batch] = pool.submit(fetch, list(batch))
        return current.result()

    def _threads(self) -> ThreadPoolExecutor:
        """This process's fetch threads: a pool made before a fork has no threads after it."""
        if self._pool is None or self._pool[0] != os.getpid():
            self._pool = (os.getpid(), ThreadPoolExecutor(BATCHES_AT_ONCE, thread_name_prefix="fetch-ahead"))
            self._in_flight.clear()
        return self._pool[1]
