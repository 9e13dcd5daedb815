"""The laptop path: serve the flows against a local Prefect server, then press Run in the UI.

    python -m prefect_ddp.deployments.serve

No work pool and no worker: `prefect.serve` polls for runs of its deployments and runs
each in a child process, on a 2-worker Dask cluster this process keeps warm between runs
(blocks/warm_cluster.py). This starts `prefect server start` on 127.0.0.1:4200 (another
free port if that one is taken) unless PREFECT_API_URL points at a running server, serves
the demo images from moto's S3 server as the `demo-images` block, and serves
`transfer-learning/laptop`, whose defaults train on them in about a minute, and
`hyperparameter-sweep/laptop-sweep`, four trials over lr and batch size on the same
images. Open the printed link, press Run (or Custom run to change the form). Ctrl-C
stops everything.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from prefect import serve
from prefect.client.orchestration import get_client
from prefect.deployments.runner import EntrypointType
from prefect.exceptions import ObjectNotFound

from prefect_ddp.blocks.cluster import DaskCluster
from prefect_ddp.blocks.warm_cluster import warm_cluster
from prefect_ddp.deployments.demo import (
    demo_parameters,
    parse_demo_args,
    serve_demo_images,
    use_prefect_server,
)
from prefect_ddp.deployments.local_services import running
from prefect_ddp.flows.sweep import hyperparameter_sweep
from prefect_ddp.flows.transfer_learning import transfer_learning
from prefect_ddp.tasks.gang import free_port
from prefect_ddp.tasks.reporting import ran_sync

UI_PORT = 4200
DEPLOYMENT = "laptop"
LAPTOP_SPACE = {
    "training.lr": {"kind": "log_uniform", "low": 0.0003, "high": 0.003},
    "training.batch_size": {"kind": "choice", "values": [16, 32]},
}


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def main(argv: list[str] | None = None) -> None:
    args = parse_demo_args(__doc__, argv, epochs=4)
    logs = Path(tempfile.mkdtemp(prefix="prefect-ddp-serve-"))
    with ExitStack() as stack:
        api_url = use_prefect_server(stack, logs, port=UI_PORT if port_is_free(UI_PORT) else free_port())
        serve_demo_images(stack, logs, args.per_class)
        demo = demo_parameters(args.epochs, os.path.abspath(args.output))
        parameters = {name: config.model_dump(exclude_defaults=True) for name, config in demo.items()}
        # Served runs are this process's children: they use its warm cluster (blocks/warm_cluster.py).
        stack.enter_context(warm_cluster(DaskCluster(n_workers=demo["cluster"].n_workers)))
        # By module path, not file path: the flows are found wherever prefect_ddp is installed.
        deployment = ran_sync(transfer_learning.to_deployment(
            name=DEPLOYMENT, parameters=parameters, entrypoint_type=EntrypointType.MODULE_PATH,
            description="Trains on the demo images (block demo-images) in about a minute. "
            "Press Run, or Custom run to change the form.",
        ), "transfer_learning.to_deployment")
        sweep = ran_sync(hyperparameter_sweep.to_deployment(
            name=f"{DEPLOYMENT}-sweep", entrypoint_type=EntrypointType.MODULE_PATH, parameters=parameters | {"space": LAPTOP_SPACE, "settings": {
                "name": "laptop-sweep", "n_trials": 4, "concurrency": 2}},
            description="Four trials over lr and batch size on the demo images, two at a time.",
        ), "hyperparameter_sweep.to_deployment")
        ui = api_url.removesuffix("/api")
        print(f"Serving transfer-learning/{DEPLOYMENT} and hyperparameter-sweep/{DEPLOYMENT}-sweep. "
              f"Open {ui}/deployments and press Run; Ctrl-C stops. Server and S3 logs: {logs}", flush=True)
        serve(deployment, sweep)


@contextmanager
def serving(api_url: str, log: Path, *args: str, timeout_s: float = 180) -> Iterator[str]:
    """`python -m prefect_ddp.deployments.serve ARGS` in a child process against `api_url`; yields the
    served deployment's id once it is registered, and stops the process at the end."""
    env = dict(os.environ, PREFECT_API_URL=api_url, PYTHONUNBUFFERED="1")
    with running([sys.executable, "-m", "prefect_ddp.deployments.serve", *args], log, env) as process:
        yield wait_for_deployment(f"transfer-learning/{DEPLOYMENT}", process, log, timeout_s)


def wait_for_deployment(name: str, process: subprocess.Popen, log: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as api:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"prefect_ddp.deployments.serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                return str(api.read_deployment_by_name(name).id)
            except ObjectNotFound:
                time.sleep(1)
    raise TimeoutError(f"{name} was not served within {timeout_s:.0f}s; see {log}")


if __name__ == "__main__":
    main()
