"""The next epoch started while this one validates: its first batches load before the pass asks for
them, they are the batches the epoch would have had anyway, and an epoch started ahead that is then
taken over from another position trains none of them.

Real forked, persistent loader processes over a dataset that records, in a file, each batch it loads.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from torch.utils.data import DataLoader, Dataset

from prefect_ddp.tasks.data.dataset import forked_workers
from prefect_ddp.tasks.data.epoch_ahead import EpochAhead
from prefect_ddp.tasks.data.fetch_ahead import FetchAheadLoader
from prefect_ddp.tasks.data.positioned_sampler import PositionedSampler

SIZE, BATCH = 24, 4
DEADLINE_S = 120  # generous: forked processes on a loaded 2-core machine


class Recorded(Dataset[int]):
    """Items 0..SIZE-1; every batch a loader process loads is appended to `log` as it is loaded."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def __len__(self) -> int:
        return SIZE

    def __getitems__(self, indices: list[int]) -> list[int]:
        with self.log.open("a") as out:
            out.write(" ".join(map(str, indices)) + "\n")
        return list(indices)


def loaded(log: Path) -> list[list[int]]:
    return [list(map(int, line.split())) for line in log.read_text().splitlines()] if log.exists() else []


def persistent_loader(log: Path) -> FetchAheadLoader:
    sampler = PositionedSampler(SIZE, num_replicas=1, rank=0, seed=3, batch_size=BATCH)
    return FetchAheadLoader(Recorded(log), sampler, BATCH, num_workers=1, persistent_workers=True,
                            **forked_workers())


def epoch_batches(log: Path, epoch: int, start: int = 0) -> list[list[int]]:
    """The batches a fresh loader gives for `epoch` from `start`, as the recipe would read them without starting ahead."""
    return [batch.tolist() for batch in EpochAhead(persistent_loader(log)).batches(epoch, start)]


def test_the_next_epoch_loads_before_it_is_asked_for_and_gives_its_own_batches(tmp_path):
    expected = epoch_batches(tmp_path / "plain.log", epoch=1)
    log = tmp_path / "ahead.log"
    epochs = EpochAhead(persistent_loader(log))
    first = [batch.tolist() for batch in epochs.batches(epoch=0)]
    assert len(first) == SIZE // BATCH
    epochs.start(1)  # as the recipe does when epoch 0's training pass ends, before validation
    deadline = time.monotonic() + DEADLINE_S
    while len(loaded(log)) == len(first) and time.monotonic() < deadline:
        time.sleep(0.05)
    # Epoch 1's first batch was loaded while nothing asked for it (the rank validating).
    assert loaded(log)[len(first)] == expected[0]
    assert [batch.tolist() for batch in epochs.batches(epoch=1)] == expected
    assert sorted(i for batch in loaded(log)[len(first):] for i in batch) == list(range(SIZE))  # each once


def test_an_epoch_started_ahead_then_taken_over_mid_epoch_trains_none_of_what_it_loaded(tmp_path):
    expected = epoch_batches(tmp_path / "plain.log", epoch=1, start=2 * BATCH)
    epochs = EpochAhead(persistent_loader(tmp_path / "ahead.log"))
    list(epochs.batches(epoch=0))
    epochs.start(1)
    # A formation that took over at sample 8 of epoch 1: its batches from there, each image once.
    assert [batch.tolist() for batch in epochs.batches(epoch=1, start=2 * BATCH)] == expected
    assert len(expected) == SIZE // BATCH - 2


def test_an_epoch_started_ahead_for_another_epoch_is_not_used(tmp_path):
    expected = epoch_batches(tmp_path / "plain.log", epoch=2)
    epochs = EpochAhead(persistent_loader(tmp_path / "ahead.log"))
    list(epochs.batches(epoch=0))
    epochs.start(1)
    assert [batch.tolist() for batch in epochs.batches(epoch=2)] == expected


@pytest.mark.unit
def test_without_loader_processes_nothing_starts_early(tmp_path):
    log = tmp_path / "inline.log"
    sampler = PositionedSampler(SIZE, num_replicas=1, rank=0, seed=3, batch_size=BATCH)
    epochs = EpochAhead(DataLoader(Recorded(log), sampler=sampler, batch_size=BATCH))
    assert not epochs.starts_early
    epochs.start(1)
    assert loaded(log) == []  # no process to load it beside the rank: the rank would load it itself, now
    assert len(list(epochs.batches(epoch=1))) == SIZE // BATCH
