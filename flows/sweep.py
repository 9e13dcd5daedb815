"""The `hyperparameter-sweep` flow: many transfer-learning trials at once on one Dask cluster.

    study (Optuna, SQLite) -> trial-0, trial-1, ... (each a `transfer-learning` child flow
    run on its own leased workers, `concurrency` at a time) -> sweep-comparison artifact

Started from the UI's Run form (deployment `hyperparameter-sweep/ui-sweep`): the search
space maps dotted parameter paths (training.lr, training.batch_size, model.backbone) to how
each is drawn. Running it again under the same `settings.name` continues the study.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.states import State

from flows.transfer_learning import cluster_runner, data_location, output_base, transfer_learning
from tasks.config import ClusterConfig, DataConfig, ModelConfig, OutputConfig, TrainingConfig, with_overrides
from tasks.gang.trial import TrialLink, training_trial
from tasks.search_space import Dimension, with_params
from tasks.sweep import SweepSettings, open_study, run_trials, study_storage, trial_run_name
from tasks.sweep_report import publish_sweep_report

DESCRIPTION = (
    "Train many transfer-learning models at once on one Dask cluster, drawn by Optuna from a "
    "search space; stop bad ones early; compare them in one report."
)


def trial_outcome(state: State) -> dict[str, Any]:
    """What the sweep keeps of a trial's flow run (a pruned run ends Completed, named Pruned)."""
    if not state.is_completed():
        return {"state": "failed", "message": state.message}
    summary = state.result()
    return {"state": "completed", "model_url": summary["files"]["model.pt"],
            "workers": [rank["worker_address"] for rank in summary["ranks"]]}


def transfer_learning_trial(parameters: dict[str, Any], link: TrialLink, run_name: str) -> dict[str, Any]:
    """One trial: a `transfer-learning` child flow run that reports each epoch to the study."""
    with training_trial(link):
        state = transfer_learning.with_options(flow_run_name=run_name)(**parameters, return_state=True)
    return trial_outcome(state) | {"run": run_name}


def check_space(space: dict[str, Dimension]) -> None:
    """Refuse a path that names no parameter, before any trial starts."""
    for path in space:
        section, _, field = path.partition(".")
        model = {"data": DataConfig, "model": ModelConfig, "training": TrainingConfig}.get(section)
        if model is None or field not in model.model_fields:
            allowed = [f"{name}.{f}" for name, m in (("model", ModelConfig), ("training", TrainingConfig)) for f in m.model_fields]
            raise ValueError(f"The search space names {path!r}, which is no parameter of transfer-learning; "
                             f"use dotted paths such as {', '.join(allowed[:6])}, ...")


@flow(name="hyperparameter-sweep", description=DESCRIPTION)
def hyperparameter_sweep(
    space: dict[str, Dimension],
    settings: SweepSettings = SweepSettings(),
    data: DataConfig | None = None,
    model: ModelConfig = ModelConfig(),
    training: TrainingConfig = TrainingConfig(),
    cluster: ClusterConfig = ClusterConfig(),
    output: OutputConfig = OutputConfig(),
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
    """
    check_space(space)
    data = with_overrides(data or DataConfig.model_construct())
    base = {"data": data.model_dump(), "model": model.model_dump(),
            "training": training.model_dump(), "output": output.model_dump()}
    out = output_base(output, data_location(data))
    storage = study_storage(settings, out.url)
    study = open_study(settings, space, storage, max_epochs=training.epochs)
    with cluster_runner(cluster) as runner:
        shared = cluster.model_copy(update={
            "address": runner.client.scheduler.address, "block": None,
            "world_size": settings.ranks_per_trial, "lease_timeout_s": settings.lease_timeout_s,
        })

        def train_trial(trial: Any, link: TrialLink) -> dict[str, Any]:
            parameters = with_params(base, trial.params) | {"cluster": shared.model_dump()}
            return transfer_learning_trial(parameters, link, trial_run_name(trial.number, trial.params))

        run_trials(study, space, settings, storage, train_trial)
    return publish_sweep_report(study, settings, out)
