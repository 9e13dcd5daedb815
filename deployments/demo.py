"""The demo: the whole transfer-learning flow on this machine, through the real S3 path.

    python -m prefect_ddp.deployments.demo

It generates a small image folder of real JPEGs, serves it from moto's S3 server on
127.0.0.1, and runs `transfer-learning` against a local Prefect server (SQLite in
PREFECT_HOME, or the server PREFECT_API_URL points at) on a LocalCluster of 2 worker
processes: world size 2, gloo. It prints the validation accuracy and where the model and
report are. Afterwards `prefect server start` shows the run, its tasks and artifacts.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from contextlib import ExitStack
from pathlib import Path

import s3fs
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.deployments.local_services import (
    MOTO_CREDENTIALS,
    MOTO_REGION,
    create_bucket,
    moto_s3_server,
    prefect_server,
)
from prefect_ddp.deployments.sample_data import shapes_dataset
from prefect_ddp.flows.transfer_learning import transfer_learning
from prefect_ddp.tasks.config import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    OutputConfig,
    TrainingConfig,
)

BUCKET = "demo"
BLOCK = "demo-images"


def upload_demo_images(endpoint: str, per_class: int) -> str:
    create_bucket(endpoint, BUCKET)
    fs = s3fs.S3FileSystem(
        endpoint_url=endpoint, key=MOTO_CREDENTIALS["aws_access_key_id"],
        secret=MOTO_CREDENTIALS["aws_secret_access_key"], client_kwargs={"region_name": MOTO_REGION},
    )
    fs.pipe({f"{BUCKET}/images/{key}": data for key, data in shapes_dataset(per_class).items()})
    return f"s3://{BUCKET}/images"


def serve_demo_images(stack: ExitStack, logs: Path, per_class: int) -> str:
    """Start moto's S3 server with the demo images and save the block that points at them.

    The server stops when `stack` closes; returns the block's name.
    """
    endpoint = stack.enter_context(moto_s3_server(logs))
    url = upload_demo_images(endpoint, per_class)
    DataLocation(
        url=url, endpoint_url=endpoint, region_name=MOTO_REGION, **MOTO_CREDENTIALS
    ).save(BLOCK, overwrite=True)
    return BLOCK


def demo_parameters(epochs: int, output: str, model_name: str | None = None) -> dict:
    """The flow's parameters for the demo images: a run of about a minute on 2 CPU cores."""
    return {
        "data": DataConfig(block=BLOCK, index_cache_minutes=0),
        "model": ModelConfig(backbone="resnet18"),
        "training": TrainingConfig(
            epochs=epochs, batch_size=16, image_size=64, optimizer="adamw", lr=1e-3,
            weight_decay=1e-4, num_workers=0,
        ),
        "cluster": ClusterConfig(n_workers=2),
        "output": OutputConfig(url=output, model_name=model_name),
    }


def parse_demo_args(doc: str, argv: list[str] | None, epochs: int) -> argparse.Namespace:
    """The options of the commands that train on the demo images."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--per-class", type=int, default=120, help="images per class")
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--output", default="demo-output", help="local folder or s3:// url")
    return parser.parse_args(argv)


def use_prefect_server(stack: ExitStack, logs: Path, port: int | None = None) -> str:
    """The server PREFECT_API_URL names, else a `prefect server start` that `stack` stops;
    this process talks to it from here on. Returns its API URL."""
    api_url = os.environ.get("PREFECT_API_URL") or stack.enter_context(prefect_server(logs, port=port))
    stack.enter_context(temporary_settings({PREFECT_API_URL: api_url}))
    return api_url


def main(argv: list[str] | None = None) -> dict:
    args = parse_demo_args(__doc__, argv, epochs=6)
    logs = Path(tempfile.mkdtemp(prefix="prefect-ddp-demo-"))
    with ExitStack() as stack:
        use_prefect_server(stack, logs)
        serve_demo_images(stack, logs, args.per_class)
        summary = transfer_learning(**demo_parameters(args.epochs, args.output, model_name="demo"))
        # Ship the last log lines before the server they go to stops.
        APILogWorker.drain_all(timeout=5)
    print(f"\nValidation accuracy: {summary['best_val_acc']:.3f} (epoch {summary['best_epoch']}, whose "
          f"weights the model holds; the last epoch's: {summary['final_val_acc']:.3f}; chance is {1 / 3:.3f})")
    print(f"Model:  {summary['files']['model.pt']}")
    print(f"Report: {summary['files']['report.md']}")
    promotion = summary["promotion"]
    print(f"Kept model: {'promoted' if promotion['promoted'] else 'not promoted'}; {promotion['pointer_url']} "
          f"points to {promotion['kept_url']} ({promotion['reason']})")
    print(f"To browse the run: prefect server start, then open http://127.0.0.1:4200/runs "
          f"(server logs: {logs})")
    return summary


if __name__ == "__main__":
    main()
