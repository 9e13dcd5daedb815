"""A loader process that was killed leaves its temp folder; the next rank removes it, and only it
(tasks/data/loader_leftovers.py)."""

from __future__ import annotations

import multiprocessing.process
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from prefect_ddp.tasks.data.dataset import forked_workers
from prefect_ddp.tasks.data.loader_leftovers import (PREFIX, dead_loader_folders, owner_is_gone,
                                                     remove_dead_loader_folders, started_ms)


class Tensors(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((4,), float(index))


def loader_with_a_batch_sent() -> Any:
    """The recipe's loader process (forked_workers) that has sent its rank a batch: through a
    listening socket in its multiprocessing temp folder. Started in a thread, as a rank runs in a
    Dask worker's: torch then installs no SIGCHLD handler, which would raise in this test's main
    thread when the loader is killed."""
    started: list[Any] = []

    def start() -> None:
        batches = iter(DataLoader(Tensors(), batch_size=4, num_workers=1, persistent_workers=True,
                                  **forked_workers()))
        next(batches)
        started.append(batches)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(60)
    return started[0]


def temp_entries(folder: str) -> set[str]:
    return set(os.listdir(folder))


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp directory whose path leaves room for socket paths below it (pytest's tmp_path is too long)."""
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="t-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def default_sigchld() -> Iterator[None]:
    """SIGCHLD's default handling while the test runs. An earlier test that iterated a loader in this
    process's main thread left torch's handler, which raises there when a loader process is killed;
    ranks run in Dask's threads, where torch installs none."""
    before = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGCHLD, before)


def test_a_killed_loader_s_temp_folder_is_removed_and_a_live_one_s_kept(short_tmp, monkeypatch, default_sigchld):
    tmp_path = short_tmp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the loaders fork with it
    # A temp folder of this process (an earlier test's multiprocessing use) would be inherited: the
    # loaders must make their own all the same.
    monkeypatch.setitem(multiprocessing.process.current_process()._config, "tempdir", str(tmp_path / "inherited"))
    killed = loader_with_a_batch_sent()
    (victim,) = killed._workers
    left = temp_entries(str(tmp_path))
    assert [name.startswith(f"{PREFIX}{victim.pid}-") for name in left] == [True], left
    alive = loader_with_a_batch_sent()
    both = temp_entries(str(tmp_path))
    assert len(both) == 2 and not any(name.startswith("pymp-") for name in both), both
    assert dead_loader_folders(str(tmp_path)) == []  # both run: nothing is removed
    os.kill(victim.pid, signal.SIGKILL)  # out of memory, or its Dask worker killed with it
    victim.join(30)
    assert [p.name for p in dead_loader_folders(str(tmp_path))] == sorted(left)
    remove_dead_loader_folders()
    assert temp_entries(str(tmp_path)) == both - left  # the live loader's folder stays
    assert next(alive).shape == (4, 4)  # and it still sends batches through it


def test_a_killed_loader_its_rank_has_not_reaped_yet_is_dead(short_tmp, monkeypatch, default_sigchld):
    """A persistent loader killed after the epoch's last batch stays a zombie while its rank holds
    the loader, as it does when its clean-up looks: its folder was left (issue 33's flows soak)."""
    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    killed = loader_with_a_batch_sent()
    (victim,) = killed._workers
    os.kill(victim.pid, signal.SIGKILL)
    wait_until_dead(victim.pid)
    assert [p.name for p in dead_loader_folders(str(short_tmp))] == sorted(temp_entries(str(short_tmp)))


def wait_until_dead(pid: int) -> None:
    """Until `pid` is a zombie whose threads have all ended (they end a moment after the main
    one), or reaped already (a process started meanwhile reaps every finished child of this
    one: the session's nanny restarting a worker, say)."""
    deadline = time.monotonic() + 60
    try:
        process = psutil.Process(pid)
        while process.status() != psutil.STATUS_ZOMBIE or process.num_threads() > 1:
            assert time.monotonic() < deadline, f"pid {pid} still runs 60 s after SIGKILL"
            time.sleep(0.05)
    except psutil.NoSuchProcess:
        pass


# A process whose main thread ends (native code can) while another thread runs on.
MAIN_THREAD_ENDS = """
import ctypes, threading, time
threading.Thread(target=lambda: time.sleep(600)).start()
ctypes.CDLL("libc.so.6").pthread_exit(None)
"""


def test_a_live_process_whose_main_thread_ended_is_not_dead():
    """Its status reads zombie, but it still runs, and may still use its folder."""
    with subprocess.Popen([sys.executable, "-c", MAIN_THREAD_ENDS]) as child:
        try:
            process = psutil.Process(child.pid)
            deadline = time.monotonic() + 60
            while process.status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline, process.status()
                time.sleep(0.05)
            assert process.num_threads() == 2
            assert not owner_is_gone(f"{PREFIX}{child.pid}-{started_ms(process):x}")
        finally:
            child.kill()


def test_a_folder_whose_pid_now_belongs_to_a_later_process_is_dead(tmp_path):
    me_started_long_ago = tmp_path / f"{PREFIX}{os.getpid()}-3e8"  # this pid, but a start time of 1970
    me_started_long_ago.mkdir()
    nobody = tmp_path / f"{PREFIX}999999999-3e8"
    nobody.mkdir()
    not_ours = tmp_path / "pymp-xyz"  # multiprocessing's own, of some other program: never touched
    not_ours.mkdir()
    (tmp_path / f"{PREFIX}not-a-pid").mkdir()  # a name this module never makes: never touched
    assert sorted(p.name for p in dead_loader_folders(str(tmp_path))) == sorted([me_started_long_ago.name, nobody.name])
    remove_dead_loader_folders(str(tmp_path))
    assert temp_entries(str(tmp_path)) == {"pymp-xyz", f"{PREFIX}not-a-pid"}
