"""Small image folders on local disk, for tests that need no S3."""

from __future__ import annotations

from pathlib import Path

from prefect_ddp.deployments.sample_data import shapes_dataset
from prefect_ddp.tasks.data.indexing import build_manifest
from prefect_ddp.tasks.data.manifest import Manifest


def local_image_folder(root: Path, per_class: int, size: int = 32) -> Manifest:
    """Write the shapes dataset under `root` and return its manifest."""
    for key, data in shapes_dataset(per_class, size=size).items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    listing = {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*.jpg")}
    return build_manifest(str(root), listing)
