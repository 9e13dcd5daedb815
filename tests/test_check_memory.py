"""decode-check's memory (tasks/data/check_memory.py): a verdict is reused only for the same key, size and version.

Unit tier: local folders, whose versions are the files' modification times.
"""

import json
import os
from pathlib import Path

import pytest

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.data.check_memory import CheckMemory, DecodeResult
from prefect_ddp.tasks.data.indexing import build_manifest, list_folder
from prefect_ddp.tasks.data.manifest import Manifest
from tests.support.image_folders import local_image_folder

pytestmark = pytest.mark.unit


def listed(root) -> Manifest:
    """The folder's manifest with its versions, as the flow's index step builds it."""
    versions: dict[str, str] = {}
    return build_manifest(str(root), list_folder(DataLocation(url=str(root)), versions), versions)


def verdicts(manifest, positions) -> list[DecodeResult]:
    """What decode-check would say: the first image unreadable, the others 32 x 32."""
    return [DecodeResult(position=p, error="OSError: truncated") if p == 0 else DecodeResult(position=p, width=32, height=32)
            for p in positions]


def test_a_second_run_checks_only_images_new_or_changed_since(tmp_path):
    local_image_folder(tmp_path / "images", per_class=3)
    output, source = DataLocation(url=str(tmp_path / "out")), DataLocation(url=str(tmp_path / "images"))
    manifest = listed(tmp_path / "images")
    assert len(manifest.versions) == len(manifest) and all(manifest.versions)
    everything = list(range(len(manifest)))
    first = CheckMemory(output, source)
    assert first.recall(manifest, everything) == ([], everything)
    first.remember(manifest, verdicts(manifest, everything))

    known, unknown = CheckMemory(output, source).recall(manifest, everything)  # the next night
    assert unknown == [] and known == verdicts(manifest, everything)  # the unreadable one stays unreadable

    changed = tmp_path / "images" / manifest.paths[4]
    changed.write_bytes(changed.read_bytes()[::-1])  # rewritten in place, the same size
    os.utime(changed, (1, 1))
    (tmp_path / "images" / manifest.paths[0].split("/")[0] / "new.jpg").write_bytes(changed.read_bytes())
    relisted = listed(tmp_path / "images")
    known, unknown = CheckMemory(output, source).recall(relisted, list(range(len(relisted))))
    assert sorted(relisted.paths[p] for p in unknown) == sorted([manifest.paths[4], f"{manifest.paths[0].split('/')[0]}/new.jpg"])
    assert len(known) == len(manifest) - 1


def test_images_without_a_version_are_checked_every_time_and_a_broken_memory_is_empty(tmp_path, caplog):
    local_image_folder(tmp_path / "images", per_class=2)
    output, source = DataLocation(url=str(tmp_path / "out")), DataLocation(url=str(tmp_path / "images"))
    versionless = listed(tmp_path / "images").versionless()
    everything = list(range(len(versionless)))
    CheckMemory(output, source).remember(versionless, verdicts(versionless, everything))
    assert not (tmp_path / "out").exists()  # nothing to key them by: nothing kept
    manifest = listed(tmp_path / "images")
    memory = CheckMemory(output, source)
    memory.remember(manifest, verdicts(manifest, everything))
    for kept in (tmp_path / "out").rglob("*.json"):
        kept.write_text("{not json")
    assert CheckMemory(output, source).recall(manifest, everything) == ([], everything)
    assert "Could not read decode-check's verdicts" in caplog.text
    other = DataLocation(url=str(tmp_path / "images"), endpoint_url="http://elsewhere:9000")
    assert CheckMemory(output, other).folder != memory.folder  # another endpoint's images are others


def test_entries_of_any_other_shape_are_checked_again_and_a_missing_image_is_not_remembered(tmp_path):
    local_image_folder(tmp_path / "images", per_class=2)
    output, source = DataLocation(url=str(tmp_path / "out")), DataLocation(url=str(tmp_path / "images"))
    manifest = listed(tmp_path / "images")
    everything = list(range(len(manifest)))
    gone = DecodeResult(position=1, error="FileNotFoundError: [Errno 2] No such file")
    CheckMemory(output, source).remember(manifest, [*verdicts(manifest, [0]), gone])
    assert CheckMemory(output, source).recall(manifest, [0, 1])[1] == [1]  # it may come back
    memory = CheckMemory(output, source)
    memory.remember(manifest, verdicts(manifest, everything))
    wrong_types = Path(memory._file(manifest.classes[manifest.labels[2]]))
    pairs = Path(memory._file(manifest.classes[manifest.labels[0]]))
    assert wrong_types != pairs
    wrong_types.write_text(json.dumps({manifest.paths[2]: [manifest.sizes[2], manifest.versions[2], "wide", None, None]}))
    pairs.write_text(json.dumps([[1, 2]]))
    known, unknown = CheckMemory(output, source).recall(manifest, everything)
    assert 2 in unknown and 0 in unknown and len(known) + len(unknown) == len(manifest)
    CheckMemory(output, source).remember(manifest, verdicts(manifest, everything))  # writes over them
    assert CheckMemory(output, source).recall(manifest, everything)[1] == []
