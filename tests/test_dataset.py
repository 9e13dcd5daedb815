import io

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from prefect_ddp.tasks.data.dataset import S3ImageFolder, eval_transform, forked_workers
from prefect_ddp.tasks.data.indexing import build_manifest, list_folder
from prefect_ddp.tasks.data.validation import decode_chunk
from tests.support.faulty_s3 import faulty_s3
from tests.support.flow_runs import block_copy
from tests.support.image_folders import local_image_folder


@pytest.fixture(scope="module")
def manifest(image_location):
    return build_manifest(image_location.url, list_folder(image_location))


def test_a_batch_is_fetched_with_one_get_per_image_and_no_head(image_location, manifest):
    good = [i for i, p in enumerate(manifest.paths) if "broken" not in p]
    with faulty_s3(image_location.endpoint_url) as front:  # counts every request the client sends
        location = block_copy(image_location, endpoint_url=front.endpoint)
        dataset = S3ImageFolder(
            manifest.root, [manifest.paths[i] for i in good], [manifest.labels[i] for i in good],
            location.storage_options(), eval_transform(32),
        )
        batch = dataset.__getitems__(list(range(8)))
    assert front.methods == {"GET": 8}
    assert [label for _, label in batch] == [dataset.labels[i] for i in range(8)]
    assert all(image.shape == (3, 32, 32) and image.dtype == torch.float32 for image, _ in batch)


def test_dataloader_collates_whole_batches(image_location, manifest):
    dataset = S3ImageFolder(
        manifest.root, manifest.paths[:6], manifest.labels[:6],
        image_location.storage_options(), eval_transform(32),
    )
    images, labels = next(iter(DataLoader(dataset, batch_size=6)))
    assert images.shape == (6, 3, 32, 32)
    assert labels.tolist() == manifest.labels[:6]


def test_a_missing_object_is_left_out_as_unreadable(image_location):
    dataset = S3ImageFolder(
        image_location.url, ["circle/0000.jpg", "circle/does-not-exist.jpg"], [0, 0], image_location.storage_options(),
        eval_transform(32),
    )
    (image, label), (stand_in, missing) = dataset.__getitems__([0, 1])
    assert (label, missing) == (0, -2) and torch.equal(stand_in, image)


@pytest.mark.unit
def test_local_folders_work_too(tmp_path):
    manifest = local_image_folder(tmp_path, per_class=2)
    dataset = S3ImageFolder(str(tmp_path), manifest.paths, manifest.labels, {}, eval_transform(32))
    assert len(dataset) == 6 and dataset[5][1] == 2


@pytest.mark.unit
def test_keys_and_labels_must_pair_up():
    with pytest.raises(ValueError, match="Got 2 keys, 1 labels and no sizes; they must pair up"):
        S3ImageFolder("s3://b/p", ["a/1.jpg", "a/2.jpg"], [0], {}, eval_transform(32))


def jpeg(side: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (side, 0, 0)).save(buffer, format="JPEG")
    return buffer.getvalue()


# Keys that fsspec's `cat` of a list would expand as glob patterns; x1.jpg is what
# "x[1].jpg" matches as a pattern, with another size, so a mix-up shows.
GLOB_KEYS = {"circle/x[1].jpg": 20, "circle/x1.jpg": 40, "square/y*.jpg": 24, "square/z?.jpg": 28}


@pytest.fixture(scope="module")
def glob_location(image_location, s3_fs):
    s3_fs.pipe({f"test-images/globs/{key}": jpeg(side) for key, side in GLOB_KEYS.items()})
    return image_location.with_url("s3://test-images/globs")


def sizes_through_the_dataset(root: str, storage_options: dict) -> list[tuple[int, int]]:
    dataset = S3ImageFolder(root, list(GLOB_KEYS), [0, 0, 1, 1], storage_options, transform=lambda image: image.size)
    return [size for size, _ in dataset.__getitems__(range(len(GLOB_KEYS)))]


def test_keys_with_glob_characters_load_as_themselves_from_s3(glob_location):
    assert sizes_through_the_dataset(glob_location.url, glob_location.storage_options()) == [
        (side, side) for side in GLOB_KEYS.values()
    ]


def test_keys_with_glob_characters_pass_the_decode_check(glob_location):
    results = decode_chunk.fn(glob_location, list(GLOB_KEYS), [0, 1, 2, 3])
    assert [(r.error, r.width) for r in results] == [(None, side) for side in GLOB_KEYS.values()]


@pytest.mark.unit
def test_keys_with_glob_characters_load_as_themselves_from_local_folders(tmp_path):
    for key, side in GLOB_KEYS.items():
        (tmp_path / key).parent.mkdir(exist_ok=True)
        (tmp_path / key).write_bytes(jpeg(side))
    assert sizes_through_the_dataset(str(tmp_path), {}) == [(side, side) for side in GLOB_KEYS.values()]


def test_the_connection_pool_holds_every_fetch_thread_and_keeps_other_client_settings(image_location):
    location = image_location.model_copy(update={"max_attempts": 2})
    dataset = S3ImageFolder(location.url, ["circle/0000.jpg"], [0], location.storage_options(),
                            eval_transform(32), fetch_threads=48)
    config = dataset.fs.s3.meta.config
    assert config.max_pool_connections >= 48
    assert config.retries["total_max_attempts"] == 2


def test_loader_workers_forked_from_a_process_running_prefect_services_exit_cleanly(prefect_api):
    # A rank's process ships its logs through Prefect's APILogWorker; loader workers forked
    # from it inherited its exit hook and ended with code 1 ("exited unexpectedly").
    from prefect.logging.handlers import APILogWorker

    APILogWorker.instance()  # started here as in a rank (idempotent: one per process)
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=2, **forked_workers())
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
