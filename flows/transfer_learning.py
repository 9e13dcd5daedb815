"""The `transfer-learning` flow: S3 image folder -> DDP on a Dask cluster -> model and report.

    validate-source -> index -> decode-check (mapped over the workers) -> split
        -> [write-shards, with training.images_per_shard] -> ddp-rank x world size (the gang)
        -> aggregate (fails the run when the ranks stopped for too many unreadable images)

    -> promote (runs of a deployment keep their best model) -> report

With `tracking.block`, the run is also an MLflow run (params, each epoch's metrics from
rank 0, the files and the model), and promotion moves the registry's `champion` alias.

Run it from Python, from a deployment (`prefect deployment run transfer-learning/NAME`)
or from the UI's Run form; the parameters are typed models, so the form shows their
bounds and help, and the server refuses a bad value before any cluster starts. The flat
shortcuts (`data_url`, `epochs`, `lr`, ...) change one nested field from the CLI
(`--param epochs=2`) where `--param training=...` would replace the whole object.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import timedelta
from typing import Any

from prefect import flow
from prefect.runtime import deployment, flow_run
from prefect.states import Completed, State
from prefect_dask import DaskTaskRunner

from prefect_ddp.blocks.cluster import DaskCluster
from prefect_ddp.blocks.cluster_lifetime import ClusterLifetime
from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.blocks.saved import load_block
from prefect_ddp.blocks.tracking import MlflowTracking
from prefect_ddp.tasks.config import (
    BackboneChoice,
    BatchSize,
    ClusterConfig,
    DataBlock,
    DataConfig,
    DataUrl,
    Epochs,
    LearningRate,
    ModelConfig,
    OutputConfig,
    TrackingConfig,
    TrainingConfig,
    with_overrides,
)
from prefect_ddp.tasks.data.check_memory import CheckMemory
from prefect_ddp.tasks.data.indexing import index_images
from prefect_ddp.tasks.data.shard_writer import write_train_shards
from prefect_ddp.tasks.data.splitting import split_dataset
from prefect_ddp.tasks.data.validation import validate_dataset, validate_source
from prefect_ddp.tasks.gang import GangResults, cluster_workers, current_trial, run_gang
from prefect_ddp.tasks.results.aggregation import aggregate
from prefect_ddp.tasks.results.comparison import UnusableChampion, champion_to_beat
from prefect_ddp.tasks.results.promotion import (
    Promotion,
    find_warm_start,
    kept_location,
    promote,
    read_pointer,
    warm_start_from,
)
from prefect_ddp.tasks.results.records import TrainingSummary
from prefect_ddp.tasks.results.registry import Registration
from prefect_ddp.tasks.results.report import publish_report
from prefect_ddp.tasks.results.run_folder import claim_run_folder, run_folder_name
from prefect_ddp.tasks.results.tracking_run import (
    ModelReference,
    complete_run,
    fetch_registered_model,
    flat_params,
    log_model,
    tracking_run,
)
from prefect_ddp.tasks.tracking import TrackedRun, Tracking, import_mlflow
from prefect_ddp.tasks.training.backbone_checks import require_backbone_takes
from prefect_ddp.tasks.training.model import WarmStart, check_starting_weights, model_problem
from prefect_ddp.tasks.training.rank_result import RankResult
from prefect_ddp.tasks.training.job import TrainJob
from prefect_ddp.tasks.training.recipe import train_classifier
from prefect_ddp.tasks.training.unreadable import UnreadableLimit
from prefect_ddp.tasks.urls import absolute_url, child_url


class RunResult(TrainingSummary):
    """What the flow returns: the training summary (metrics.json), what promotion made of the
    model (None when nothing is kept for the run, in a sweep's trials, and for a pruned run),
    and the model logged to MLflow (None without tracking; a pruned run's result leaves it out)."""

    promotion: Promotion | None
    mlflow_model: ModelReference | None = None


def data_location(data: DataConfig) -> DataLocation:
    base = load_block(DataLocation, data.block) if data.block else DataLocation()
    location = base.with_url(data.url)
    if not location.url:
        raise ValueError(f"Block {data.block!r} has no url and none was given in data.url.")
    return location


def output_base(output: OutputConfig, source: DataLocation) -> DataLocation:
    """The output prefix with the right credentials; runs and kept models go below it."""
    if output.block:
        base = load_block(DataLocation, output.block).with_url(output.url)
    elif output.url.startswith("s3://") and source.url.startswith("s3://"):
        base = source.with_url(output.url)
    else:
        base = DataLocation(url=output.url)
    return base.with_url(absolute_url(base.url))


def kept_model_name(output: OutputConfig, model: ModelConfig) -> str | None:
    """Under which name the best model of this run's kind is kept: output.model_name, else the
    deployment's (sweep trials inherit their sweep's; they warm-start from it but never promote)."""
    name = output.model_name or deployment.get_name()
    if model.warm_start is True and not name:
        raise ValueError(
            "model.warm_start=true starts from the model kept for a deployment, but this run "
            "is outside a deployment and sets no output.model_name. Set output.model_name, "
            "run it from a deployment, or set model.warm_start=false."
        )
    return name


def tracking_settings(tracking: TrackingConfig) -> Tracking | None:
    """The MLflow server to record the run in, from its block; None when tracking is off."""
    if not tracking.block:
        return None
    import_mlflow()  # not installed: say so before any work, rather than warn after training
    settings = load_block(MlflowTracking, tracking.block).plain()
    return settings.model_copy(update={"experiment": tracking.experiment}) if tracking.experiment else settings


def require_registry(model: ModelConfig, tracking: Tracking | None) -> None:
    """A warm start from a registered model needs the server that holds the registry."""
    if model.warm_start_uri() and tracking is None:
        raise ValueError(
            f"model.warm_start={model.warm_start!r} names a registered model, but tracking.block is empty, "
            "so there is no MLflow server to read it from. Set tracking.block to the mlflow-tracking block "
            "of the server that holds the registry."
        )


def prefect_tags(run: dict[str, Any]) -> dict[str, str]:
    """Tags on the MLflow run that lead back to the Prefect flow run and its deployment."""
    tags = {"prefect.flow_run_id": str(run["flow_run_id"]), "prefect.flow_run_name": run["name"],
            "prefect.flow_run_url": flow_run.get_flow_run_ui_url() or ""}
    return tags | ({"prefect.deployment": run["deployment"]} if run["deployment"] else {})


def warm_start(model: ModelConfig, kept: DataLocation | None, tracking: Tracking | None, classes: list[str],
               out: DataLocation) -> WarmStart | None:
    """Where the run starts from: a registered model (copied into the run folder, where every rank
    reads it), the model kept under the run's name, or neither."""
    if uri := model.warm_start_uri():
        assert tracking is not None, "require_registry refuses a registered model without tracking"
        folder = fetch_registered_model(tracking, uri, out.with_url(child_url(out.url, "warm-start")))
        if problem := model_problem(folder):  # named by the user: refused, not left for every rank to fail on
            raise ValueError(f"model.warm_start={model.warm_start!r}: the registered model cannot be used: {problem}. "
                             "Name a version or alias whose model loads, or set model.warm_start to false.")
        return warm_start_from(folder, model.backbone, classes, f"registered model `{uri}`")
    if not model.warm_start:
        return None
    assert kept is not None, "kept_model_name refuses warm_start=true without a name to keep under"
    return find_warm_start(kept, model.backbone, classes)


def cluster_lifetime(cluster: ClusterConfig) -> ClusterLifetime:
    """The run's cluster, to start beside the flow's other work, or the warm one of the process that
    started the run (blocks/cluster_lifetime.py)."""
    if cluster.block:
        spec = load_block(DaskCluster, cluster.block)
    else:
        spec = DaskCluster(address=cluster.address, n_workers=cluster.n_workers)
    return ClusterLifetime.of(spec)


def gang_size(runner: DaskTaskRunner, world_size: int | None, min_world_size: int | None = None) -> int:
    """The most ranks the gang will have; checked before any image is decoded. An elastic gang
    (min_world_size) needs that many workers now, and may grow to world_size later."""
    workers = cluster_workers(runner.client)
    needed, name = (min_world_size, "min_world_size") if min_world_size else (world_size, "world_size")
    if needed and needed > len(workers):
        raise ValueError(
            f"cluster.{name}={needed} needs {needed} Dask workers (one rank each), but "
            f"the cluster has {len(workers)}. Lower cluster.{name}, leave it empty to use every "
            "worker, or add workers (cluster.n_workers for a local cluster)."
        )
    return world_size or len(workers)


def require_a_batch_per_rank(split, world_size: int) -> None:
    """A rank with one training image would take no step (a batch of one is dropped for BatchNorm)."""
    if len(split.train) < 2 * world_size:
        raise ValueError(
            f"Only {len(split.train)} training images for {world_size} ranks: each rank needs at "
            "least 2. Add images, lower data.val_fraction, or lower cluster.world_size."
        )


DESCRIPTION = (
    "Fine-tune a torchvision backbone on an S3 image folder (URL/CLASS/IMAGE.jpg) with PyTorch "
    "DDP, one rank per Dask worker; keep each deployment's best model."
)


@flow(name="transfer-learning", description=DESCRIPTION)
def transfer_learning(
    data: DataConfig | None = None,
    model: ModelConfig = ModelConfig(),
    training: TrainingConfig = TrainingConfig(),
    cluster: ClusterConfig = ClusterConfig(),
    output: OutputConfig = OutputConfig(),
    tracking: TrackingConfig = TrackingConfig(),
    data_url: DataUrl = None,
    data_block: DataBlock = None,
    backbone: BackboneChoice = None,
    epochs: Epochs = None,
    lr: LearningRate = None,
    batch_size: BatchSize = None,
) -> dict[str, Any] | State:
    """Fine-tune a torchvision backbone on an image folder with DDP across Dask workers.

    Args:
        data: Where the images are (url or block), how they are checked and split.
        model: The backbone, its starting weights, and warm start from the kept model.
        training: The recipe: epochs, batch size, optimizer, lr, schedule, mixed precision.
        cluster: The Dask cluster that runs the ranks, and how the gang is supervised.
        output: Where models and reports are written, and the name the best model is kept under.
        tracking: Record the run in MLflow and keep the registry's champion in step (an mlflow-tracking block).
        data_url: Shortcut: sets data.url and keeps the rest of data.
        data_block: Shortcut: sets data.block and keeps the rest of data.
        backbone: Shortcut: sets model.backbone and keeps the rest of model.
        epochs: Shortcut: sets training.epochs and keeps the rest of training.
        lr: Shortcut: sets training.lr (per rank) and keeps the rest of training.
        batch_size: Shortcut: sets training.batch_size (per rank) and keeps the rest of training.
    """
    data = with_overrides(data or DataConfig.model_construct(), url=data_url, block=data_block)
    model = with_overrides(model, backbone=backbone)
    training = with_overrides(training, epochs=epochs, lr=lr, batch_size=batch_size)
    kept_name = kept_model_name(output, model)
    tracker = tracking_settings(tracking)
    require_registry(model, tracker)
    require_backbone_takes(model.backbone, training)  # e.g. an image side it cannot take fails here, not in every rank
    source = data_location(data)
    base = output_base(output, source)
    run_name = flow_run.get_name() or "run"
    run = {"name": run_name, "flow_run_id": flow_run.get_id(), "deployment": deployment.get_name()}
    out = base.with_url(child_url(base.url, run_folder_name(run_name, run["flow_run_id"])))
    kept = kept_location(base, kept_name) if kept_name else None
    validate_source(source)  # a wrong URL or key is told in a second, before any cluster starts
    config = {"data": data, "model": model, "training": training, "cluster": cluster, "output": output}
    with cluster_lifetime(cluster) as starting, tracking_run(  # the cluster starts while the flow lists
            tracker, run_name, flat_params({k: v.model_dump() for k, v in config.items()}),
            prefect_tags(run)) as tracked:
        claim_run_folder(out, run)
        manifest = index_images.with_options(
            cache_expiration=timedelta(minutes=data.index_cache_minutes),
            refresh_cache=data.index_cache_minutes == 0,
        )(source)
        warm = warm_start(model, kept, tracker, manifest.classes, out)
        if not warm:
            check_starting_weights(model, len(manifest.classes), source, training.image_size)
        runner = starting.ready()
        world_size = gang_size(runner, cluster.world_size, cluster.min_world_size)
        listed = len(manifest)
        manifest = validate_dataset(runner, source, manifest, data.validate_sample, data.max_unreadable_fraction,
                                    CheckMemory(base, source))
        unreadable = UnreadableLimit(excluded=listed - len(manifest), limit=data.max_unreadable_fraction)
        split = split_dataset(manifest, data.val_fraction, data.seed)
        require_a_batch_per_rank(split, world_size)
        if training.images_per_shard:
            write_train_shards(runner, manifest, split, source, base, training)
        kept_at_start = read_pointer(kept) if kept else None
        found = champion_to_beat(kept, kept_at_start, manifest, split) if kept else None
        unusable = found if isinstance(found, UnusableChampion) else None
        results = run_gang(
            train_classifier,
            training_job(source, out, manifest, split, model, training, warm, unreadable).model_copy(
                update={"tracked": tracked, "champion": None if unusable else found}),
            **cluster.gang_options(),
            task_runner=runner,
            output_url=out.url,
            shared_output=output.shared,
            # Loader processes: 0 starts none; a count or empty (sized per rank) may.
            needs_child_processes=training.num_workers != 0,
            # A rank waiting for a batch is silent up to the fetch timeout before it fails on its own.
            hang_floor=timedelta(seconds=training.fetch_timeout_s),
            trial=current_trial(),
        )
        starting.close_in_background()  # the run's cluster closes while it reports
        return finish_run(results, manifest, split, out, (kept_name, kept) if kept_name and kept else None, run,
                          warm, tracked, output.min_improvement, kept_at_start["version"] if kept_at_start else None,
                          unusable)


def finish_run(results: GangResults[RankResult], manifest, split, out: DataLocation,
               kept: tuple[str, DataLocation] | None, run: dict[str, Any], warm: WarmStart | None,
               tracked: TrackedRun | None, min_improvement: float | None = None, kept_at_start: str | None = None,
               unusable: UnusableChampion | None = None) -> dict[str, Any] | State:
    """Aggregate the ranks' results, promote the model where it is better, publish the report;
    with tracking, log the model before promotion (which registers it) and the files after the report."""
    summary = aggregate(results, manifest, split, out, [asdict(a) for a in results.attempts])
    in_sweep = current_trial() is not None
    if summary.pruned_at:  # a sweep stopped it early: a partial model is kept by no one
        publish_report(summary, manifest, out, None, warm, in_sweep)
        if tracked:
            complete_run(tracked, out, {"pruned": str(summary.pruned_at)})
        return Completed(name="Pruned", message=f"pruned at epoch {summary.pruned_at}",
                         data=summary.model_dump() | {"promotion": None})
    logged = log_model(tracked, out) if tracked else None
    # A sweep's trials never promote on their own: the sweep may promote its best one at its end.
    promotion = None
    if kept and not in_sweep:
        name, folder = kept
        registry = Registration(tracking=tracked.tracking, name=name, model=logged) if tracked else None
        promotion = promote(summary, out, folder, run, registry, min_improvement, kept_at_start, unusable)
    publish_report(summary, manifest, out, promotion, warm, in_sweep)
    if tracked:
        complete_run(tracked, out, promotion_tags(promotion))
    # A sweep registers its best trial's logged model when it promotes it (flows/sweep.py).
    return RunResult(**dict(summary), promotion=promotion,
                     mlflow_model=logged.reference() if logged else None).model_dump()


def promotion_tags(promotion: Promotion | None) -> dict[str, str]:
    """What promotion made of the run, as tags on its MLflow run."""
    if promotion is None:
        return {"promoted": "false"}
    tags = {"promoted": str(promotion.promoted).lower()}
    if promotion.registered:
        tags["registered_version"] = promotion.registered["version"]
    return tags


def training_job(source: DataLocation, out: DataLocation, manifest, split, model: ModelConfig,
                 training: TrainingConfig, warm: WarmStart | None, unreadable: UnreadableLimit) -> TrainJob:
    """What every rank gets; a warm start replaces model.weights, so those are not fetched."""
    if warm:
        model = model.model_copy(update={"weights": None})
    return TrainJob(source=source, output=out, manifest=manifest, split=split, model=model,
                    training=training, warm_start=warm, unreadable=unreadable)
