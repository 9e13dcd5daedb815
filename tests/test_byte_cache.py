"""The local byte cache: later epochs send no GET, the budget holds, and a rewritten object
of another size is fetched again. Real S3 (moto) behind the counting front."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader

from blocks.data_location import DataLocation
from tasks.byte_cache import ByteCache
from tasks.dataset import S3ImageFolder, eval_transform, forked_workers
from tests.faulty_s3 import FaultyS3, faulty_s3
from tests.flow_runs import block_copy

KEYS = [f"{cls}/{i:04d}.jpg" for cls in ("circle", "square", "triangle") for i in range(4)]


@pytest.fixture
def front(s3_endpoint: str) -> Iterator[FaultyS3]:
    with faulty_s3(s3_endpoint) as front:
        yield front


def image_folder(location: DataLocation, s3_fs, cache: ByteCache) -> S3ImageFolder:
    sizes = [s3_fs.size(f"{location.url[5:]}/{key}") for key in KEYS]
    return S3ImageFolder(location.url, KEYS, [0] * len(KEYS), location.storage_options(), eval_transform(32),
                         sizes=sizes, cache=cache)


def epoch(dataset: S3ImageFolder, num_workers: int) -> torch.Tensor:
    options = forked_workers() if num_workers else {}
    return torch.cat([images for images, _ in DataLoader(dataset, batch_size=5, num_workers=num_workers, **options)])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_later_epochs_read_the_cache_and_send_no_get(image_location, s3_fs, front, tmp_path, num_workers):
    dataset = image_folder(block_copy(image_location, endpoint_url=front.endpoint), s3_fs, ByteCache(10**8, tmp_path))
    first = epoch(dataset, num_workers)
    gets_after_first = sum(front.gets.values())
    assert gets_after_first >= len(KEYS)  # (a GET retried on a loaded machine counts twice)
    second = epoch(dataset, num_workers)
    assert sum(front.gets.values()) == gets_after_first
    assert torch.equal(first, second)


def test_the_cache_stops_adding_at_its_budget(image_location, s3_fs, front, tmp_path):
    sizes = sorted(s3_fs.size(f"{image_location.url[5:]}/{key}") for key in KEYS)
    budget = sum(sizes[:3])  # room for about three images
    dataset = image_folder(block_copy(image_location, endpoint_url=front.endpoint), s3_fs, ByteCache(budget, tmp_path))
    epoch(dataset, 0)
    assert 0 < ByteCache(budget, tmp_path).bytes_on_disk() <= budget
    epoch(dataset, 0)
    assert len(KEYS) < sum(front.gets.values()) < 2 * len(KEYS)  # the cached few were not fetched again


def test_an_object_rewritten_with_another_size_is_fetched_again(tmp_path):
    cache = ByteCache(10**6, tmp_path)
    cache.put("s3://b/a.jpg", 3, b"old")
    assert cache.get("s3://b/a.jpg", 3) == b"old"
    assert cache.get("s3://b/a.jpg", 5) is None


def test_an_empty_budget_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="max_bytes must be positive; got 0. Use no cache"):
        ByteCache(0)
