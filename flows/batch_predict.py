"""The `batch-predict` flow: score an image folder with a kept model across the Dask workers.

    validate-source -> claim-output -> keep-model (copied once into RUN/model/)
        -> list-images (once, into RUN/keys.json) -> every worker checked (it sees a local
        RUN/, it has a GPU of its own) -> score-chunk x chunks (mapped over the workers,
        retried each on its own) -> summarize-predictions (summary.json, artifact; fails
        when too many images were unreadable)

Output, below OUTPUT/RUN-NAME-ID/: `predictions/chunk-NNNNNN.parquet` (key, predicted,
probability, top_k_classes, top_k_probabilities, true_class), `summary.json`, `keys.json`
and `model/`. A rerun of the same flow run (a Prefect retry) keeps its folder, its model
copy and its key list, and skips the chunks already written.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.flows.transfer_learning import cluster_lifetime, data_location, output_base, tracking_settings
from prefect_ddp.tasks.config import (
    ClusterConfig,
    DataConfig,
    OutputConfig,
    TrackingConfig,
)
from prefect_ddp.tasks.data.validation import DEFAULT_MAX_UNREADABLE, chunked, validate_source
from prefect_ddp.tasks.prediction.image_keys import list_images
from prefect_ddp.tasks.prediction.model_source import keep_model
from prefect_ddp.tasks.prediction.parameters import (
    BatchSize,
    ChunkSize,
    DataBlock,
    DataUrl,
    MaxUnreadableFraction,
    ModelSpec,
    OutputBlock,
    OutputShared,
    OutputUrl,
    TopK,
    TrackingBlock,
)
from prefect_ddp.tasks.prediction.scoring import ScoringJob, score_images
from prefect_ddp.tasks.prediction.summary import summarize_predictions
from prefect_ddp.tasks.prediction.workers import check_scoring_workers
from prefect_ddp.tasks.results.run_folder import claim_run_folder, run_folder_name
from prefect_ddp.tasks.urls import child_url

DESCRIPTION = (
    "Score an image folder (URL/IMAGE.jpg or URL/CLASS/IMAGE.jpg) with a kept model across the Dask "
    "workers: Parquet predictions, counts per class, confidence, and accuracy where there are class folders."
)


def images_and_output(data_url: str | None, data_block: str | None, output_url: str,
                      output_block: str | None) -> tuple[DataLocation, DataLocation]:
    """Where the images are and where runs go, by training's rules (flows/transfer_learning.py)."""
    if not data_url and not data_block:
        raise ValueError(
            "batch-predict needs data_url (s3://bucket/prefix or a local path) or data_block (a saved "
            "data-location block); neither was given. Set one of them."
        )
    source = data_location(DataConfig.model_construct(url=data_url, block=data_block))
    return source, output_base(OutputConfig(url=output_url, block=output_block), source)


@flow(name="batch-predict", description=DESCRIPTION)
def batch_predict(
    model: ModelSpec,
    data_url: DataUrl = None,
    data_block: DataBlock = None,
    output_url: OutputUrl = "./predictions",
    output_block: OutputBlock = None,
    cluster: ClusterConfig = ClusterConfig(),
    tracking_block: TrackingBlock = None,
    chunk_size: ChunkSize = 256,
    batch_size: BatchSize = 32,
    top_k: TopK = 3,
    max_unreadable_fraction: MaxUnreadableFraction = DEFAULT_MAX_UNREADABLE,
    output_shared: OutputShared = False,
) -> dict[str, Any]:
    """Score every image below a folder with a kept model, in chunks across the Dask workers.

    Args:
        model: OUTPUT/NAME/latest (the model kept under NAME), a run or version folder holding
            model.pt and model.json, or models:/NAME@ALIAS.
        data_url: The images: s3://bucket/prefix or a local path; class folders (URL/CLASS/IMAGE.jpg)
            are optional and give the accuracy. Overrides the data block's url.
        data_block: A saved data-location block: S3 endpoint, region, credentials (and a default url).
        output_url: Each run writes to URL/RUN-NAME-ID/ (s3://bucket/prefix or a local path).
        output_block: data-location block with the credentials of the output and the model; empty
            reuses the data block's for S3 urls.
        cluster: The Dask cluster that scores: a saved block, an address, or a new local one.
        tracking_block: The mlflow-tracking block of the registry that model=models:/NAME@ALIAS is read from.
        chunk_size: Images per score-chunk task, the unit a rerun skips when done.
        batch_size: Images per forward pass.
        top_k: Most probable classes kept per image.
        max_unreadable_fraction: Largest share of the images that may be unreadable; above it, or
            when none could be read, the run fails after its summary (training's rule and default).
        output_shared: output_url is a local path mounted on every worker's host, not checked.
    """
    source, base = images_and_output(data_url, data_block, output_url, output_block)
    tracking = tracking_settings(TrackingConfig(block=tracking_block))
    run_name = flow_run.get_name() or "run"
    run = {"name": run_name, "flow_run_id": flow_run.get_id()}
    out = base.with_url(child_url(base.url, run_folder_name(run_name, run["flow_run_id"]))).plain()
    validate_source(source)  # a wrong URL or key is told in a second, before any cluster starts
    with cluster_lifetime(cluster) as starting:  # the cluster starts while the model is copied and the images listed
        claim_run_folder(out, run)
        model_store = output_base(OutputConfig(url=model, block=output_block), source).plain()
        model_copy = keep_model(model, model_store, out, tracking)
        keys = list_images(source.plain(), out)
        job = ScoringJob(source=source.plain(), model=model_copy, output=out, batch_size=batch_size, top_k=top_k)
        chunks = chunked(keys, chunk_size)
        runner = starting.ready()
        check_scoring_workers(runner.client, out.url, output_shared)
        score_images(runner, job, chunks)
        starting.close_in_background()  # the cluster closes while the flow summarizes
        return summarize_predictions(job, len(chunks), max_unreadable_fraction)
