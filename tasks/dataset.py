"""S3ImageFolder: images listed in a manifest, fetched with one GET each, a batch at a time.

dask-pytorch-ddp's class of this name listed the bucket on every rank and sent a HEAD and
a GET through a new boto3 resource per image. This one takes the manifest, so nothing is
listed, and implements `__getitems__`, which the DataLoader calls with a whole batch of
indices: the batch's images are fetched concurrently (fsspec `cat` of many paths), so
their latencies overlap, then decoded. Any fsspec URL works (s3://, file://, local path).
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2

from tasks.model import IMAGENET_MEAN, IMAGENET_STD
from tasks.storage import filesystem

FETCH_ATTEMPTS = 4


def train_transform(image_size: int) -> Callable:
    return v2.Compose([
        v2.PILToTensor(),
        v2.RandomResizedCrop(image_size, scale=(0.6, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])


def eval_transform(image_size: int) -> Callable:
    return v2.Compose([
        v2.PILToTensor(),
        v2.Resize(int(image_size * 1.14), antialias=True),
        v2.CenterCrop(image_size),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])


class S3ImageFolder(Dataset):
    """(image tensor, label) pairs for the images at `keys` below `root`.

    Args:
        root: folder URL; keys are relative to it.
        keys, labels: the images to serve and their class indices.
        storage_options: fsspec options (endpoint, credentials) for `root`.
        transform: applied to each decoded PIL image.
        fetch_threads: images fetched at once within a batch.
    """

    def __init__(
        self, root: str, keys: Sequence[str], labels: Sequence[int],
        storage_options: dict[str, Any], transform: Callable, fetch_threads: int = 16,
    ) -> None:
        if len(keys) != len(labels):
            raise ValueError(f"Got {len(keys)} keys but {len(labels)} labels; they must pair up.")
        self.root = root.rstrip("/")
        self.keys = list(keys)
        self.labels = list(labels)
        # max_concurrency=1: s3fs otherwise sends a HEAD before each GET to size the object.
        self.storage_options = {**storage_options, "skip_instance_cache": True}
        if root.startswith(("s3://", "s3a://")):
            self.storage_options["max_concurrency"] = 1
        self.transform = transform
        self.fetch_threads = fetch_threads
        self._fs = None
        self._root_path = ""
        self._pid = None

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def fs(self):
        # Created lazily in each process: a client made before a DataLoader forks would
        # share its event loop and sockets with the children.
        if self._fs is None or self._pid != os.getpid():
            self._fs, self._root_path = filesystem(self.root, self.storage_options)
            self._pid = os.getpid()
        return self._fs

    def _path(self, index: int) -> str:
        # fsspec answers `cat` with paths stripped of their protocol; ask in the same form.
        return f"{self._root_path}/{self.keys[index]}"

    def fetch(self, indices: Sequence[int]) -> list[bytes]:
        """The bytes of the images at `indices`, one GET each, retrying transient errors."""
        fs = self.fs
        paths = [self._path(i) for i in indices]
        got: dict[str, Any] = {}
        missing = paths
        for attempt in range(FETCH_ATTEMPTS):
            got.update(fs.cat(missing, on_error="return", batch_size=self.fetch_threads))
            missing = [p for p in missing if not isinstance(got.get(p), bytes)]
            if not missing:
                return [got[p] for p in paths]
            time.sleep(0.2 * 2**attempt)
        raise OSError(f"Could not fetch {len(missing)} image(s), e.g. {missing[0]}: {got[missing[0]]!r}")

    def decode(self, data: bytes, label: int) -> tuple[torch.Tensor, int]:
        with Image.open(io.BytesIO(data)) as image:
            return self.transform(image.convert("RGB")), label

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, int]]:
        return [self.decode(data, self.labels[i]) for data, i in zip(self.fetch(indices), indices)]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.__getitems__([index])[0]
