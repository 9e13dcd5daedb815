"""decode-check's memory: each image's verdict kept beside the outputs, so a run checks only new or changed images.

decode-check fetches and decodes every image it samples on every run: about 1.1 ms of task
time per small image, linear, so ~24 core-minutes a night at ImageNet's 1.28M images and far
more for camera originals. Its verdicts are kept below `OUTPUT/decode-checks/SOURCE/` (SOURCE:
a digest of the source URL and endpoint), one JSON file per class, named by a digest of the class (no
bucket name becomes a path), mapping each image's key to [size, version, width, height,
error]. A verdict is reused only for the same key, size and version (the listing's ETag, or
a local file's modification time: `prefect_ddp.tasks.data.object_listing.object_version`),
so a rewritten image is checked again, and one whose listing gave no version is checked every
time. Two limits: within `data.index_cache_minutes` the flow reuses its listing, versions
included, so an image rewritten meanwhile keeps its verdict until the listing is taken again
(training still leaves it out if it no longer decodes); and a local file's mtime is kept by
copies that keep it (`cp -p`, `rsync -t`). A missing image's verdict is not kept (it may come
back). The memory only saves work: one that cannot be read is empty, one that cannot be
written is logged, and the run goes on either way; that includes a store that drops the
connection past the client's retries, which botocore raises as its own errors, not OSErrors
(`STORE_ERRORS`).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import aiohttp
from botocore.exceptions import BotoCoreError
from pydantic import BaseModel

from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.storage import read_json, write_json
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.urls import child_url

CHECKS_FOLDER = "decode-checks"
logger = logging.getLogger(__name__)
# What reading or writing a verdict file raises when the store fails: s3fs's OSErrors for
# the store's answers (a 500 it kept giving), and botocore's own errors for a connection
# reset or a reply lost on every try, which s3fs raises untranslated (EndpointConnectionError,
# ConnectionClosedError: BotoCoreErrors, not OSErrors). With OSError alone, a verdict file
# the store kept refusing failed the flow's decode-check step, after every image had been
# checked, instead of costing the next run a re-check (issue 46).
STORE_ERRORS = (OSError, BotoCoreError, aiohttp.ClientError)  # the last: a reply cut mid-body


class DecodeResult(BaseModel):
    """What one image decoded to: its size, or why it could not be read."""

    position: int
    width: int = 0
    height: int = 0
    error: str | None = None


# Verdicts about the fetch or the checking worker, not the image's bytes: never kept.
NOT_THE_IMAGE = ("FileNotFoundError", "MemoryError")


def remembered(position: int, entry: Any, size_and_version: list[Any]) -> DecodeResult | None:
    """The verdict a memory entry [size, version, width, height, error] holds for the same size and
    version; None for another, or for an entry of any other shape."""
    if not isinstance(entry, list) or len(entry) != 5 or entry[:2] != size_and_version:
        return None
    try:
        return DecodeResult(position=position, width=entry[2], height=entry[3], error=entry[4])
    except ValueError:  # pydantic's: fields of the wrong types
        return None


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class CheckMemory:
    """The verdicts decode-check gave the images of one source, read and written one class at a time."""

    def __init__(self, output: Location, source: Location) -> None:
        # Keyed on where the images are (as the listing's cache is), not on the credentials that read them.
        self.folder = child_url(output.url, CHECKS_FOLDER, digest(f"{source.url}|{source.endpoint_url}"))
        self.options = output.storage_options()
        self._classes: dict[str, dict[str, list[Any]]] = {}

    def recall(self, manifest: Manifest, positions: list[int]) -> tuple[list[DecodeResult], list[int]]:
        """(the verdicts remembered for `positions`, the positions to check): remembered means the
        same key, size and a known, unchanged version."""
        known, unknown = [], []
        for position in positions:
            entry = self._verdicts(manifest.classes[manifest.labels[position]]).get(manifest.paths[position])
            version = manifest.versions[position] if manifest.versions else ""
            verdict = remembered(position, entry, [manifest.sizes[position], version]) if version else None
            if verdict:
                known.append(verdict)
            else:
                unknown.append(position)
        return known, unknown

    def remember(self, manifest: Manifest, results: list[DecodeResult]) -> None:
        """Keep the verdicts of images whose version is known, rewriting the files of their classes."""
        touched = set()
        for result in results:
            version = manifest.versions[result.position] if manifest.versions else ""
            if not version or (result.error or "").startswith(NOT_THE_IMAGE):
                continue
            name = manifest.classes[manifest.labels[result.position]]
            self._verdicts(name)[manifest.paths[result.position]] = [
                manifest.sizes[result.position], version, result.width, result.height, result.error]
            touched.add(name)
        for name in sorted(touched):
            try:
                write_json(self._file(name), self._classes[name], self.options)
            except (*STORE_ERRORS, TypeError, ValueError) as exc:
                logger.warning("Could not keep decode-check's verdicts for class %r at %s (%s): the next run "
                               "checks its images again.", name, self._file(name), exc)

    def _verdicts(self, name: str) -> dict[str, list[Any]]:
        if name not in self._classes:
            try:
                kept = read_json(self._file(name), self.options)
                if not isinstance(kept, dict) or not all(isinstance(key, str) for key in kept):
                    raise ValueError(f"not a mapping of keys to verdicts: {type(kept).__name__}")
                self._classes[name] = kept
            except FileNotFoundError:
                self._classes[name] = {}
            except (*STORE_ERRORS, ValueError) as exc:  # unreadable, not JSON, or not a mapping
                logger.warning("Could not read decode-check's verdicts at %s (%s): checking the class's images "
                               "again.", self._file(name), exc)
                self._classes[name] = {}
        return self._classes[name]

    def _file(self, name: str) -> str:
        return child_url(self.folder, f"{digest(name)}.json")
