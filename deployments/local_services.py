"""Real services on loopback for the demo and the tests: moto's S3 server, a Prefect server.

Both run as child processes, so the flow's process (which also hosts the Dask scheduler)
does not share its GIL with them, and both are stopped when their `with` block ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect_ddp.tasks.gang import free_port

MOTO_CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
MOTO_REGION = "us-east-1"
# The server's telemetry logs an error on every heartbeat where there is no internet.
SERVER_ENVIRONMENT = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def wait_until_up(url: str, process: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            # The program and its first arguments where it was started from a list (as `running` does).
            command = process.args[:3] if isinstance(process.args, list) else process.args
            raise RuntimeError(f"{command!r} exited with {process.returncode}; see {log}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f}s; see {log}")


@contextmanager
def running(args: list[str], log: Path, env: dict | None = None, cwd: Path | None = None,
            ask_again_after_s: float | None = None) -> Iterator[subprocess.Popen]:
    """`args` as a child process writing to `log`, stopped when the block ends (`stop`)."""
    with open(log, "wb") as sink:
        process = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        yield process
    finally:
        stop(process, ask_again_after_s)


def stop(process: subprocess.Popen, ask_again_after_s: float | None = None, grace_s: float = 30) -> None:
    """SIGTERM; a second one after `ask_again_after_s`, for a program that stops at once when
    asked twice (`prefect-ddp worker`, deployments/worker.py); SIGKILL after `grace_s` more.

    The second request is sent once, never again while the program winds down (a warm
    cluster closing), which a third would cut short.
    """
    process.terminate()
    if ask_again_after_s is not None:
        try:
            process.wait(timeout=ask_again_after_s)
            return
        except subprocess.TimeoutExpired:
            process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()


@contextmanager
def child_process(args: list[str], health_url: str, log: Path, timeout_s: float, env: dict | None = None) -> Iterator[None]:
    """A server as a child process, once its `health_url` answers."""
    with running(args, log, env) as process:
        wait_until_up(health_url, process, timeout_s, log)
        yield


@contextmanager
def moto_s3_server(log_dir: Path) -> Iterator[str]:
    """moto's standalone S3 server on 127.0.0.1; yields its endpoint URL."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with child_process(args, f"{endpoint}/moto-api/", log_dir / "moto.log", timeout_s=60):
        yield endpoint


@contextmanager
def prefect_server(log_dir: Path, database: Path | None = None, port: int | None = None,
                   settings: dict[str, str] | None = None) -> Iterator[str]:
    """`prefect server start` on 127.0.0.1 (SQLite); yields its API URL.

    `database` defaults to the one in PREFECT_HOME, so a later `prefect server start`
    shows the same runs in the UI. `port` defaults to a free one. `settings` are extra
    PREFECT_* environment variables for the server.
    """
    port = port or free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    # The UI calls 127.0.0.1:4200/api unless told its own server's address
    # (docs/architecture.md, "Facts: Prefect").
    env = dict(os.environ, **SERVER_ENVIRONMENT, PREFECT_UI_API_URL=api_url, **(settings or {}))
    env.pop("PREFECT_API_URL", None)
    if database:
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{database}"
    args = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with child_process(args, f"{api_url}/health", log_dir / "prefect-server.log", timeout_s=120, env=env):
        yield api_url


def create_bucket(endpoint: str, bucket: str) -> None:
    """Create a bucket (s3fs's mkdir fails against moto on the location constraint)."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=MOTO_REGION, **MOTO_CREDENTIALS)
    s3.create_bucket(Bucket=bucket)
