"""Session-wide real services: one Prefect server, one moto S3 server, one Dask cluster.

Started once per session (the Prefect server alone takes 11-14 s) and shared by every test
that needs them; unit tests that need none of them start none of them. The Prefect server
is a real `prefect server start`, so the CLI, a work pool's worker and the browser tests
use the same one as the flows run from this process.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import s3fs
from PIL import Image

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.deployments.local_services import (
    MOTO_CREDENTIALS,
    MOTO_REGION,
    create_bucket,
    moto_s3_server,
    prefect_server,
)
from prefect_ddp.deployments.sample_data import shapes_dataset

BUCKET = "test-images"
PER_CLASS = 10
IMAGE_SIDE = 32


def truncated_jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (10, 200, 10)).save(buffer, format="JPEG")
    return buffer.getvalue()[:200]


@pytest.fixture(scope="session")
def prefect_home(tmp_path_factory) -> Path:
    """PREFECT_HOME for the Prefect CLI and workers that tests start, away from ~/.prefect."""
    return tmp_path_factory.mktemp("prefect-home")


@pytest.fixture(scope="session")
def prefect_api(prefect_home: Path) -> Iterator[str]:
    """`prefect server start` on a fresh SQLite file; this process and its children use it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # The scheduler looks for deployments to schedule every 60 s by default; the test of the
    # nightly schedule should not wait that long.
    fast_scheduler = {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "3"}
    with prefect_server(prefect_home, database=prefect_home / "prefect.db", settings=fast_scheduler) as api_url:
        previous = os.environ.get("PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = api_url
        try:
            with temporary_settings({PREFECT_API_URL: api_url}):
                yield api_url
        finally:
            os.environ.pop("PREFECT_API_URL")
            if previous is not None:
                os.environ["PREFECT_API_URL"] = previous


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    with moto_s3_server(Path(tempfile.mkdtemp(prefix="moto-"))) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def s3_fs(s3_endpoint: str) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(
        endpoint_url=s3_endpoint, key=MOTO_CREDENTIALS["aws_access_key_id"],
        secret=MOTO_CREDENTIALS["aws_secret_access_key"], client_kwargs={"region_name": MOTO_REGION},
        skip_instance_cache=True,
    )


@pytest.fixture(scope="session")
def image_location(s3_endpoint: str, s3_fs: s3fs.S3FileSystem) -> DataLocation:
    """A tiny image folder on S3 with the traps real buckets have.

    One truncated JPEG (must be excluded), one README (not an image) and one image
    directly under the prefix (in no class folder).
    """
    create_bucket(s3_endpoint, BUCKET)
    files = shapes_dataset(PER_CLASS, size=IMAGE_SIDE, seed=1)
    files["square/broken.jpg"] = truncated_jpeg()
    files["README.txt"] = b"not an image"
    files["stray.jpg"] = files["circle/0000.jpg"]
    s3_fs.pipe({f"{BUCKET}/shapes/{key}": data for key, data in files.items()})
    return DataLocation(
        url=f"s3://{BUCKET}/shapes", endpoint_url=s3_endpoint, region_name=MOTO_REGION, **MOTO_CREDENTIALS
    )


@pytest.fixture(scope="session")
def dask_cluster(prefect_api: str):
    """2 worker processes, set up the way the project's own clusters are."""
    from prefect_ddp.blocks.cluster import create_local_cluster

    cluster = create_local_cluster(n_workers=2)
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def deployments(prefect_api: str, prefect_home: Path, image_location: DataLocation) -> Iterator[dict[str, str]]:
    """prefect.yaml deployed to the session's server, a process worker polling its pool, and
    the test images saved as block `test-images`; yields the Prefect CLI's environment."""
    from tests.support.deployed import deployed_with_worker

    image_location.save("test-images", overwrite=True)
    with deployed_with_worker(prefect_home, prefect_home / "worker.log") as env:
        yield env
