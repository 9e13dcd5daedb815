"""prefect-ddp's public API in one import: the DDP gang, sweeps, the flows and the blocks.

    from prefect_ddp import RankContext, run_gang, sweep, load_model, load_torch

Everything here is what users build on; the modules under `prefect_ddp.tasks`,
`prefect_ddp.flows` and `prefect_ddp.blocks` may change shape between releases, these
names will not. They are imported on first use (PEP 562), so that a Dask worker that
unpickles one gang function does not also import the flows, Optuna and matplotlib.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from prefect_ddp.tasks.script_main import start_workers_without_unguarded_main

# A script without `if __name__ == "__main__":` runs as written: Dask workers started from this
# process never run its flow call again (tasks/script_main.py).
start_workers_without_unguarded_main()

# public name -> the module that defines it
_HOMES = {
    "DaskCluster": "prefect_ddp.blocks.cluster",
    "DataLocation": "prefect_ddp.blocks.data_location",
    "MlflowTracking": "prefect_ddp.blocks.tracking",
    "StudyStorage": "prefect_ddp.blocks.study_storage",
    "batch_predict": "prefect_ddp.flows.batch_predict",
    "hyperparameter_sweep": "prefect_ddp.flows.sweep",
    "transfer_learning": "prefect_ddp.flows.transfer_learning",
    "ClusterConfig": "prefect_ddp.tasks.config",
    "DataConfig": "prefect_ddp.tasks.config",
    "ModelConfig": "prefect_ddp.tasks.config",
    "OutputConfig": "prefect_ddp.tasks.config",
    "TrackingConfig": "prefect_ddp.tasks.config",
    "TrainingConfig": "prefect_ddp.tasks.config",
    "S3ImageFolder": "prefect_ddp.tasks.data.dataset",
    "GangAttempt": "prefect_ddp.tasks.gang",
    "GangError": "prefect_ddp.tasks.gang",
    "GangRefused": "prefect_ddp.tasks.gang",
    "GangRegroup": "prefect_ddp.tasks.gang",
    "GangResults": "prefect_ddp.tasks.gang",
    "GangStopped": "prefect_ddp.tasks.gang",
    "GangTimeout": "prefect_ddp.tasks.gang",
    "RankContext": "prefect_ddp.tasks.gang",
    "run_gang": "prefect_ddp.tasks.gang",
    "all_reduce_sum": "prefect_ddp.tasks.gang",
    "load_model": "prefect_ddp.tasks.training.model",
    "load_torch": "prefect_ddp.tasks.data.storage",
    "Dimension": "prefect_ddp.tasks.sweeps.search_space",
    "SweepSettings": "prefect_ddp.tasks.sweeps.settings",
    "sweep": "prefect_ddp.tasks.sweeps.sweep",
}

__all__ = sorted(_HOMES)

if TYPE_CHECKING:  # what static tools see; Python imports each name on first use (__getattr__)
    from prefect_ddp.blocks.cluster import DaskCluster
    from prefect_ddp.blocks.data_location import DataLocation
    from prefect_ddp.blocks.tracking import MlflowTracking
    from prefect_ddp.blocks.study_storage import StudyStorage
    from prefect_ddp.flows.batch_predict import batch_predict
    from prefect_ddp.flows.sweep import hyperparameter_sweep
    from prefect_ddp.flows.transfer_learning import transfer_learning
    from prefect_ddp.tasks.config import (ClusterConfig, DataConfig, ModelConfig, OutputConfig, TrackingConfig,
                                          TrainingConfig)
    from prefect_ddp.tasks.data.dataset import S3ImageFolder
    from prefect_ddp.tasks.gang import (GangAttempt, GangError, GangRefused, GangRegroup, GangResults, GangStopped,
                                        GangTimeout, RankContext, all_reduce_sum, run_gang)
    from prefect_ddp.tasks.training.model import load_model
    from prefect_ddp.tasks.data.storage import load_torch
    from prefect_ddp.tasks.sweeps.search_space import Dimension
    from prefect_ddp.tasks.sweeps.settings import SweepSettings
    from prefect_ddp.tasks.sweeps.sweep import sweep


if not TYPE_CHECKING:  # a checker that saw this would take any misspelt name for Any

    def __getattr__(name: str) -> Any:
        if name not in _HOMES:
            raise AttributeError(
                f"module 'prefect_ddp' has no attribute {name!r}; its public names: {', '.join(__all__)}")
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return __all__
