"""A loader process that was killed leaves its temp folder; the next rank removes it, and only it
(tasks/data/loader_leftovers.py)."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from prefect_ddp.tasks.data.loader_leftovers import dead_loader_folders, remove_dead_loader_folders


class Tensors(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((4,), float(index))


def loader_with_a_batch_sent() -> Any:
    """A loader process (forked, as the recipe's) that has sent its rank a batch: through a
    listening socket in a `pymp-*` folder of its own. Started in a thread, as a rank runs in a
    Dask worker's: torch then installs no SIGCHLD handler, which would raise in this test's
    main thread when the loader is killed."""
    started: list[Any] = []

    def start() -> None:
        batches = iter(DataLoader(Tensors(), batch_size=4, num_workers=1, multiprocessing_context="fork",
                                  persistent_workers=True))
        next(batches)
        started.append(batches)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(60)
    return started[0]


def pymp_folders(folder: str) -> set[str]:
    return {name for name in os.listdir(folder) if name.startswith("pymp-")}


def test_the_folder_of_a_killed_loader_process_is_removed_and_a_live_one_s_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the loaders fork with it
    killed = loader_with_a_batch_sent()
    (victim,) = killed._workers
    left = pymp_folders(str(tmp_path))
    assert len(left) == 1, left
    alive = loader_with_a_batch_sent()
    both = pymp_folders(str(tmp_path))
    assert len(both) == 2
    assert dead_loader_folders(str(tmp_path)) == []  # both listen: nothing is removed
    os.kill(victim.pid, signal.SIGKILL)  # out of memory, or its Dask worker killed with it
    victim.join(30)
    deadline = time.monotonic() + 30  # the kernel drops the socket as the process goes
    while not dead_loader_folders(str(tmp_path)):
        assert time.monotonic() < deadline, "the killed loader's folder was never taken for dead"
        time.sleep(0.2)
    assert [p.name for p in dead_loader_folders(str(tmp_path))] == sorted(left)
    remove_dead_loader_folders()
    assert pymp_folders(str(tmp_path)) == both - left  # the live loader's folder stays
    assert next(alive).shape == (4, 4)  # and it still sends batches through it
