"""A user's script without `if __name__ == "__main__":` runs as written (issue 57).

Before, the local cluster's workers imported the script again and ran its call again: each started
a flow run and a cluster of its own, every nanny failed, and the script waited for more than 10
minutes; piped on stdin it failed with `FileNotFoundError: '<stdin>'`. Dask workers started from a
process that imported prefect_ddp now never run its `__main__` (tasks/script_main.py), and a worker
that does not start is killed after its nanny's deadline (blocks/nanny_environment.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from multiprocessing import spawn
from pathlib import Path

import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName

from prefect_ddp.blocks.cluster import LOCAL_CLUSTER_PRELOAD, create_local_cluster
from prefect_ddp.blocks.nanny_environment import WorkerStartTimeout
from prefect_ddp.tasks.script_main import DASK_WORKER_PROCESS, MAIN_ENTRIES

REPO = Path(__file__).resolve().parents[1]
# Generous: the script ends in about 15 s here; before the fix it never ended.
SCRIPT_DEADLINE_S = 300

UNGUARDED = '''
import os
from prefect import flow
from prefect_ddp import DaskCluster, run_gang

def rank(ctx, config):
    return ctx.rank

@flow(name=os.environ["SCRIPT_FLOW_NAME"])
def unguarded():
    with DaskCluster(n_workers=1).task_runner() as runner:
        return run_gang(rank, {}, task_runner=runner)

print("ranks", list(unguarded()))
'''


@pytest.mark.unit
def test_a_dask_worker_process_is_prepared_without_the_script_and_other_processes_with_it():
    import prefect_ddp  # noqa: F401  (importing the package is what leaves the script out)

    script = spawn.get_preparation_data("SomeProcess")
    worker = spawn.get_preparation_data(DASK_WORKER_PROCESS)
    assert any(entry in script for entry in MAIN_ENTRIES)  # pytest's __main__ is a module or a file
    assert not any(entry in worker for entry in MAIN_ENTRIES)
    assert worker["sys_path"] == script["sys_path"]


def flow_runs_named(name: str) -> list:
    with get_client(sync_client=True) as api:
        return api.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))


def test_a_script_without_the_main_guard_runs_as_a_file_and_on_stdin(prefect_api, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(UNGUARDED)
    runs = {}
    for how in ("file", "stdin"):
        env = dict(os.environ, PREFECT_API_URL=prefect_api, SCRIPT_FLOW_NAME=f"unguarded-{how}-{tmp_path.name}")
        command = [sys.executable, str(script)] if how == "file" else [sys.executable, "-"]
        runs[how] = subprocess.Popen(command, stdin=script.open() if how == "stdin" else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                                     env=env, start_new_session=True)
    for how, process in runs.items():
        try:
            output, _ = process.communicate(timeout=SCRIPT_DEADLINE_S)
        finally:
            process.kill()
        assert process.returncode == 0, f"{how}: exited {process.returncode}:\n{output[-3000:]}"
        assert "ranks [0]" in output, output[-3000:]
        # One flow run, the script's own: no worker ran the script's call again.
        (run,) = flow_runs_named(f"unguarded-{how}-{tmp_path.name}")
        assert run.state.is_completed()
        left = left_in_session(process.pid)
        assert not left, f"{how}: processes left behind: {left}"


def left_in_session(session: int, deadline_s: float = 60) -> list[list[str]]:
    """The command lines of live processes of `session` once they are gone or the deadline passed
    (the forkserver and the resource tracker leave a moment after the script)."""
    end = time.monotonic() + deadline_s
    while True:
        left = []
        for process in psutil.process_iter():
            try:
                if os.getsid(process.pid) == session and process.status() != psutil.STATUS_ZOMBIE:
                    left.append(process.cmdline())
            except (OSError, psutil.Error):
                continue  # gone meanwhile
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.5)


def test_a_worker_that_never_starts_is_killed_and_the_cluster_s_start_fails_naming_it(prefect_api):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="failed to start") as failed:
        create_local_cluster(n_workers=1, preload=[*LOCAL_CLUSTER_PRELOAD, "tests.support.hanging_preload"],
                             start_timeout_s=3)
    cause = failed.value.__cause__
    assert isinstance(cause, WorkerStartTimeout), repr(cause)
    assert "did not start within 3 s, and was killed" in str(cause) and "preload" in str(cause)
    assert time.monotonic() - started < SCRIPT_DEADLINE_S
    hung = [p for p in psutil.Process().children(recursive=True) if "hanging_preload" in " ".join(p.cmdline())]
    assert not hung
