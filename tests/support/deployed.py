"""The deployments of prefect.yaml, served the way docs/deployments.md says: pool, deploy, `prefect-ddp worker`.

Shared by the CLI test and the browser test, which both need a worker running the
`transfer-learning/on-demand` deployment against the session's Prefect server.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect_ddp.deployments.local_services import running

REPO = Path(__file__).resolve().parents[2]
POOL = "ddp-pool"
# Usually 2-3 s; in some whole-suite runs Prefect's worker never finished its graceful stop
# (docs/architecture.md, "Facts: Prefect"), and the session's end waited out the full grace.
GRACEFUL_STOP_S = 10


def cli_environment(prefect_home: Path) -> dict[str, str]:
    """The Prefect CLI's environment: the session's server, a scratch home, this repo as PWD."""
    return dict(os.environ, PREFECT_HOME=str(prefect_home), PWD=str(REPO),
                PREFECT_SERVER_ANALYTICS_ENABLED="false", NO_COLOR="1", COLUMNS="200")


def prefect_cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`prefect ARGS` from the repo's root with this interpreter; never raises on failure."""
    return subprocess.run([sys.executable, "-m", "prefect", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"{result.args} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@contextmanager
def deployed_with_worker(prefect_home: Path, log: Path) -> Iterator[dict[str, str]]:
    """Create the work pool, deploy prefect.yaml, start a worker; yield the CLI environment."""
    env = cli_environment(prefect_home)
    check(prefect_cli(env, "work-pool", "create", POOL, "--type", "process", "--overwrite"))
    check(prefect_cli(env, "--no-prompt", "deploy", "--all"))
    # `prefect-ddp worker`: `prefect worker start` beside a warm cluster (blocks/warm_cluster.py).
    with running([sys.executable, "-m", "prefect_ddp", "worker", "--pool", POOL], log, env, cwd=REPO,
                 ask_again_after_s=GRACEFUL_STOP_S):
        yield env
