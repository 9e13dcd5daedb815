"""Prefect blocks: where data lives, which Dask cluster runs the ranks, where sweeps keep studies,
where runs are tracked.

This folder is installed as `prefect_ddp.blocks` (pyproject's package-dir): import it by
that name.
"""

from prefect_ddp.blocks.cluster import DaskCluster
from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.blocks.study_storage import StudyStorage
from prefect_ddp.blocks.tracking import MlflowTracking

__all__ = ["DaskCluster", "DataLocation", "MlflowTracking", "StudyStorage"]
