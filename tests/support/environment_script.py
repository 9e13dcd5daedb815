"""A user's script that imports the project at its top, then starts a local cluster: its workers
import this script again (as `__mp_main__`) before their nanny's environment is applied.

    python tests/support/environment_script.py

Prints one JSON line: what the worker saw at its start; whether the cluster's worker spec holds
a secret of the environment; and what each worker saw after the environment changed (a variable
changed, one added, a secret and a Prefect setting set before the cluster started removed) and
the worker was restarted, and a second one added (`cluster.scale`); each time, what Prefect's
settings say of that setting, and whether a process the worker starts inherits the nanny's list
of names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import distributed

from prefect_ddp.blocks.cluster import create_local_cluster
from prefect_ddp.blocks.nanny_environment import GIVEN_NAMES

NAMES = ("CHANGED_LATER", "REMOVED_SECRET", "ADDED_LATER", "OMP_NUM_THREADS")


def seen() -> dict[str, object]:
    """In a worker: the variables, what Prefect's settings read of one (imported with this script, before
    the nanny's environment applied), and whether a child of the worker gets the nanny's list of names."""
    from prefect.settings import get_current_settings

    child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({GIVEN_NAMES!r}))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    return {name: os.environ.get(name) for name in NAMES} | {
        "prefect_max_retries": get_current_settings().client.max_retries, "child_given_names": child}


if __name__ == "__main__":
    os.environ |= {"CHANGED_LATER": "before", "REMOVED_SECRET": "s3cr3t-value", "PREFECT_CLIENT_MAX_RETRIES": "7"}
    with create_local_cluster(n_workers=1) as cluster, distributed.Client(cluster) as client:
        (started,) = client.run(seen).values()
        spec_holds_secret = "s3cr3t-value" in repr(cluster.worker_spec)
        os.environ |= {"CHANGED_LATER": "after", "ADDED_LATER": "seen"}
        del os.environ["REMOVED_SECRET"], os.environ["PREFECT_CLIENT_MAX_RETRIES"]
        client.restart()
        cluster.scale(2)
        client.wait_for_workers(2)
        later = list(client.run(seen).values())
    print(json.dumps({"started": started, "spec_holds_secret": spec_holds_secret, "later": later}))
