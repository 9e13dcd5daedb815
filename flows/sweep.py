"""The `hyperparameter-sweep` flow: many transfer-learning trials at once on one Dask cluster.

    study (Optuna, SQLite) -> trial-0, trial-1, ... (each a `transfer-learning` child flow
    run on its own leased workers, `concurrency` at a time) -> sweep-comparison artifact

Started from the UI's Run form (deployment `hyperparameter-sweep/ui-sweep`): the search
space maps dotted parameter paths (training.lr, training.batch_size, model.backbone) to how
each is drawn. Running it again under the same `settings.name` continues the study.
"""

from __future__ import annotations

import itertools
from typing import Any

from prefect import flow
from prefect.runtime import deployment
from prefect.states import State
from pydantic import BaseModel, TypeAdapter, ValidationError

from prefect_ddp.blocks.cluster import shared_in_process
from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.flows.transfer_learning import (
    RunResult,
    cluster_lifetime,
    data_location,
    output_base,
    require_registry,
    tracking_settings,
    transfer_learning,
)
from prefect_ddp.tasks.config import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    OutputConfig,
    TrackingConfig,
    TrainingConfig,
    with_overrides,
)
from prefect_ddp.tasks.data.storage import read_json
from prefect_ddp.tasks.gang import TrialLink, training_trial
from prefect_ddp.tasks.results.comparison import unusable_champion
from prefect_ddp.tasks.results.promotion import POINTER, Promotion, kept_location, promote, read_pointer
from prefect_ddp.tasks.results.records import TrainingSummary
from prefect_ddp.tasks.results.registry import Registration
from prefect_ddp.tasks.results.tracking_run import (
    LoggedModel,
    child_runs_of,
    complete_run,
    flat_params,
    tracking_run,
)
from prefect_ddp.tasks.sweeps.search_space import Dimension, with_params
from prefect_ddp.tasks.sweeps.settings import SweepSettings, TrialOutcome
from prefect_ddp.tasks.sweeps.sweep import open_study, run_trials, study_storage, trial_run_name
from prefect_ddp.tasks.sweeps.sweep_report import publish_sweep_report
from prefect_ddp.tasks.tracking import Tracking
from prefect_ddp.tasks.training.backbone_checks import BACKBONE_CHECKS
from prefect_ddp.tasks.training.model import is_state_dict_uri, pretrained_weights
from prefect_ddp.tasks.urls import child_url, safe_segment

SWEEP_FILES = ("report.md", "curves.png", "sweep.json")  # what publish_sweep_report writes, logged to the parent run

DESCRIPTION = (
    "Train many transfer-learning models at once on one Dask cluster, drawn by Optuna from a "
    "search space; stop bad ones early; compare them in one report."
)


def trial_outcome(state: State) -> TrialOutcome:
    """What the sweep keeps of a trial's flow run (a pruned run ends Completed, named Pruned)."""
    if not state.is_completed():
        return TrialOutcome(state="failed", message=state.message)
    result = RunResult.model_validate(state.result())
    return TrialOutcome(state="completed", model_url=result.files["model.pt"],
                        mlflow_model=result.mlflow_model.model_dump() if result.mlflow_model else None,
                        flow_run_id=str(state.state_details.flow_run_id),
                        workers=[rank.worker_address for rank in result.ranks])


def transfer_learning_trial(parameters: dict[str, Any], link: TrialLink, run_name: str) -> TrialOutcome:
    """One trial: a `transfer-learning` child flow run that reports each epoch to the study."""
    with training_trial(link):
        state = transfer_learning.with_options(flow_run_name=run_name)(**parameters, return_state=True)
    return trial_outcome(state).model_copy(update={"run": run_name})


# The sections of transfer-learning's parameters a search space's paths reach into.
SECTIONS: dict[str, type[BaseModel]] = {"data": DataConfig, "model": ModelConfig, "training": TrainingConfig}


def field_value(path: str, value: Any) -> Any:
    """`value` as the parameter at `path` (`training.image_size`) takes it, its own bounds and type
    checked (`"224"` and `224.0` are 224): the checks between parameters are left to each trial,
    which knows the other values it drew."""
    section, _, field = path.partition(".")
    try:
        return TypeAdapter(SECTIONS[section].model_fields[field].rebuild_annotation()).validate_python(value)
    except ValidationError as error:
        raise ValueError(f"The search space offers {path}={value!r}, which transfer-learning refuses: "
                         f"{error.errors()[0]['msg'].removeprefix('Value error, ').rstrip('.')}. "
                         "Take it out of the space (its values, or its range's low and high).") from None


