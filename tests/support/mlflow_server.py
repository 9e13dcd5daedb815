"""A real `mlflow server` on loopback for the tracking tests: SQLite backend, local artifacts."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect_ddp.deployments.local_services import child_process
from prefect_ddp.tasks.gang import free_port


@contextmanager
def mlflow_server(folder: Path, port: int | None = None) -> Iterator[str]:
    """`mlflow server` with its database and artifacts in `folder`; yields its tracking URI.

    Artifacts are served by the server (`--artifacts-destination`), so clients, rank 0 on a
    Dask worker included, need only its URI. It takes about 12 s to start (its migrations).
    `port` defaults to a free one; give the port it had to start it again after an outage
    (bench/soak_flows.py), so clients find it where they found it before.
    """
    port = port or free_port()
    uri = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination", str(folder / "artifacts")]
    # Without its job runner: seven huey consumer processes, each importing MLflow (about 100 s
    # of CPU over a test session here), for GenAI jobs that tracking and the registry never use.
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    with child_process(args, f"{uri}/health", folder / "mlflow-server.log", timeout_s=120, env=env):
        yield uri
