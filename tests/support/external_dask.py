"""Existing Dask clusters for tests, started as their owners start them: `dask scheduler` and
`dask worker` processes in sessions of their own, stopped together at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import distributed

REPO = Path(__file__).resolve().parents[2]
# The environment of a worker set up for training (docs/running.md, "Existing clusters, or a GPU box").
TRAINING_ENV = {
    "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
    "DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON": '{"MALLOC_TRIM_THRESHOLD_": None}',
    "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False",
}


def owner_environment(prefect_home: Path, settings: dict[str, str]) -> dict[str, str]:
    """This process's environment without its Dask settings and Prefect API, plus `settings`.

    PREFECT_HOME keeps the workers off ~/.prefect's profiles; PYTHONPATH lets them import
    the tests' rank functions, as a team's workers would have its package installed.
    MALLOC_TRIM_THRESHOLD_ goes too: a nanny of a LocalCluster that a test started in this
    process puts its pre-spawn environment into this process's os.environ.
    """
    dropped = {"PREFECT_API_URL", "MALLOC_TRIM_THRESHOLD_"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_") and k not in dropped}
    return env | {"PREFECT_HOME": str(prefect_home), "PYTHONPATH": str(REPO)} | settings


def signal_session(process: subprocess.Popen, sig: signal.Signals) -> None:
    """Send `sig` to the session a `dask` command started in (its nanny's worker too)."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def stop_all(processes: list[subprocess.Popen], grace_s: float = 10) -> None:
    """SIGTERM every session at once, then SIGKILL those still running after `grace_s`."""
    for process in processes:
        signal_session(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        signal_session(process, signal.SIGKILL)  # the session's other processes too
        process.wait()


def scheduler_address(scheduler_file: Path, log: Path, timeout_s: float = 60) -> str:
    """The address in the scheduler's `--scheduler-file`, once the file holds it whole: the scheduler
    creates the file before it writes it (a read in between found it empty, on a busy machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return str(json.loads(scheduler_file.read_text())["address"])
        except (FileNotFoundError, json.JSONDecodeError):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)


@contextmanager
def dask_processes(folder: Path, workers: int, nanny: bool, env: dict[str, str],
                   worker_prefix: Sequence[str] = ()) -> Iterator[str]:
    """`dask scheduler` and `workers` x `dask worker` (one thread each); yields the scheduler's address.

    `worker_prefix` goes before each worker's command line (e.g. `unshare ...`, to start
    the workers in a mount namespace of their own).
    """
    scheduler_file = folder / "scheduler.json"
    started: list[subprocess.Popen] = []

    def start(*args: str, log: str, prefix: Sequence[str] = ()) -> None:
        with open(folder / log, "wb") as out:
            started.append(subprocess.Popen([*prefix, sys.executable, "-m", "dask", *args], env=env, cwd=folder,
                                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True))

    try:
        start("scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
              "--scheduler-file", str(scheduler_file), log="scheduler.log")
        address = scheduler_address(scheduler_file, folder / "scheduler.log")
        for number in range(workers):
            start("worker", address, "--host", "127.0.0.1", "--nthreads", "1", "--no-dashboard",
                  *([] if nanny else ["--no-nanny"]), log=f"worker-{number}.log", prefix=worker_prefix)
        with distributed.Client(address, timeout=30) as client:
            client.wait_for_workers(workers, timeout=90)
        yield address
    finally:
        stop_all(started)