def check_space_values(space: dict[str, Dimension], model: ModelConfig, training: TrainingConfig) -> None:
    """Refuse, before any trial starts, a value its parameter refuses, and a backbone of the space with
    weights, or a training value (tasks/training/backbone_checks.py: an image side, a drop-path rate,
    layer-wise decay), of the space it cannot take: each would fail the trials that drew it. A range is
    checked at its ends (a drop-path rate for a backbone without drop-path fails every draw)."""
    drawn = {path: [field_value(path, value) for value in dimension.offered()] for path, dimension in space.items()}

    def offered(path: str, base: Any) -> list[Any]:
        """The values of `path` a trial may draw (a range's ends), as its parameter takes them: the base
        configuration's when the space leaves it out."""
        return drawn[path] if path in space else [base]

    backbones = offered("model.backbone", model.backbone)
    for backbone, weights in itertools.product(backbones, offered("model.weights", model.weights)):
        if not is_state_dict_uri(weights):  # a state_dict's fit is checked by loading it, in each trial
            pretrained_weights(backbone, weights)
    for field, check in BACKBONE_CHECKS.items():
        for backbone, value in itertools.product(backbones, offered(f"training.{field}", getattr(training, field))):
            check(backbone, value)


def check_space(space: dict[str, Dimension]) -> None:
    """Refuse a path that names no parameter, before any trial starts."""
    for path in space:
        section, _, field = path.partition(".")
        model = SECTIONS.get(section)
        if model is None or field not in model.model_fields:
            allowed = [f"{name}.{f}" for name, m in (("model", ModelConfig), ("training", TrainingConfig)) for f in m.model_fields]
            raise ValueError(f"The search space names {path!r}, which is no parameter of transfer-learning; "
                             f"use dotted paths such as {', '.join(allowed[:6])}, ...")


# What transfer-learning reports after every epoch that a sweep may optimise.
REPORTED_METRICS = ("val_acc", "val_loss", "train_acc", "train_loss")


def check_trial_sizes(cluster: ClusterConfig) -> None:
    """Refuse a gang size set where a sweep would not read it: each trial's comes from `settings`."""
    if cluster.min_world_size is not None:
        raise ValueError(
            f"cluster.min_world_size={cluster.min_world_size} sizes a training run's gang, but a sweep sizes each "
            "trial's gang from settings: set settings.min_ranks_per_trial (and settings.ranks_per_trial, the "
            "most) instead, and leave cluster.min_world_size empty."
        )


def check_metric(settings: SweepSettings) -> None:
    """Refuse a metric the trials never report, before any trial starts."""
    if settings.metric not in REPORTED_METRICS:
        raise ValueError(f"settings.metric={settings.metric!r} is not a metric transfer-learning reports each epoch; "
                         f"use one of {', '.join(REPORTED_METRICS)}.")


