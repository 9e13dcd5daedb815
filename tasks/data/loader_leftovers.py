"""Temp folders of loader processes: one per process, named for it, removed once it is gone.

A DataLoader worker process that sends a batch to its rank shares the batch's memory through
a listening socket of Python's multiprocessing, in a temp folder multiprocessing makes with a
random name (`pymp-*`) and removes as the process exits. A loader process that is SIGKILLed
(out of memory, or its Dask worker killed with it) cannot, and every such loss left a folder
behind: the soak found one per killed loader or worker (bench/RESULTS.md, issue 33). A random
name does not say whose folder it is, and telling a dead one by its sockets races with live
processes binding theirs.

So each of the recipe's loader processes makes its multiprocessing temp folder itself, first
thing (`use_own_temp_folder`, run by the DataLoader's `worker_init_fn`), named for the process:
its pid and start time. Any rank on the host can then tell a dead process's folder for sure,
the pid gone, a zombie, or reused by a process started at another time, and removes it
(`remove_dead_loader_folders`, when a rank starts loaders and when it ends).
"""

from __future__ import annotations

import multiprocessing.process
import multiprocessing.util
import os
import shutil
import tempfile
from pathlib import Path

import psutil

from prefect_ddp.tasks.reporting import run_logger

PREFIX = "prefect-ddp-loader-"
# A unix socket's path, and so a listener's below the folder, fits in 108 bytes (Linux's sun_path).
SOCKET_PATH_LIMIT = 108


def use_own_temp_folder() -> str | None:
    """In a loader process: make its multiprocessing temp folder, named for it, private (0700), and
    removed as it exits normally. It replaces any folder inherited from the rank's process, whose
    sockets would otherwise share a folder with the rank's own. None, and multiprocessing's own
    folder, where the temp directory's path is too long for the socket paths below it."""
    me = psutil.Process()
    folder = os.path.join(tempfile.gettempdir(), f"{PREFIX}{me.pid}-{started_ms(me):x}")
    if len(folder) + len("/listener-12345678") >= SOCKET_PATH_LIMIT:
        return None
    os.mkdir(folder, 0o700)
    # Where multiprocessing.util.get_temp_dir looks first; it then makes no folder of its own.
    multiprocessing.process.current_process()._config["tempdir"] = folder  # type: ignore[attr-defined]
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True},
                                  exitpriority=-100)
    return folder


def started_ms(process: psutil.Process) -> int:
    return round(float(process.create_time()) * 1000)


def owner_is_gone(name: str) -> bool:
    """Whether the process a folder is named for (`PREFIX` pid - start ms in hex) no longer runs.

    A killed loader that its rank has not reaped yet is a zombie, and is gone: one killed after
    the epoch's last batch stays a zombie until the rank's loader is freed, after the rank's own
    clean-up has looked (the flows soak found its folder left; bench/RESULTS.md, issue 33). Only
    a zombie without threads: a process whose main thread ended while others run (native code
    can) also reads as a zombie, and still uses its folder."""
    pid_text, started_text = name.removeprefix(PREFIX).split("-")[:2]
    pid, started = int(pid_text), int(started_text, 16)
    try:
        process = psutil.Process(pid)
        reused = abs(started_ms(process) - started) > 1000  # the pid now belongs to a later process
        return reused or (process.status() == psutil.STATUS_ZOMBIE and process.num_threads() <= 1)
    except psutil.NoSuchProcess:
        return True


def dead_loader_folders(folder: str | None = None) -> list[Path]:
    """This user's loader folders in `folder` (default: the temp directory) whose process is gone."""
    dead = []
    for candidate in Path(folder or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            if candidate.is_symlink() or candidate.lstat().st_uid != os.getuid():
                continue
            if owner_is_gone(candidate.name):
                dead.append(candidate)
        except (OSError, ValueError, psutil.Error):  # gone meanwhile, not ours to read, or another name
            continue
    return dead


def remove_dead_loader_folders(folder: str | None = None) -> None:
    """Remove the folders of loader processes that were killed (`dead_loader_folders`). Logged,
    never raised: the rank's training, or its own error, matters more."""
    try:
        for dead in dead_loader_folders(folder):
            shutil.rmtree(dead, ignore_errors=True)
            run_logger().debug("Removed %s, left by a loader process that was killed", dead)
    except Exception:
        run_logger().exception("Could not look for the temp folders of killed loader processes")
