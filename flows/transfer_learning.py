"""The `transfer-learning` flow: S3 image folder -> DDP on a Dask cluster -> model and report.

    validate-source -> index -> decode-check (mapped over the workers) -> split
        -> ddp-rank x world size (the gang) -> aggregate

Run it from Python, from a deployment (`prefect deployment run transfer-learning/<name>`)
or from the UI's Run form; the parameters are typed models, so the form shows their
bounds and help.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from prefect import flow
from prefect.runtime import flow_run
from prefect_dask import DaskTaskRunner

from blocks.cluster import DaskCluster
from blocks.data_location import DataLocation
from tasks.aggregation import aggregate
from tasks.config import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    OutputConfig,
    TrainingConfig,
)
from tasks.gang import run_gang
from tasks.indexing import index_images
from tasks.splitting import split_dataset
from tasks.storage import child_url, safe_segment
from tasks.training import TrainJob, train_classifier
from tasks.validation import validate_dataset, validate_source


def load_block(block_class: type, name: str):
    try:
        return block_class.load(name)
    except ValueError as exc:
        raise ValueError(
            f"No {block_class.get_block_type_slug()} block named {name!r} on this Prefect "
            f"server ({exc}). Create it with {block_class.__name__}(...).save({name!r}) or in "
            "the UI under Blocks."
        ) from exc


def data_location(data: DataConfig) -> DataLocation:
    base = load_block(DataLocation, data.block) if data.block else DataLocation()
    location = base.with_url(data.url)
    if not location.url:
        raise ValueError(f"Block {data.block!r} has no url and none was given in data.url.")
    return location


def output_location(output: OutputConfig, source: DataLocation, run_name: str) -> DataLocation:
    """This run's output folder: <output url>/<run name>, with the right credentials."""
    if output.block:
        base = load_block(DataLocation, output.block).with_url(output.url)
    elif output.url.startswith("s3://") and source.url.startswith("s3://"):
        base = source.with_url(output.url)
    else:
        base = DataLocation(url=output.url)
    if "://" not in base.url:
        # Ranks run in other processes; make a relative folder mean the flow's folder.
        base = base.with_url(os.path.abspath(base.url))
    return base.with_url(child_url(base.url, safe_segment(run_name)))


@contextmanager
def cluster_runner(cluster: ClusterConfig) -> Iterator[DaskTaskRunner]:
    if cluster.block:
        spec = load_block(DaskCluster, cluster.block)
    else:
        spec = DaskCluster(address=cluster.address, n_workers=cluster.n_workers)
    with spec.task_runner() as runner:
        yield runner


@flow(name="transfer-learning")
def transfer_learning(
    data: DataConfig,
    model: ModelConfig = ModelConfig(),
    training: TrainingConfig = TrainingConfig(),
    cluster: ClusterConfig = ClusterConfig(),
    output: OutputConfig = OutputConfig(),
) -> dict[str, Any]:
    """Fine-tune a torchvision backbone on an image folder with DDP across Dask workers."""
    source = data_location(data)
    out = output_location(output, source, flow_run.get_name() or "run")
    validate_source(source)
    manifest = index_images.with_options(
        cache_expiration=timedelta(minutes=data.index_cache_minutes),
        refresh_cache=data.index_cache_minutes == 0,
    )(source)
    with cluster_runner(cluster) as runner:
        manifest = validate_dataset(runner, source, manifest, data.validate_sample)
        split = split_dataset(manifest, data.val_fraction, data.seed)
        job = TrainJob(source=source, output=out, manifest=manifest, split=split, model=model, training=training)
        results = run_gang(
            train_classifier, job,
            task_runner=runner,
            world_size=cluster.world_size,
            output_url=out.url,
            init_timeout=timedelta(seconds=cluster.init_timeout_s),
            timeout=timedelta(seconds=cluster.gang_timeout_s) if cluster.gang_timeout_s else None,
            max_restarts=cluster.max_restarts,
        )
    return aggregate(results, manifest, split, out)
