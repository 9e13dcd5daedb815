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


def temporary_servers_below(process: psutil.Process) -> set[int]:
    try:
        children = process.children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    found = set()
    for child in children:
        try:
            if TEMPORARY_SERVER in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.mark.slow
def test_one_temporary_server_serves_the_flow_and_every_rank(tmp_path):
    local_image_folder(tmp_path / "images", per_class=4)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {"PREFECT_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    script = subprocess.Popen(
        [sys.executable, "-m", "tests.support.plain_script_run", str(tmp_path / "images"), str(tmp_path / "out")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    servers: set[int] = set()
    deadline = time.monotonic() + 240
    while script.poll() is None and time.monotonic() < deadline:
        # Every server any process of the run starts (a worker's would live as long as it).
        servers |= temporary_servers_below(psutil.Process(script.pid))
        time.sleep(0.3)
    out, err = script.communicate(timeout=30)
    assert script.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["state"] == "COMPLETED"
    assert len(servers) == 1, f"{len(servers)} temporary Prefect servers ran: {servers}"
    assert [r["name"] for r in report["rank_task_runs"]] == ["rank-0", "rank-1"]
    assert {r["flow_run_id"] for r in report["rank_task_runs"]} == {report["flow_run_id"]}
    assert {r["state"] for r in report["rank_task_runs"]} == {"COMPLETED"}
    assert {"training-progress", "training-epochs", "training-report"} <= set(report["artifacts"])
    assert "database is locked" not in err
