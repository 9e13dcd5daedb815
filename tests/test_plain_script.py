"""A flow run with no PREFECT_API_URL: one temporary server, and every rank reports to it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support.image_folders import local_image_folder

REPO = Path(__file__).resolve().parent.parent
# The command line of the temporary server Prefect starts for a process without an API URL.
TEMPORARY_SERVER = "prefect.server.api.server:create_app"


def temporary_servers_below(process: psutil.Process) -> dict[int, int]:
    """Each temporary Prefect server below `process` (its pid), with the pid of its parent."""
    try:
        children = process.children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    found = {}
    for child in children:
        try:
            if TEMPORARY_SERVER in " ".join(child.cmdline()):
                found[child.pid] = child.ppid()
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.mark.slow
def test_one_temporary_server_serves_the_flow_and_every_rank(tmp_path):
    local_image_folder(tmp_path / "images", per_class=4)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    # A Prefect setting of the user's own (a profile's, or any PREFECT_* variable): with one, the
    # settings the flow sent with its tasks named no API, and each worker started its own server.
    # Prefect waits 20 s for its temporary server to answer, which a busy CI runner exceeded
    # (RuntimeError "Timed out while attempting to connect to ephemeral Prefect API server").
    env |= {"PREFECT_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_API_REQUEST_TIMEOUT": "120", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    script = subprocess.Popen(
        [sys.executable, "-m", "tests.support.plain_script_run", str(tmp_path / "images"), str(tmp_path / "out")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    servers: dict[int, int] = {}
    most_at_once = 0
    deadline = time.monotonic() + 420
    while script.poll() is None and time.monotonic() < deadline:
        # Every server any process of the run starts (a worker's would live as long as it).
        running = temporary_servers_below(psutil.Process(script.pid))
        servers |= running
        most_at_once = max(most_at_once, len(running))
        time.sleep(0.3)
    out, err = script.communicate(timeout=30)
    assert script.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["state"] == "COMPLETED"
    # One server at a time, the flow process's own: none started by a worker. (On a loaded
    # machine Prefect may start the flow's again on another port when the first finds its
    # port taken, so more than one may be seen in turn.)
    starts = [line for line in err.splitlines() if "temporary server" in line.lower()]
    assert set(servers.values()) == {script.pid} and most_at_once == 1, (
        f"temporary Prefect servers (pid: parent pid) {servers} below the script's {script.pid}; {starts}")
    assert [r["name"] for r in report["rank_task_runs"]] == ["rank-0", "rank-1"]
    assert {r["flow_run_id"] for r in report["rank_task_runs"]} == {report["flow_run_id"]}
    assert {r["state"] for r in report["rank_task_runs"]} == {"COMPLETED"}
    assert {"training-progress", "training-epochs", "training-report"} <= set(report["artifacts"])
    assert "database is locked" not in err
