"""Each worker process's own GPU: claimed once, held for the process's life, across gangs.

A device belongs to a worker, not to a gang. Numbering a host's GPUs by rank within each
gang gave two gangs on one 4-GPU host both `cuda:0` and `cuda:1`, and four one-rank trials
all `cuda:0`; numbering by a worker's place among the host's addresses shifts when a nanny
restarts a worker at a new address while another gang still trains on the old numbering.
So on its first probe a worker process claims the lowest-numbered GPU it sees that no other
process on its host holds, and keeps it until it ends. dask-cuda lists each worker's own
GPU first in its CUDA_VISIBLE_DEVICES, so a dask-cuda worker claims its `cuda:0`; plain
`dask worker`s that all see the same GPUs claim one each, in the order they first probe.

A claim is a POSIX record lock (`fcntl.lockf`) on a file named after the GPU's UUID, in a
folder of the user's own (0700). The kernel drops it the moment the process ends, however
it ends, so no claim outlives its worker. Not `flock`: a process forked from the worker (a
DataLoader worker, fork being Linux's default) shares the worker's flock and would keep the
GPU claimed after the worker died; a POSIX lock belongs to the worker process alone. Such a
lock is also dropped when its process closes any descriptor of the file, so each process
opens a lock file once and keeps the one that holds its claim open.

Claims exclude only the processes that share the folder: workers of one user on one host.
Workers in separate containers, or with different HOME folders, cannot see each other's
claims; the planning then still refuses two ranks of one gang whose workers hold the same
GPU (tasks/gang/plan.py: gpu_devices), but not two gangs.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from prefect_ddp.tasks.private_folder import private_folder

ONE_GPU_PER_WORKER = (
    "Start one worker process per GPU, and no more workers on a host than it has GPUs: dask-cuda "
    "(`dask cuda worker tcp://<scheduler>:8786`), or each `dask worker` with a GPU of its own "
    "(CUDA_VISIBLE_DEVICES=0, 1, ...)."
)


@dataclass(frozen=True)
class GpuClaim:
    """The GPU a worker process holds for its whole life, or why it holds none.

    `index` is the GPU's place among the GPUs the worker sees, which is its device number
    in that worker's own numbering (CUDA_VISIBLE_DEVICES may order them differently for
    each worker); `uuid` names the GPU the same way in every process.
    """

    uuid: str | None
    index: int | None
    why_none: str | None = None

    @property
    def device(self) -> str:
        """The claimed GPU as a torch device string, `cuda:<index>` (for a claim that holds one)."""
        return f"cuda:{self.index}"


# This process's claim and the open file whose lock holds it, kept for the process's life.
_held: tuple[GpuClaim, TextIO] | None = None


def claims_folder() -> Path:
    """Where this user's workers on this host keep their claims: ~/.cache/prefect-ddp/gpu-claims.

    In the home folder rather than $XDG_RUNTIME_DIR, which a worker started outside a login
    session (systemd, cron, a batch job) lacks: every worker of the user must use the same folder.
    """
    return Path.home() / ".cache" / "prefect-ddp" / "gpu-claims"


def lock_path(folder: Path, uuid: str) -> Path:
    """The lock file of one GPU; MIG UUIDs of older drivers hold slashes (MIG-GPU-<uuid>/1/0)."""
    return folder / (re.sub(r"[^A-Za-z0-9._-]", "_", uuid) + ".lock")


def try_lock(path: Path, holder: str) -> TextIO | None:
    """`path` opened and locked for this process, with `holder` written in it; None where another process holds it."""
    lock = open(path, "a+")
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        lock.close()
        if exc.errno in (errno.EACCES, errno.EAGAIN):  # POSIX's two ways of saying "held"
            return None
        raise
    lock.truncate(0)
    lock.write(f"{holder} (pid {os.getpid()})")
    lock.flush()
    return lock


def claim_gpu(gpus: Sequence[str], holder: str, folder: Path | None = None) -> GpuClaim:
    """This process's GPU: the first of `gpus` no other process holds, kept until the process ends.

    A process claims once: later calls (the probes of later gangs on the same worker)
    return the same claim. A process that found every GPU held claims nothing and tries
    again on its next call, since a holder may have ended meanwhile.

    Args:
        gpus: the UUIDs of the GPUs this process sees, in device order (`visible_gpus()`;
            tests give made-up ones to stand for a multi-GPU host).
        holder: who claims, as the refusal of a worker that finds the GPU held names it.
        folder: where this user's claims on this host are kept; default `claims_folder()`.

    Example:
        >>> claim_gpu(["GPU-a", "GPU-b"], "worker tcp://10.0.0.1:4001").device  # doctest: +SKIP
        'cuda:0'
    """
    global _held
    if _held is not None:
        return _held[0]
    folder = folder or claims_folder()
    try:
        private_folder(folder, fix="give the worker a HOME of its own")
        for index, uuid in enumerate(gpus):
            if (lock := try_lock(lock_path(folder, uuid), holder)) is not None:
                _held = (GpuClaim(uuid, index), lock)
                return _held[0]
        held_by = ", ".join(f"{uuid} by {lock_path(folder, uuid).read_text() or 'unknown'}" for uuid in gpus)
    except OSError as exc:
        return GpuClaim(None, None, f"its GPU claims cannot be kept in {folder} ({exc}). Give the worker "
                                    "a HOME it can write, on a disk that supports file locks")
    return GpuClaim(None, None, f"all {len(gpus)} GPU(s) it sees are held by other processes on its host: "
                                f"{held_by}. {ONE_GPU_PER_WORKER}")
