"""Temp folders of loader processes that were killed: found by their dead sockets, removed.

A DataLoader worker process that sends a batch to its rank shares the batch's memory through
a listening socket of Python's multiprocessing, in a `pymp-*` folder it makes in the temp
directory; it removes the folder as it exits. A loader process that is SIGKILLed (out of
memory, or its Dask worker killed with it) cannot, and every such loss left a folder behind:
the soak found one per killed loader or worker (bench/RESULTS.md, issue 33). Such a folder
holds only socket files that no live process has bound any more (the kernel's table of
unix sockets, /proc/net/unix, lists every bound one), so it can be told from a live
process's folder and removed by the next rank on the same host.
"""

from __future__ import annotations

import multiprocessing.process
import os
import shutil
import stat
import tempfile
from pathlib import Path

from prefect_ddp.tasks.reporting import run_logger

UNIX_SOCKETS = Path("/proc/net/unix")


def bound_socket_paths() -> set[str] | None:
    """The paths of every bound unix socket on this host; None where the kernel does not say
    (not Linux): then nothing is removed."""
    try:
        lines = UNIX_SOCKETS.read_text().splitlines()[1:]
    except OSError:
        return None
    return {fields[7] for fields in (line.split() for line in lines) if len(fields) >= 8}


def dead_loader_folders(folder: str | None = None) -> list[Path]:
    """This user's `pymp-*` folders in `folder` (default: the temp directory) that hold only
    multiprocessing listener sockets no live process has bound, other than this process's own.

    A loader process makes a folder of its own: its rank's process has none when it forks it
    (a rank never listens itself), so the folder's sockets are the loader's alone.
    """
    bound = bound_socket_paths()
    if bound is None:
        return []
    own = multiprocessing.process.current_process()._config.get("tempdir")  # type: ignore[attr-defined]
    dead = []
    for candidate in Path(folder or tempfile.gettempdir()).glob("pymp-*"):
        try:
            if str(candidate) == own or candidate.lstat().st_uid != os.getuid() or not candidate.is_dir():
                continue
            entries = list(candidate.iterdir())
            if entries and all(entry.name.startswith("listener-") and stat.S_ISSOCK(entry.lstat().st_mode)
                               and str(entry) not in bound for entry in entries):
                dead.append(candidate)
        except OSError:  # removed meanwhile by its own process, or not ours to read
            continue
    return dead


def remove_dead_loader_folders() -> None:
    """Remove the temp folders killed loader processes left (`dead_loader_folders`); logged, never raised."""
    for folder in dead_loader_folders():
        shutil.rmtree(folder, ignore_errors=True)
        run_logger().debug("Removed %s, left by a loader process that was killed", folder)
