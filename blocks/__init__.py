"""Prefect blocks: where data lives, which Dask cluster runs the ranks, where sweeps keep studies."""

from blocks.cluster import DaskCluster
from blocks.data_location import DataLocation
from blocks.study_storage import StudyStorage

__all__ = ["DaskCluster", "DataLocation", "StudyStorage"]
