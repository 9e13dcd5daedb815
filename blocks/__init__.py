"""Prefect blocks: where data lives and which Dask cluster runs the ranks."""

from blocks.cluster import DaskCluster
from blocks.data_location import DataLocation

__all__ = ["DaskCluster", "DataLocation"]
