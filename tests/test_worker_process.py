"""`prefect-ddp worker`'s child, `prefect worker start`, goes when its parent goes, however it goes.

Against the session's Prefect server, without a warm cluster (the child is the same with one);
a second stop request against a child that never finishes its graceful stop; and the tests'
way of stopping it (local_services.stop): asked twice, never a third time while it winds down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from prefect_ddp.deployments.local_services import running

DEADLINE_S = 120


def command_line(process: psutil.Process) -> list[str]:
    """Its command line; none for a child that has ended (a zombie not yet reaped has none to read)."""
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def prefect_worker_child(parent: psutil.Process, log: Path) -> psutil.Process:
    """The parent's `prefect worker start`, once it says it started (so it polls for work)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        started = "started!" in log.read_text()
        children = [c for c in parent.children() if {"worker", "start"} <= set(command_line(c))]
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


def wait_until_ready(process: subprocess.Popen, log: Path) -> None:
    """Until `process` has written 'ready' to `log`; fails, with the log, if it exits first."""
    deadline = time.monotonic() + DEADLINE_S
    while "ready" not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


# A child that takes no notice of SIGTERM or SIGINT, as `prefect worker start` sometimes does
# not finish its graceful stop (docs/architecture.md, "Facts: Prefect").
STUBBORN_CHILD = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)")
# `prefect-ddp worker`'s stop handling around that child, with a grace far longer than the test.
PARENT = f"""
import sys
from prefect_ddp.deployments import worker
worker.STOP_TIMEOUT_S = 3600
worker.PRCTL = None  # as off Linux: the child does not die with this process, run_child must stop it
worker.stop_on_sigterm()
worker.run_child([sys.executable, "-c", {STUBBORN_CHILD!r}])
"""


def test_a_second_sigterm_stops_the_worker_without_waiting_for_its_child(tmp_path):
    log = tmp_path / "parent.log"
    with open(log, "wb") as sink:
        parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=sink, stderr=subprocess.STDOUT)
    child = None
    try:
        wait_until_ready(parent, log)
        child = psutil.Process(parent.pid).children()[0]
        parent.terminate()
        time.sleep(1)
        assert parent.poll() is None, "the first SIGTERM should wait for the child's graceful stop"
        parent.terminate()
        assert parent.wait(timeout=DEADLINE_S) == 128 + signal.SIGTERM, log.read_text()
        _, alive = psutil.wait_procs([child], timeout=DEADLINE_S)
        assert not alive, f"the child (pid {child.pid}) outlived the second SIGTERM"
    finally:
        if child is not None and child.is_running():
            child.kill()
        parent.kill()


# Stops on its second SIGTERM, then winds down for a while (as `prefect-ddp worker` closes its
# warm cluster), saying how many it got by the end.
WINDS_DOWN = """
import signal, time
asked = 0
def count(signum, frame):
    global asked
    asked += 1
signal.signal(signal.SIGTERM, count)
print("ready", flush=True)
while asked < 2:
    time.sleep(0.05)
time.sleep(2)
print(f"asked {asked} times", flush=True)
"""


def test_stopping_asks_a_second_time_once_and_lets_the_program_wind_down(tmp_path):
    log = tmp_path / "program.log"
    with running([sys.executable, "-c", WINDS_DOWN], log, ask_again_after_s=1) as program:
        wait_until_ready(program, log)
    assert program.returncode == 0, log.read_text()
    assert "asked 2 times" in log.read_text()
