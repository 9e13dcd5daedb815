import fsspec.asyn
import pytest
import torch
from torch.utils.data import DataLoader

from tasks.dataset import S3ImageFolder, eval_transform
from tasks.indexing import build_manifest, list_folder
from tests.image_folders import local_image_folder


@pytest.fixture(scope="module")
def manifest(image_location):
    return build_manifest(image_location.url, list_folder(image_location))


def count_s3_calls(dataset: S3ImageFolder) -> list[str]:
    """Record the name of every S3 operation the dataset's client sends."""
    fs = dataset.fs
    client = fsspec.asyn.sync(fs.loop, fs.set_session)
    calls: list[str] = []
    client.meta.events.register("before-call.s3", lambda model, **_: calls.append(model.name))
    return calls


def test_a_batch_is_fetched_with_one_get_per_image_and_no_head(image_location, manifest):
    good = [i for i, p in enumerate(manifest.paths) if "broken" not in p]
    dataset = S3ImageFolder(
        manifest.root, [manifest.paths[i] for i in good], [manifest.labels[i] for i in good],
        image_location.storage_options(), eval_transform(32),
    )
    calls = count_s3_calls(dataset)
    batch = dataset.__getitems__(list(range(8)))
    assert calls == ["GetObject"] * 8
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


def test_missing_object_fails_with_its_key(image_location):
    dataset = S3ImageFolder(
        image_location.url, ["circle/does-not-exist.jpg"], [0], image_location.storage_options(), eval_transform(32),
    )
    with pytest.raises(OSError, match="Could not fetch 1 image.*circle/does-not-exist.jpg"):
        dataset[0]


def test_local_folders_work_too(tmp_path):
    manifest = local_image_folder(tmp_path, per_class=2)
    dataset = S3ImageFolder(str(tmp_path), manifest.paths, manifest.labels, {}, eval_transform(32))
    assert len(dataset) == 6 and dataset[5][1] == 2


def test_keys_and_labels_must_pair_up():
    with pytest.raises(ValueError, match="Got 2 keys but 1 labels"):
        S3ImageFolder("s3://b/p", ["a/1.jpg", "a/2.jpg"], [0], {}, eval_transform(32))
