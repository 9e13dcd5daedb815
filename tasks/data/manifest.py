"""The manifest: every image of a folder with its size and class, listed once.

Ranks and validation chunks receive the manifest, so nobody lists the bucket again.
Columns rather than one object per image keep a million-image manifest small to ship.
"""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, Field

# torchvision.datasets.folder.IMG_EXTENSIONS, matched case-insensitively.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class Manifest(BaseModel):
    """Images below `root`; `paths[i]` is relative to root and starts with its class folder.

    (Not `keys`: Prefect walks results with dict(obj), which would call a field named keys.)
    """

    root: str
    classes: list[str]
    paths: list[str] = Field(default_factory=list)
    sizes: list[int] = Field(default_factory=list)
    labels: list[int] = Field(default_factory=list)
    # Each image's ETag (or modification time) from the listing, "" where unknown; empty when the
    # listing gave none. The flow's decode-check remembers verdicts by it (`versionless` before
    # the manifest travels to the ranks, which need none of it).
    versions: list[str] = Field(default_factory=list)
    skipped_non_image: int = 0
    skipped_outside_class: int = 0

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.classes)}

    def __len__(self) -> int:
        return len(self.paths)

    def class_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(self.classes, 0)
        for label in self.labels:
            counts[self.classes[label]] += 1
        return counts

    def without(self, excluded: set[int]) -> Manifest:
        """The same manifest minus the images at the `excluded` positions."""
        keep = [i for i in range(len(self.paths)) if i not in excluded]
        return self.model_copy(
            update={
                "paths": [self.paths[i] for i in keep],
                "sizes": [self.sizes[i] for i in keep],
                "labels": [self.labels[i] for i in keep],
                "versions": [self.versions[i] for i in keep] if self.versions else [],
            }
        )

    def versionless(self) -> Manifest:
        """The manifest without its versions: what the ranks, shards and splits need, smaller to ship."""
        return self.model_copy(update={"versions": []})


def digest(keys: list[str]) -> str:
    """A short fingerprint of a list of keys, to show two processes hold the same list."""
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16]