@flow(name="hyperparameter-sweep", description=DESCRIPTION)
def hyperparameter_sweep(
    space: dict[str, Dimension],
    settings: SweepSettings = SweepSettings(),
    data: DataConfig | None = None,
    model: ModelConfig = ModelConfig(),
    training: TrainingConfig = TrainingConfig(),
    cluster: ClusterConfig = ClusterConfig(),
    output: OutputConfig = OutputConfig(),
    tracking: TrackingConfig = TrackingConfig(),
) -> dict[str, Any]:
    """Sweep the transfer-learning recipe over `space`; trials share the sweep's cluster.

    Args:
        space: Per dotted path (training.lr, training.batch_size, model.backbone), how it is drawn.
        settings: Trials, concurrency, ranks per trial, metric, sampler, pruner, seed, name.
        data: Where the images are; every trial trains on the same data.
        model: The base model settings each trial starts from.
        training: The base recipe each trial starts from.
        cluster: The one Dask cluster every trial's gang runs on.
        output: Where trials write their runs, and the sweep its study and report.
        tracking: Record the sweep in MLflow as a parent run, each trial a child run (an mlflow-tracking block).
    """
    check_space(space)
    check_space_values(space, model, training)
    check_metric(settings)
    check_trial_sizes(cluster)
    data = with_overrides(data or DataConfig.model_construct())
    out = output_base(output, data_location(data))
    kept_name = promotion_name(settings, output) if settings.promote else None
    kept = kept_location(out, kept_name) if kept_name else None
    tracker = tracking_settings(tracking)
    require_registry(model, tracker)
    base = {"data": data.model_dump(), "model": model.model_dump(),
            "training": training.model_dump(), "output": output.model_dump(), "tracking": tracking.model_dump()}
    study = open_study(settings, space, study_storage(settings, out.url), max_epochs=training.epochs)
    params = flat_params({"settings": settings.model_dump(), "space": {p: d.model_dump() for p, d in space.items()}} | base)
    with cluster_lifetime(cluster) as starting, tracking_run(tracker, settings.name, params, {}) as parent:
        runner = starting.ready()
        # Trials connect by address; a TLS cluster's certificate stays in this process (blocks/cluster.py).
        with shared_in_process(runner.client) as address:
            # Each trial's gang: ranks_per_trial ranks, or a range down to min_ranks_per_trial; a gang
            # grows only onto workers that no gang holds (tasks/gang/grow_watch.py), never another trial's.
            shared = cluster.model_copy(update={
                "address": address, "block": None, "world_size": settings.ranks_per_trial,
                "min_world_size": settings.min_ranks_per_trial, "lease_timeout_s": settings.lease_timeout_s,
            })

            def train_trial(trial: Any, link: TrialLink) -> TrialOutcome:
                parameters = with_params(base, trial.params) | {"cluster": shared.model_dump()}
                with child_runs_of(parent):
                    return transfer_learning_trial(parameters, link, trial_run_name(trial.number, trial.params))

            trials = run_trials(study, space, settings, runner.client, train_trial)
        record = publish_sweep_report(study, settings, out)
        trials.require_one_trained(study)  # after the report: it shows their errors
        promotion = promote_best(record["best"], out, kept, tracker, kept_name, output.min_improvement) if kept else None
        if parent:
            complete_run(parent, out.with_url(child_url(out.url, safe_segment(settings.name))),
                         best_tags(record["best"]), SWEEP_FILES)
    return record | {"promotion": promotion.model_dump() if promotion else None}


def best_tags(best: dict[str, Any] | None) -> dict[str, str]:
    """The sweep's outcome on its MLflow run: which trial won, and with what."""
    return {"best_trial": str(best["trial"]), "best_value": str(best["value"]), "best_run": best["run"]} if best else {
        "best_trial": "none completed"}


def promotion_name(settings: SweepSettings, output: OutputConfig) -> str:
    """The name the best trial is promoted under: output.model_name, else the deployment's."""
    name = output.model_name or deployment.get_name()
    if not name:
        raise ValueError(
            f"settings.promote=true keeps the best trial's model under output.model_name or the deployment's "
            f"name, but this sweep ({settings.name!r}) runs outside a deployment and sets no output.model_name. "
            "Set output.model_name, run it from a deployment, or set settings.promote=false."
        )
    return name


def promote_best(best: dict[str, Any] | None, out: DataLocation, kept: DataLocation, tracking: Tracking | None = None,
                 name: str | None = None, min_improvement: float | None = None) -> Promotion:
    """Promote the sweep's best trial once, as a deployment's run is promoted: only when it
    beats the model kept on the same images (the trial scored both: it ran with the same
    output.model_name); with tracking, its logged model is registered under `name` and becomes
    the champion."""
    if best is None:
        pointer = read_pointer(kept)
        return Promotion(promoted=False, reason="no trial completed, so there was nothing to promote",
                         pointer_url=child_url(kept.url, POINTER), kept_url=pointer["version"] if pointer else None)
    run_output = out.with_url(best["model_url"].rsplit("/", 1)[0])
    summary = TrainingSummary.model_validate(
        read_json(child_url(run_output.url, "metrics.json"), run_output.storage_options()))
    run = {"name": best["run"], "flow_run_id": best["flow_run_id"], "deployment": deployment.get_name()}
    logged = best.get("mlflow_model")
    model = LoggedModel(tracking=tracking, **logged) if tracking and logged else None
    registry = Registration(tracking=tracking, name=name, model=model) if tracking else None
    pointer = read_pointer(kept)  # a kept model that cannot be loaded is replaced, as a run's promotion does
    unusable = unusable_champion(kept, pointer) if pointer else None
    return promote(summary, run_output, kept, run, registry, min_improvement, unusable=unusable)
