"""Fetched image bytes kept on the worker host's local disk, so later epochs send no GET.

Every epoch reads every training image again; from S3 that is one GET per image per
epoch, and the latency of object storage. The cache keeps the bytes as fetched (not the
decoded tensors: those are larger than the JPEGs, and augmentation differs per epoch) in
a folder on local disk that every rank and loader worker on the host shares.

- Keyed on the object's URL and its size from the manifest: an object rewritten under the
  same key with another size is fetched again; one rewritten with the same size is not
  (the listing holds no checksum), so clear the folder after rewriting images in place.
- Bounded: it fills up to `max_bytes` and then stops adding (no eviction: a training set
  that does not fit is read from S3 in the part that did not fit). Each process counts
  what it finds at start plus what it writes, so concurrent writers can overshoot by about
  one batch each.
- Written atomically (a temporary file renamed into place), so a reader never sees a
  partial file, whichever process wrote it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

DEFAULT_FOLDER = Path(tempfile.gettempdir()) / "prefect-ddp-cache"
FOLDER_ENV = "PREFECT_DDP_CACHE_DIR"


def default_folder() -> Path:
    """Where the cache lives on each worker host: $PREFECT_DDP_CACHE_DIR, else the temp folder."""
    return Path(os.environ.get(FOLDER_ENV) or DEFAULT_FOLDER)


class ByteCache:
    """Image bytes by (URL, size) below `folder`, up to about `max_bytes` in all."""

    def __init__(self, max_bytes: int, folder: Path | str | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive; got {max_bytes}. Use no cache instead of an empty one.")
        self.folder = Path(folder) if folder else default_folder()
        self.max_bytes = max_bytes
        self._used: int | None = None  # counted on first write, in the process that writes

    def _path(self, url: str, size: int | None) -> Path:
        digest = hashlib.sha256(f"{url}|{size}".encode()).hexdigest()
        return self.folder / digest[:2] / digest

    def get(self, url: str, size: int | None) -> bytes | None:
        try:
            return self._path(url, size).read_bytes()
        except FileNotFoundError:
            return None

    def put(self, url: str, size: int | None, data: bytes) -> bool:
        """Keep `data` unless that would pass the budget; returns whether it was kept."""
        if self._used is None:
            self._used = self.bytes_on_disk()
        if self._used + len(data) > self.max_bytes:
            return False
        path = self._path(url, size)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
            tmp.write(data)
        os.replace(tmp.name, path)
        self._used += len(data)
        return True

    def bytes_on_disk(self) -> int:
        if not self.folder.exists():
            return 0
        return sum(entry.stat().st_size for sub in os.scandir(self.folder) if sub.is_dir()
                   for entry in os.scandir(sub.path) if entry.is_file())
