"""Bad data and bad sources: each ends one clear way, before any rank starts where it must.

Unreadable images are left out up to `data.max_unreadable_fraction`, and stop the run
above it; odd colour modes are trained on as RGB; a missing bucket, wrong credentials and
an unreachable endpoint each fail validate-source with a message naming what to fix.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from prefect.states import State

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.deployments.local_services import child_process, create_bucket
from prefect_ddp.flows.transfer_learning import transfer_learning
from prefect_ddp.tasks.config import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    OutputConfig,
    TrainingConfig,
)
from prefect_ddp.tasks.data.dataset import S3ImageFolder, eval_transform
from prefect_ddp.tasks.data.decoding import open_rgb
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.validation import (
    DecodeResult,
    check_unreadable,
    decode_check,
    validate_source,
)
from prefect_ddp.tasks.gang import free_port
from tests.support.api_helpers import assert_no_task_run_left_running
from tests.conftest import BUCKET, truncated_jpeg
from tests.support.flow_runs import block_copy

BLOCK = "bad-data"
COLOUR = (200, 100, 50)


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def rgb(side: int = 24) -> Image.Image:
    return Image.new("RGB", (side, side), COLOUR)


# mode -> (bytes of a 24x24 image in that mode, the RGB pixel training should see)
MODE_IMAGES: dict[str, tuple[Callable[[], bytes], tuple[int, int, int]]] = {
    "L": (lambda: encoded(Image.new("L", (24, 24), 128), "PNG"), (128, 128, 128)),
    "RGBA": (lambda: encoded(Image.new("RGBA", (24, 24), (*COLOUR, 0)), "PNG"), COLOUR),
    "CMYK": (lambda: encoded(rgb().convert("CMYK"), "JPEG"), COLOUR),
    # 40000 of 65535 is 156 of 255; PIL's convert("RGB") clips it to 255.
    "I;16": (lambda: encoded(Image.fromarray(np.full((24, 24), 40000, np.uint16)), "PNG"), (156, 156, 156)),
    "P": (lambda: encoded(rgb().convert("P", palette=Image.Palette.ADAPTIVE), "PNG"), COLOUR),
}


@pytest.mark.unit
@pytest.mark.parametrize("mode", MODE_IMAGES)
def test_each_colour_mode_decodes_to_8_bit_rgb(mode):
    make, pixel = MODE_IMAGES[mode]
    data = make()
    assert Image.open(io.BytesIO(data)).mode == mode
    image = open_rgb(data)
    assert image.mode == "RGB" and image.getpixel((5, 5)) == pixel
    assert decode_check(data) == (24, 24)


@pytest.mark.unit
def test_the_dataset_serves_every_mode_as_a_3_channel_tensor(tmp_path):
    for mode, (make, _) in MODE_IMAGES.items():
        (tmp_path / f"{mode.replace(';', '')}.png").write_bytes(make())
    keys = sorted(p.name for p in tmp_path.iterdir())
    dataset = S3ImageFolder(str(tmp_path), keys, [0] * len(keys), {}, eval_transform(32))
    assert [tuple(image.shape) for image, _ in dataset.__getitems__(range(len(keys)))] == [(3, 32, 32)] * 5


def results(errors: list[str | None]) -> tuple[Manifest, list[DecodeResult]]:
    paths = [f"c{i % 2}/{i}.jpg" for i in range(len(errors))]
    manifest = Manifest(root="s3://b/p", classes=["c0", "c1"], paths=paths, sizes=[1] * len(paths),
                        labels=[i % 2 for i in range(len(paths))])
    return manifest, [DecodeResult(position=i, error=e) for i, e in enumerate(errors) if e]


@pytest.mark.unit
@pytest.mark.parametrize("bad, checked, limit", [(0, 10, 0.0), (1, 10, 0.1), (3, 10, 0.3), (9, 10, 1.0)])
def test_a_share_of_unreadable_images_up_to_the_limit_is_left_out(bad, checked, limit):
    manifest, unreadable = results(["OSError: truncated"] * bad + [None] * (checked - bad))
    check_unreadable(manifest, checked, unreadable, limit)


@pytest.mark.unit
def test_a_share_above_the_limit_names_count_share_files_and_setting():
    manifest, unreadable = results(["OSError: truncated"] * 3 + [None] * 7)
    with pytest.raises(ValueError, match=r"3 of the 10 images checked under 's3://b/p' \(30.0%\) could not be "
                                         r"read, more than data.max_unreadable_fraction=0.25 allows; e.g. "
                                         r"c0/0.jpg, c1/1.jpg, c0/2.jpg .*raise data.max_unreadable_fraction"):
        check_unreadable(manifest, 10, unreadable, 0.25)


# --- flow runs: world size 1, one epoch of 32-pixel images ---------------------------------


@pytest.fixture(scope="module")
def bad_folders(image_location: DataLocation, s3_fs) -> str:
    """Image folders below s3://test-images/bad/, one per case; saves block BLOCK for them."""
    good = rgb(32)
    files = {
        "all-unreadable/a/0.jpg": truncated_jpeg(), "all-unreadable/b/0.jpg": truncated_jpeg(),
        "all-unreadable/b/1.jpg": truncated_jpeg(),
    }
    for case, bad_count in (("too-many-unreadable", 2), ("few-unreadable", 1)):
        for i in range(10):  # 2 of 10 (20 %) and 1 of 10 (10 %, at the default limit)
            files[f"{case}/{'ab'[i % 2]}/{i}.jpg"] = truncated_jpeg() if i < bad_count else encoded(good, "JPEG")
    for mode, (make, _) in MODE_IMAGES.items():
        for cls in "ab":
            files[f"modes/{cls}/{mode.replace(';', '')}.{'jpg' if mode == 'CMYK' else 'png'}"] = make()
    s3_fs.pipe({f"test-images/bad/{key}": data for key, data in files.items()})
    image_location.save(BLOCK, overwrite=True)
    return "s3://test-images/bad"


