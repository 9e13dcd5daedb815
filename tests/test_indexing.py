import pytest

from prefect_ddp.tasks.data.indexing import build_manifest, list_folder
from prefect_ddp.tasks.data.storage import filesystem


@pytest.mark.unit
def test_classes_in_imagefolder_order_with_case_insensitive_extensions():
    manifest = build_manifest("s3://b/p", {
        "zebra/1.JPG": 10, "ant/2.png": 20, "ant/1.Jpeg": 30, "mole/deep/3.webp": 40,
    })
    assert manifest.classes == ["ant", "mole", "zebra"]
    assert manifest.class_to_idx == {"ant": 0, "mole": 1, "zebra": 2}
    assert manifest.paths == ["ant/1.Jpeg", "ant/2.png", "mole/deep/3.webp", "zebra/1.JPG"]
    assert manifest.labels == [0, 0, 1, 2]
    assert manifest.sizes == [30, 20, 40, 10]


@pytest.mark.unit
def test_non_images_and_keys_outside_class_folders_are_skipped_and_counted():
    manifest = build_manifest("s3://b/p", {
        "a/1.jpg": 1, "b/1.jpg": 1, "a/notes.txt": 1, "b/.DS_Store": 1, "top.jpg": 1, "labels.csv": 1,
    })
    assert manifest.paths == ["a/1.jpg", "b/1.jpg"]
    assert manifest.skipped_non_image == 3
    assert manifest.skipped_outside_class == 1


@pytest.mark.unit
def test_empty_prefix_is_a_clear_error():
    with pytest.raises(ValueError, match=r"No images found under 's3://b/empty'.*found 0 objects"):
        build_manifest("s3://b/empty", {})


@pytest.mark.unit
def test_only_non_images_is_a_clear_error():
    with pytest.raises(ValueError, match=r"found 2 objects \(1 not images, 1 directly under the root\)"):
        build_manifest("s3://b/p", {"a/x.txt": 1, "top.png": 1})


@pytest.mark.unit
def test_a_single_class_is_rejected():
    with pytest.raises(ValueError, match="only one class .'cats'"):
        build_manifest("s3://b/p", {"cats/1.jpg": 1, "cats/2.jpg": 1})


def test_listing_real_s3_finds_classes_and_skips_traps(image_location):
    manifest = build_manifest(image_location.url, list_folder(image_location))
    assert manifest.classes == ["circle", "square", "triangle"]
    assert manifest.class_counts() == {"circle": 10, "square": 11, "triangle": 10}
    assert manifest.skipped_non_image == 1  # README.txt
    assert manifest.skipped_outside_class == 1  # stray.jpg
    assert all(size > 0 for size in manifest.sizes)


def test_an_unchanged_prefix_is_listed_once_within_the_cache_window(image_location, prefect_api):
    from prefect import flow

    from prefect_ddp.tasks.data.indexing import index_images

    @flow
    def index_twice():
        first = index_images.with_options(refresh_cache=True)(image_location, return_state=True)
        second = index_images(image_location, return_state=True)
        return first, second

    first, second = index_twice()
    assert first.name == "Completed" and second.name == "Cached"
    assert second.result() == first.result()


def test_listing_each_class_folder_concurrently_finds_what_one_recursive_listing_finds(image_location, s3_fs):
    from fsspec.asyn import sync

    from prefect_ddp.tasks.data.indexing import (
        LISTING_CONCURRENCY,
        find_per_folder,
        relative_sizes,
    )

    root = image_location.url.removeprefix("s3://").rsplit("/", 1)[0] + "/listing-parity"
    # More folders than are listed at once, a nested folder, a folder marker, a file at the top.
    keys = {f"{root}/class{i:02d}/{j}.jpg": b"x" * (i + j + 1) for i in range(LISTING_CONCURRENCY + 3) for j in range(3)}
    keys |= {f"{root}/class00/deep/er/1.png": b"yy", f"{root}/marker/": b"", f"{root}/top.jpg": b"zzz"}
    s3_fs.pipe(keys)

    sequential = relative_sizes(root, s3_fs.find(root, detail=True))
    per_folder = relative_sizes(root, sync(s3_fs.loop, find_per_folder, s3_fs, root))
    assert per_folder == sequential
    assert sequential.keys() == {key.removeprefix(root + "/") for key in keys}  # the marker too: a non-image
    image_listing = list_folder(image_location.model_copy(update={"url": f"s3://{root}"}))
    assert image_listing == sequential


def test_an_empty_s3_prefix_lists_as_empty(image_location):
    empty = image_location.model_copy(update={"url": image_location.url + "-nothing-here"})
    assert list_folder(empty) == {}


@pytest.mark.parametrize("oddity", ["none", "nested marker", "empty file", "double slash", "dot segment"])
def test_listing_through_obstore_gives_exactly_what_s3fs_finds(image_location, s3_fs, oddity):
    """obstore shows folder markers without their slash and cannot name some keys: the
    folders where that matters are listed by s3fs, and the result is s3fs's, key for key."""
    from prefect_ddp.tasks.data.indexing import relative_sizes
    from prefect_ddp.tasks.data.object_listing import list_with_obstore

    root = image_location.url.removeprefix("s3://").rsplit("/", 1)[0] + f"/obstore-parity-{oddity.replace(' ', '-')}"
    keys = {f"{root}/": b"", f"{root}/top.jpg": b"zzz", f"{root}/marked/": b"", f"{root}/marked/1.jpg": b"x",
            f"{root}/only-a-marker/": b"", f"{root}/plain/2.jpg": b"yy", f"{root}/plain/deep/3.png": b"yyy"}
    keys |= {"none": {}, "nested marker": {f"{root}/plain/sub/": b""}, "empty file": {f"{root}/plain/0.jpg": b""},
             "double slash": {f"{root}/plain//4.jpg": b"z"}, "dot segment": {f"{root}/plain/./5.jpg": b"z"}}[oddity]
    s3_fs.pipe(keys)
    fs, _ = filesystem(f"s3://{root}", image_location.storage_options())

    versions, s3fs_versions = {}, {}
    listed = list_with_obstore(fs, root, concurrency=2, versions=versions)
    assert listed is not None  # obstore served this store
    assert listed == relative_sizes(root, s3_fs.find(root, detail=True), s3fs_versions)
    assert versions == s3fs_versions and all(versions.values())  # ETags, the same whichever client listed
    assert listed.keys() == {key.removeprefix(root + "/") if key != f"{root}/" else "" for key in keys}
