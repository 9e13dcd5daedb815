"""The next epoch started while this one validates: its first batches load before the pass asks for
them, they are the batches the epoch would have had anyway, and an epoch started ahead that is then
taken over from another position trains none of them.

Real forked, persistent loader processes over a dataset that records, in a file, each batch it loads.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from prefect_ddp.tasks.data.dataset import forked_workers
from prefect_ddp.tasks.data.epoch_ahead import EpochAhead
from prefect_ddp.tasks.data.fetch_ahead import FetchAheadLoader
from prefect_ddp.tasks.data.loader_leftovers import PREFIX, remove_dead_loader_folders
from prefect_ddp.tasks.data.positioned_sampler import PositionedSampler
from prefect_ddp.tasks.training.pass_sums import PassSums
from prefect_ddp.tasks.training.regrouping import Position

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


def persistent_loader(log: Path, size: int = SIZE, ranks: int = 1) -> FetchAheadLoader:
    sampler = PositionedSampler(size, num_replicas=ranks, rank=0, seed=3, batch_size=BATCH)
    return FetchAheadLoader(Recorded(log), sampler, BATCH, num_workers=1, persistent_workers=True,
                            **forked_workers())


def epoch_batches(log: Path, epoch: int, start: int = 0, size: int = SIZE, ranks: int = 1) -> list[list[int]]:
    """The batches a fresh loader gives for `epoch` from `start`, as the recipe would read them without starting ahead."""
    return [batch.tolist() for batch in EpochAhead(persistent_loader(log, size, ranks)).batches(epoch, start)]


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


class SlowLater(Recorded):
    """Items whose batches other than the `fast` ones take a minute each to load (camera originals on
    a slow store): a loader process busy on one does not see a request to stop. Fast by the batch,
    not by the order loaded: two loader processes load side by side, and either may write first."""

    def __init__(self, log: Path, fast: list[list[int]]) -> None:
        super().__init__(log)
        self.fast = fast

    def __getitems__(self, indices: list[int]) -> list[int]:
        if list(indices) not in self.fast:
            time.sleep(60)
            with self.log.open("a") as out:
                out.write("0\n")  # a slow batch done
        return super().__getitems__(indices)


def first_epoch_batches(sampler: PositionedSampler) -> list[list[int]]:
    sampler.set_epoch(0)
    order = list(sampler)
    return [order[at:at + BATCH] for at in range(0, len(order), BATCH)]


@pytest.mark.parametrize("leaving", ["with an epoch started ahead", "mid-epoch"])
def test_a_rank_leaving_stops_its_busy_loader_processes_at_once_and_their_folders_go(tmp_path, monkeypatch, leaving):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the loader processes' own temp folders go here
    monkeypatch.setattr(tempfile, "tempdir", None)
    log = tmp_path / "slow.log"
    ahead = leaving == "with an epoch started ahead"
    sampler = PositionedSampler(SIZE, num_replicas=1, rank=0, seed=3, batch_size=BATCH)
    fast = first_epoch_batches(sampler)[:SIZE // BATCH if ahead else 1]
    loader = FetchAheadLoader(SlowLater(log, fast), sampler, BATCH, num_workers=2,
                              persistent_workers=True, **forked_workers())
    epochs = EpochAhead(loader)
    if ahead:  # epoch 0 trained; then the run is pruned, stopped, or regroups before epoch 1
        list(epochs.batches(epoch=0))
        epochs.start(1)
    else:  # a peer lost, the gang stopped, or a regroup mid-epoch
        next(epochs.batches(epoch=0))
    processes = list(loader._iterator._workers)
    epochs.close()
    assert not any(process.is_alive() for process in processes)
    assert sorted(map(sorted, loaded(log))) == sorted(map(sorted, fast))  # no slow batch waited for
    remove_dead_loader_folders()
    assert not list(tmp_path.glob(f"{PREFIX}*"))


def test_a_next_epoch_that_fails_to_start_leaves_the_sampler_on_the_epoch_trained(tmp_path):
    """A loader process dead by the epoch's end (the OOM killer) fails the next epoch's start; the
    rank then parks the epoch it trained, from the sampler, and must not find the next one there."""
    sampler = PositionedSampler(100, num_replicas=2, rank=0, seed=3, batch_size=BATCH)
    epochs = EpochAhead(FetchAheadLoader(Recorded(tmp_path / "log"), sampler, BATCH, num_workers=1,
                                         persistent_workers=True, **forked_workers()))
    failed: list[BaseException] = []

    def epoch_then_start() -> None:  # in a thread, as a rank on a Dask worker: torch's SIGCHLD handler stays out
        list(epochs.batches(epoch=4, start=40))
        for process in epochs.loader._iterator._workers:
            os.kill(process.pid, signal.SIGKILL)
            process.join(DEADLINE_S)
        try:
            epochs.start(5)
        except RuntimeError as error:
            failed.append(error)

    rank = threading.Thread(target=epoch_then_start)
    rank.start()
    rank.join(DEADLINE_S)
    assert failed and "exited unexpectedly" in str(failed[0])
    assert (sampler.epoch, sampler.start) == (4, 40)
    epochs.close()


def test_a_state_parked_while_the_next_epoch_loads_is_parked_where_this_epoch_ended(tmp_path):
    """A gang lost during validation parks the epoch it trained, at its end, not a position of the next."""
    size, start = 100, 40  # a formation of 2 ranks that took epoch 0 over at sample 40
    sampler = PositionedSampler(size, num_replicas=2, rank=0, seed=3, batch_size=BATCH)
    epochs = EpochAhead(FetchAheadLoader(Recorded(tmp_path / "log"), sampler, BATCH, num_workers=1,
                                         persistent_workers=True, **forked_workers()))
    position = Position(epoch=0, start=start)
    trained = sum(len(batch) for batch in epochs.batches(epoch=0, start=start))
    position.stepped(0, trained)
    epochs.start(1)
    assert position.global_position(sampler) == size
    assert [batch.tolist() for batch in epochs.batches(epoch=1)] == epoch_batches(tmp_path / "plain", 1, 0, size, 2)


def test_a_pass_that_keeps_its_batches_labels_holds_no_file_descriptor_per_batch():
    """A CPU rank's labels are the loader process's tensors in shared memory, each holding a file
    descriptor open while kept: a pass of 1,024 batches reached the usual limit of open files."""
    loader = DataLoader([(torch.zeros(3), 0)] * 600, batch_size=2, num_workers=1, persistent_workers=True,
                        **forked_workers())
    sums, logits = PassSums(), torch.zeros(2, 3)
    for _, labels in loader:  # warm: the loader's own descriptors are open
        break
    before = len(os.listdir("/proc/self/fd"))
    for _, labels in loader:
        sums.add(loader, logits, labels, torch.tensor(0.0), torch.tensor(2))
    assert len(os.listdir("/proc/self/fd")) - before < 50
    assert sums.count == 600