EARLIER_MODEL = b"a model an earlier run kept"


def run_flow(output: Path, dask_cluster, url: str | None = None, block: str = BLOCK) -> State:
    """The flow on `url`, into `output`, where an earlier run's model already lies."""
    (output / "earlier-run").mkdir(parents=True, exist_ok=True)
    (output / "earlier-run" / "model.pt").write_bytes(EARLIER_MODEL)
    return transfer_learning(
        data=DataConfig(block=block, url=url, index_cache_minutes=0, val_fraction=0.25),
        model=ModelConfig(backbone="mobilenet_v3_small"),
        training=TrainingConfig(epochs=1, batch_size=4, image_size=32, num_workers=0),
        cluster=ClusterConfig(address=dask_cluster.scheduler_address, world_size=1, init_timeout_s=60,
                              max_restarts=0),
        output=OutputConfig(url=str(output)),
        return_state=True,
    )


def failed_with(state: State, error: type[BaseException], match: str, output: Path) -> list:
    """Assert the run failed with `error` matching `match`, leaving the earlier run's model in
    `output` as it was; return its task runs, all final."""
    assert state.is_failed(), state
    with pytest.raises(error, match=match):
        state.result()
    assert (output / "earlier-run" / "model.pt").read_bytes() == EARLIER_MODEL
    return assert_no_task_run_left_running(state.state_details.flow_run_id)


def names(task_runs: list) -> set[str]:
    return {r.name.rsplit("-", 1)[0] for r in task_runs}


def test_a_folder_of_unreadable_images_fails_before_training(bad_folders, dask_cluster, tmp_path):
    state = run_flow(tmp_path, dask_cluster, f"{bad_folders}/all-unreadable")
    runs = failed_with(state, ValueError, r"None of the 3 images checked under 's3://test-images/bad/all-unreadable' "
                                          r"could be read: .*e.g. a/0.jpg, b/0.jpg, b/1.jpg", tmp_path)
    assert "rank" not in names(runs)


def test_too_many_unreadable_images_stop_the_run_before_training(bad_folders, dask_cluster, tmp_path):
    state = run_flow(tmp_path, dask_cluster, f"{bad_folders}/too-many-unreadable")
    runs = failed_with(state, ValueError, r"2 of the 10 images checked .* \(20.0%\) could not be read, more than "
                                          r"data.max_unreadable_fraction=0.1 allows; e.g. a/0.jpg, b/1.jpg", tmp_path)
    assert "rank" not in names(runs)


