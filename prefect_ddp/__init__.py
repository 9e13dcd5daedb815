"""prefect-ddp's public API in one import: the DDP gang, sweeps, the flows and the blocks.

    from prefect_ddp import RankContext, run_gang, sweep

Everything here is what users build on; the modules under `tasks`, `flows` and `blocks`
may change shape between releases, these names will not.
"""

from blocks.cluster import DaskCluster
from blocks.data_location import DataLocation
from blocks.study_storage import StudyStorage
from flows.sweep import hyperparameter_sweep
from flows.transfer_learning import transfer_learning
from tasks.config import ClusterConfig, DataConfig, ModelConfig, OutputConfig, TrainingConfig
from tasks.dataset import S3ImageFolder
from tasks.gang import GangAttempt, GangError, GangRefused, GangResults, GangStopped, GangTimeout, RankContext, run_gang
from tasks.process_group import all_reduce_sum
from tasks.search_space import Dimension
from tasks.sweep import SweepSettings, sweep

__all__ = [
    "ClusterConfig",
    "DaskCluster",
    "DataConfig",
    "DataLocation",
    "Dimension",
    "GangAttempt",
    "GangError",
    "GangRefused",
    "GangResults",
    "GangStopped",
    "GangTimeout",
    "ModelConfig",
    "OutputConfig",
    "RankContext",
    "S3ImageFolder",
    "StudyStorage",
    "SweepSettings",
    "TrainingConfig",
    "all_reduce_sum",
    "hyperparameter_sweep",
    "run_gang",
    "sweep",
    "transfer_learning",
]
