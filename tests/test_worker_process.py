"""`prefect-ddp worker`'s child, `prefect worker start`, goes when its parent goes, however it goes.

Against the session's Prefect server, without a warm cluster (the child is the same with one).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

DEADLINE_S = 120


def prefect_worker_child(parent: psutil.Process, log: Path) -> psutil.Process:
    """The parent's `prefect worker start`, once it says it started (so it polls for work)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        started = "started!" in log.read_text()
        children = [c for c in parent.children() if "worker" in c.cmdline() and "start" in c.cmdline()]
        if started and children:
            return children[0]
        assert parent.is_running(), log.read_text()
        time.sleep(0.5)
    raise AssertionError(f"`prefect worker start` did not start within {DEADLINE_S} s:\n{log.read_text()}")


def test_a_killed_worker_leaves_no_prefect_worker_polling_on_its_own(prefect_api, tmp_path):
    log = tmp_path / "worker.log"
    with open(log, "wb") as sink:
        parent = subprocess.Popen(
            [sys.executable, "-m", "prefect_ddp", "worker", "--pool", "orphans", "--type", "process",
             "--no-warm-cluster"], stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path)
    children = psutil.Process(parent.pid).children  # read before the parent goes
    child = None
    try:
        child = prefect_worker_child(psutil.Process(parent.pid), log)
        os.kill(parent.pid, signal.SIGKILL)  # as a supervisor does when a graceful stop outlasts its patience
        parent.wait()
        _, alive = psutil.wait_procs([child], timeout=DEADLINE_S)
        assert not alive, f"`prefect worker start` (pid {child.pid}) outlived its killed parent"
    finally:
        leftovers = [child] if child is not None and child.is_running() else []
        if parent.poll() is None:
            leftovers += children(recursive=True)
            parent.kill()
        for process in leftovers:
            process.kill()