def test_unreadable_images_at_the_limit_are_left_out_and_training_goes_on(bad_folders, dask_cluster, tmp_path):
    state = run_flow(tmp_path, dask_cluster, f"{bad_folders}/few-unreadable")
    summary = state.result()
    assert summary["train_size"] + summary["val_size"] == 9
    assert_no_task_run_left_running(state.state_details.flow_run_id)


def test_a_folder_mixing_colour_modes_trains(bad_folders, dask_cluster, tmp_path):
    state = run_flow(tmp_path, dask_cluster, f"{bad_folders}/modes")
    summary = state.result()
    assert summary["train_size"] + summary["val_size"] == 10  # none left out
    assert_no_task_run_left_running(state.state_details.flow_run_id)


def validate_source_runs(task_runs: list) -> list:
    return [r for r in task_runs if r.name.startswith("validate-source")]


def test_a_missing_bucket_fails_validate_source_at_once_naming_it(bad_folders, dask_cluster, tmp_path):
    started = time.monotonic()
    state = run_flow(tmp_path, dask_cluster, "s3://no-such-bucket/images")
    runs = failed_with(state, FileNotFoundError, r"Bucket 'no-such-bucket' of 's3://no-such-bucket/images' was not "
                                                 r"found at http://127.0.0.1:\d+", tmp_path)
    assert [r.run_count for r in validate_source_runs(runs)] == [1]  # the decision: no retry
    assert time.monotonic() - started < 45  # at once, with room for a loaded machine


def test_a_prefix_uploaded_after_this_process_listed_its_parent_is_found(image_location, s3_fs):
    """fsspec reuses one s3fs per process, and s3fs answered from its cached listing of the parent:
    a folder uploaded since was "empty or does not exist" to the next run in the same process."""
    grown = image_location.with_url(f"s3://{BUCKET}/grows")
    s3_fs.pipe({f"{BUCKET}/grows/monday/a/0.jpg": b"an image"})
    validate_source.fn(grown.plain())  # lists grows/: only monday/
    s3_fs.pipe({f"{BUCKET}/grows/tuesday/a/0.jpg": b"an image"})
    validate_source.fn(grown.with_url(f"s3://{BUCKET}/grows/tuesday").plain())


@pytest.fixture(scope="module")
def authenticating_s3() -> Iterator[str]:
    """A second moto server that checks credentials, holding bucket test-images.

    moto accepts any key unless INITIAL_NO_AUTH_ACTION_COUNT is set; its first action
    (creating the bucket) goes unchecked, every later one needs a key moto's IAM knows.
    """
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="1")
    with child_process(args, f"{endpoint}/moto-api/", Path(tempfile.mkdtemp()) / "moto-auth.log", 60, env=env):
        create_bucket(endpoint, "test-images")
        yield endpoint


def test_wrong_credentials_fail_validate_source_at_once_naming_the_block(
    image_location, authenticating_s3, dask_cluster, tmp_path
):
    block_copy(image_location, endpoint_url=authenticating_s3).save("wrong-keys", overwrite=True)
    state = run_flow(tmp_path, dask_cluster, block="wrong-keys")
    runs = failed_with(state, PermissionError, r"Access to 's3://test-images/shapes' was denied \(.*\)\. Check the "
                                               r"credentials of data-location block 'wrong-keys' "
                                               r"\(aws_access_key_id 'testing'\)", tmp_path)
    assert [r.run_count for r in validate_source_runs(runs)] == [1]


@pytest.mark.slow
def test_an_unreachable_endpoint_fails_within_a_bounded_time_naming_it(image_location, dask_cluster, tmp_path):
    # botocore's default retries (5 attempts, ~8 s) and one Prefect retry after 5 s.
    block_copy(image_location, endpoint_url="http://127.0.0.1:1").save("unreachable", overwrite=True)
    started = time.monotonic()
    state = run_flow(tmp_path, dask_cluster, block="unreachable")
    runs = failed_with(state, ConnectionError, r"Cannot reach 's3://test-images/shapes' .*Check endpoint_url "
                                               r"\(http://127.0.0.1:1\)", tmp_path)
    assert [r.run_count for r in validate_source_runs(runs)] == [2]  # the decision: one retry
    assert time.monotonic() - started < 90  # bounded (about 20 s quiet), with room for a loaded machine
