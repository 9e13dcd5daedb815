"""A user's script that imports the project at its top, then starts a local cluster: its workers
import this script again (as `__mp_main__`) before their nanny's environment is applied.

    python tests/support/environment_script.py

Prints one JSON line: what the worker saw of a secret set before the cluster started and removed
before a restart, at its start and after the restart, and whether a process the worker starts
inherits the nanny's list of names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import distributed

from prefect_ddp.blocks.cluster import create_local_cluster
from prefect_ddp.blocks.nanny_environment import GIVEN_NAMES


def seen() -> dict[str, object]:
    child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({GIVEN_NAMES!r}))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    return {"secret": os.environ.get("REMOVED_SECRET"), "child_given_names": child}


if __name__ == "__main__":
    os.environ["REMOVED_SECRET"] = "s3cr3t-value"
    with create_local_cluster(n_workers=1) as cluster, distributed.Client(cluster) as client:
        (started,) = client.run(seen).values()
        del os.environ["REMOVED_SECRET"]
        client.restart()
        (restarted,) = client.run(seen).values()
    print(json.dumps({"started": started, "restarted": restarted}))
