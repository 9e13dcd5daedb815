"""The laptop path: serve the flows against a local Prefect server, then press Run in the UI.

    python -m deployments.serve

No work pool and no worker: `prefect.serve` polls for runs of its deployments and runs
each in a child process. This starts `prefect server start` on 127.0.0.1:4200 (another
free port if that one is taken) unless PREFECT_API_URL points at a running server, serves
the demo images from moto's S3 server as the `demo-images` block, and serves
`transfer-learning/laptop`, whose defaults train on them in about a minute. Open the
printed link, press Run (or Custom run to change the form). Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from contextlib import ExitStack
from pathlib import Path

from prefect import serve
from prefect.settings import PREFECT_API_URL, temporary_settings

from deployments.demo import demo_parameters, serve_demo_images
from deployments.local_services import prefect_server
from flows.transfer_learning import transfer_learning
from tasks.gang import free_port

UI_PORT = 4200
DEPLOYMENT = "laptop"


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-class", type=int, default=120, help="demo images per class")
    parser.add_argument("--epochs", type=int, default=4, help="the Run form's default epochs")
    parser.add_argument("--output", default="demo-output", help="local folder or s3:// url")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="prefect-ddp-serve-"))
    with ExitStack() as stack:
        api_url = os.environ.get("PREFECT_API_URL") or stack.enter_context(
            prefect_server(logs, port=UI_PORT if port_is_free(UI_PORT) else free_port())
        )
        stack.enter_context(temporary_settings({PREFECT_API_URL: api_url}))
        serve_demo_images(stack, logs, args.per_class)
        parameters = {name: config.model_dump(exclude_defaults=True)
                      for name, config in demo_parameters(args.epochs, os.path.abspath(args.output)).items()}
        deployment = transfer_learning.to_deployment(
            name=DEPLOYMENT, parameters=parameters,
            description="Trains on the demo images (block demo-images) in about a minute. "
            "Press Run, or Custom run to change the form.",
        )
        ui = api_url.removesuffix("/api")
        print(f"Serving transfer-learning/{DEPLOYMENT}. Open {ui}/deployments and press Run; "
              f"Ctrl-C stops. Server and S3 logs: {logs}", flush=True)
        serve(deployment)


if __name__ == "__main__":
    main()
