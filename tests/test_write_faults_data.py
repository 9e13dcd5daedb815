"""Data writes against a store that fails (issue 46's fault matrix): shards, decode-check's
verdicts, batch-predict's chunks and summary.

Each cell breaks the next PUT of one object the product writes, one way (`PUT_FAULTS`),
through the S3 front in front of moto (tests/support/faulty_s3.py), calls the product's own
code (a Prefect task's `.fn`; where it raised, the same call once more, as the task's retry
would), then reads what was stored from moto directly and asserts what a user relies on:

- shards and their index (`write_shards`, below `OUTPUT/shards/KEY/`): nothing listed as
  done is missing. `complete_index` finds the set complete, every shard it lists reads back
  with the size it records and holds the images (bytes and labels) its place in the index
  says; a second call writes nothing (no PUT) and says it reused the set;
- decode-check's verdicts (`CheckMemory`, one file per class below `OUTPUT/decode-checks/`):
  the next run reuses exactly the verdicts decode-check gave or checks those images again,
  a whole class at a time, never a wrong or partial verdict; a file the store refuses for
  good costs that class a re-check, not the run;
- batch-predict's chunks and summary (`score_chunk`, `summarize_predictions`): every chunk
  reported done reads back whole with one row per readable key, the model's prediction for
  it, and its unreadable keys; scoring a done chunk again skips it and writes nothing;
  summary.json reads back whole and agrees with the chunks.

Besides the kinds met once by botocore's default client (which resends every one of them),
`UNRETRIED` is a 500 met by a client that tries once, so that the call raises and its repeat
is what keeps the promise; the verdicts, which are written by no task and so never retried,
also meet a file refused on every try (`REFUSED`) and a read refused on every try. 412 is left
out: these writes are unconditional PUTs, which S3 never answers 412.

Middle tier (no mark, as tests/test_store_faults.py): moto, and the session's Prefect server
for summarize-predictions' artifact. The model kept and a rank's checkpoints have their cells
in tests/test_store_faults.py; docs/testing.md lists every cell.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import pytest
import s3fs

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.deployments.local_services import MOTO_CREDENTIALS, MOTO_REGION, create_bucket
from prefect_ddp.deployments.sample_data import shapes_dataset
from prefect_ddp.tasks.config import ModelConfig
from prefect_ddp.tasks.data.check_memory import CheckMemory, DecodeResult, digest
from prefect_ddp.tasks.data.indexing import build_manifest, list_folder
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.shard_writer import ShardFormat, complete_index, shard_folder, write_shards
from prefect_ddp.tasks.data.storage import save_torch, write_json
from prefect_ddp.tasks.data.validation import chunked, decode_chunk
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.prediction.model_source import SOURCE_RECORD
from prefect_ddp.tasks.prediction.scoring import ScoringJob, chunk_url, read_chunk, score_chunk
from prefect_ddp.tasks.prediction.summary import SUMMARY_FILE, summarize_predictions
from prefect_ddp.tasks.retries import PERMANENT_ERRORS
from prefect_ddp.tasks.training.model import build_model, model_card
from tests.conftest import truncated_jpeg
from tests.support.faulty_s3 import FaultyS3

BUCKET = "write-faults-data"
# What each write meets once: the kinds an unconditional PUT can meet.
PUT_FAULTS = ["reset", "drop reply", "503", "500", "stall", "cut"]
# A 500 met by a client that tries each request once (Location.max_attempts=1): the call raises,
# and the task's retry (here: the same call once more) does what the client's resend did above.
UNRETRIED = "500 unretried"
# Every try of the write broken, by a client that tries each request once (s3fs still sends it
# 5 times on these; a 500 it sends once, which is UNRETRIED): the store refuses the file for good.
REFUSED = {"reset every try": "reset", "drop reply every try": "drop reply", "503 every try": "503"}
STALL_S = 0.5
CLASSES = ["circle", "square", "triangle"]
UNREADABLE = {"square/truncated.jpg": truncated_jpeg(), "triangle/not-an-image.jpg": b"these bytes are no image"}
PER_SHARD = 4
CHUNK = 4
T = TypeVar("T")


def direct(s3_endpoint: str, url: str) -> DataLocation:
    """`url` on moto itself, not through the front: what is stored, uncounted and unbroken."""
    return DataLocation(url=url, endpoint_url=s3_endpoint, region_name=MOTO_REGION, **MOTO_CREDENTIALS)


@pytest.fixture(scope="module")
def store(s3_endpoint: str) -> s3fs.S3FileSystem:
    """The module's bucket, holding the source images (under `source/`), read on moto directly."""
    create_bucket(s3_endpoint, BUCKET)
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, key=MOTO_CREDENTIALS["aws_access_key_id"],
                           secret=MOTO_CREDENTIALS["aws_secret_access_key"],
                           client_kwargs={"region_name": MOTO_REGION}, skip_instance_cache=True)
    files = shapes_dataset(3, size=32, seed=46) | UNREADABLE
    fs.pipe({f"{BUCKET}/source/{key}": data for key, data in files.items()})
    return fs


@pytest.fixture(scope="module")
def source(store: s3fs.S3FileSystem, s3_endpoint: str) -> tuple[DataLocation, Manifest, dict[str, bytes]]:
    """(the images on moto, their manifest with the listing's versions, {key: bytes})."""
    location = direct(s3_endpoint, f"s3://{BUCKET}/source")
    versions: dict[str, str] = {}
    manifest = build_manifest(location.url, list_folder(location, versions), versions)
    assert manifest.classes == CLASSES and all(manifest.versions)
    return location, manifest, {key: store.cat_file(f"{BUCKET}/source/{key}") for key in manifest.paths}


@pytest.fixture
def prefix(request) -> str:
    """The cell's own folder in the bucket, named plainly (a pattern reads brackets as a set)."""
    return re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")


def through(front: FaultyS3, prefix: str, how: str = "") -> DataLocation:
    """The cell's folder through the front; a client that tries each request once where `how` says
    so (`UNRETRIED`, `REFUSED`), botocore's default attempts otherwise."""
    attempts = 1 if how in (UNRETRIED, *REFUSED) else None
    return DataLocation(url=f"s3://{BUCKET}/{prefix}", endpoint_url=front.endpoint, region_name=MOTO_REGION,
                        max_attempts=attempts, **MOTO_CREDENTIALS)


def arm(front: FaultyS3, key_pattern: str, how: str, method: str = "PUT") -> None:
    """Break the next matching request as `how` says: once, or on every try (`REFUSED`)."""
    kind = REFUSED.get(how) or ("500" if how == UNRETRIED else how)
    front.fault(method, f"{BUCKET}/{key_pattern}", kind, times=None if how in REFUSED else 1,
                seconds=STALL_S if kind == "stall" else 0.0)


def once_more_if_it_raised(call: Callable[[], T], how: str) -> T:
    """`call()`; where it raises, the error must be one the task's retry takes
    (`retry_transient`), and the same call runs once more, as that retry would. An `UNRETRIED`
    fault must raise: its cell is there to test that repeat."""
    try:
        result = call()
    except PERMANENT_ERRORS:
        raise  # a Prefect retry would not follow: the run would fail here
    except Exception:  # noqa: BLE001 -- any other error is one retry_transient retries
        return call()
    assert how != UNRETRIED, "the client resent the PUT: the repeat this cell is for never ran"
    return result


# Shards and their index ------------------------------------------------------------------

SHARD_FORMAT = ShardFormat(images_per_shard=PER_SHARD)  # stored as they are: the bytes read back compare
# 11 images in 4-image shards: 3 shards, a record each, and the index.
SHARD_FILES = 3 * 2 + 1
SHARD_TARGETS = {
    "shard": "shards/*/shard-000000.tar",
    "record": "shards/*/shard-000000.json",
    "index": "shards/*/index.json",
}


def tar_members(data: bytes) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [(member.name, tar.extractfile(member).read()) for member in tar.getmembers()]


@pytest.mark.parametrize("how", [*PUT_FAULTS, UNRETRIED])
@pytest.mark.parametrize("target", SHARD_TARGETS)
def test_a_shard_set_is_complete_whole_and_written_once_whatever_one_write_meets(
        source, store, s3_endpoint, front, prefix, target, how):
    location, manifest, images = source
    output = through(front, prefix, how)
    positions = list(range(len(manifest)))

    def write() -> tuple:
        return write_shards(manifest.versionless(), positions, location.storage_options(), output.url,
                            output.storage_options(), SHARD_FORMAT, "split-digest", fetch_threads=4)

    arm(front, f"{prefix}/{SHARD_TARGETS[target]}", how)
    index, reused = once_more_if_it_raised(write, how)
    assert front.rules_left() == 0, "the fault never fired"
    assert not reused
    # One fault costs its own file at most two sends more (the client's resend, a write
    # again after a cut); shards already whole are not written again.
    assert front.methods["PUT"] <= SHARD_FILES + 2, front.methods

    folder = shard_folder(output.url, manifest, positions, SHARD_FORMAT, 0)
    stored = direct(s3_endpoint, folder)
    found = complete_index(stored.url, stored.storage_options(), folder.rsplit("/", 1)[-1])
    assert found is not None, "the set is not complete on the store"
    assert found == index
    assert sorted(found.paths) == sorted(manifest.paths) and sum(found.images) == len(manifest)
    sample = 0
    for name, count, size in zip(found.shards, found.images, found.bytes, strict=True):
        data = store.cat_file(f"{stored.url.removeprefix('s3://')}/{name}")
        assert len(data) == size, f"{name}: {len(data)} bytes stored, {size} recorded"
        members = tar_members(data)
        assert len(members) == 2 * count
        for n in range(sample, sample + count):
            key = found.paths[n]
            extension = key.rsplit(".", 1)[-1]
            assert members[2 * (n - sample)] == (f"{n:08d}.{extension}", images[key]), f"{name}: sample {n}"
            assert members[2 * (n - sample) + 1] == (f"{n:08d}.cls", str(CLASSES.index(key.split("/")[0])).encode())
        sample += count

    before = front.methods["PUT"]
    again, reused = write()  # a retried or later run over the same images, split and format
    assert reused and again == index
    assert front.methods["PUT"] == before, "a shard set already complete was written again"


def test_a_shard_index_garbled_on_the_store_is_said_and_the_set_completed_again(
        source, store, s3_endpoint, prefix, caplog):
    """issue 46: an index that cannot be read counted as no set, without a word."""
    location, manifest, _ = source
    output = direct(s3_endpoint, f"s3://{BUCKET}/{prefix}")
    positions = list(range(len(manifest)))

    def write() -> tuple:
        return write_shards(manifest.versionless(), positions, location.storage_options(), output.url,
                            output.storage_options(), SHARD_FORMAT, "split-digest", fetch_threads=4)

    index, _ = write()
    folder = shard_folder(output.url, manifest, positions, SHARD_FORMAT, 0)
    store.pipe_file(f"{folder.removeprefix('s3://')}/index.json", b'{"key": "')
    with caplog.at_level("WARNING"):
        again, reused = write()
    assert not reused and again == index
    assert f"The shard set's index {folder}/index.json cannot be read (JSONDecodeError" in caplog.text
    assert complete_index(folder, output.storage_options(), folder.rsplit("/", 1)[-1]) == index


# decode-check's verdicts ------------------------------------------------------------------


@pytest.fixture(scope="module")
def checked(source) -> list[DecodeResult]:
    """decode-check's verdicts on every source image: the two unreadable ones with their error."""
    location, manifest, _ = source
    verdicts = decode_chunk.fn(location, manifest.paths, list(range(len(manifest))))
    assert {manifest.paths[v.position] for v in verdicts if v.error} == set(UNREADABLE)
    return verdicts


# The class whose verdict file each cell breaks; the others' files must be kept whatever it meets.
FAULTED_CLASS = "circle"
# The classes whose images the next run checks again, where the store did not keep the file.
RECHECKED = {UNRETRIED: {FAULTED_CLASS}, "reset every try": {FAULTED_CLASS}, "503 every try": {FAULTED_CLASS}}


def recalled_by_class(memory: CheckMemory, manifest: Manifest, checked: list[DecodeResult]) -> set[str]:
    """The classes `memory` has the next run check again, asserting that what it recalls is
    exactly what decode-check said and that a class is recalled whole or not at all."""
    everything = list(range(len(manifest)))
    known, unknown = memory.recall(manifest, everything)
    assert sorted([v.position for v in known] + unknown) == everything
    assert all(verdict == checked[verdict.position] for verdict in known), "a verdict read back is not the one given"
    by_class: dict[str, set[bool]] = {}
    for position in everything:
        by_class.setdefault(manifest.classes[manifest.labels[position]], set()).add(position in unknown)
    assert all(len(states) == 1 for states in by_class.values()), f"a class's verdicts were kept in part: {by_class}"
    return {name for name, states in by_class.items() if states == {True}}


@pytest.mark.parametrize("how", [*PUT_FAULTS, UNRETRIED, *REFUSED])
def test_the_next_decode_check_reuses_exactly_the_verdicts_written_or_checks_again(
        source, checked, s3_endpoint, front, prefix, how):
    location, manifest, _ = source
    output = through(front, prefix, how)
    arm(front, f"{prefix}/decode-checks/*/{digest(FAULTED_CLASS)}.json", how)
    CheckMemory(output, location).remember(manifest, checked)  # a write it cannot make is logged, never raised
    if how in REFUSED:  # sent again and broken again: more PUTs than files
        assert front.methods["PUT"] > len(CLASSES), "the fault never fired"
    else:
        assert front.rules_left() == 0, "the fault never fired"
    # The next run: it reuses exactly the verdicts kept and checks the rest again, and one
    # fault retried by the client or the write costs it nothing.
    next_run = CheckMemory(direct(s3_endpoint, output.url), location)
    assert recalled_by_class(next_run, manifest, checked) == RECHECKED.get(how, set())


def test_a_verdict_file_the_store_will_not_serve_costs_a_recheck_not_the_run(source, checked, s3_endpoint, front,
                                                                            prefix):
    """Every GET of one class's file reset: the next run checks that class again and the others not
    (it raised botocore's EndpointConnectionError, failing decode-check, before STORE_ERRORS)."""
    location, manifest, _ = source
    CheckMemory(direct(s3_endpoint, f"s3://{BUCKET}/{prefix}"), location).remember(manifest, checked)
    arm(front, f"{prefix}/decode-checks/*/{digest(FAULTED_CLASS)}.json", "reset every try", method="GET")
    next_run = CheckMemory(through(front, prefix, "reset every try"), location)
    assert recalled_by_class(next_run, manifest, checked) == {FAULTED_CLASS}
    assert any(key.endswith(f"/{digest(FAULTED_CLASS)}.json") for key in front.gets), "the fault never fired"


# Batch-predict's chunks and summary.json ---------------------------------------------------


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Location:
    """A model as a run copies it (model.pt, model.json, source.json), on local disk: not faulted."""
    folder = tmp_path_factory.mktemp("model")
    config = ModelConfig(backbone="mobilenet_v3_small")
    save_torch(str(folder / "model.pt"), build_model(config, len(CLASSES)).state_dict(), {})
    write_json(str(folder / "model.json"), model_card(config, CLASSES, 32), {})
    write_json(str(folder / SOURCE_RECORD), {"model": "test", "folder": str(folder)}, {})
    return Location(url=str(folder))


def scoring_job(location: DataLocation, model: Location, output: DataLocation) -> ScoringJob:
    return ScoringJob(source=location.plain(), model=model, output=output.plain(), batch_size=3, top_k=2)


@pytest.fixture(scope="module")
def expected_rows(source, model_folder, tmp_path_factory) -> dict[str, str]:
    """{key: predicted class} of every readable image, scored once into a local folder."""
    location, manifest, _ = source
    job = scoring_job(location, model_folder, DataLocation(url=str(tmp_path_factory.mktemp("reference"))))
    rows = {}
    for index, keys in enumerate(chunked(manifest.paths, CHUNK)):
        score_chunk.fn(job, index, keys)
        with open(chunk_url(job.output.url, index), "rb") as file:
            table, _ = read_chunk(file.read())
        rows |= dict(zip(table["key"].to_pylist(), table["predicted"].to_pylist()))
    assert set(rows) == set(manifest.paths) - set(UNREADABLE)
    return rows


def stored_chunk(store: s3fs.S3FileSystem, output: DataLocation, index: int) -> bytes:
    return store.cat_file(chunk_url(output.url, index).removeprefix("s3://"))


def assert_chunk_holds(data: bytes, keys: list[str], expected_rows: dict[str, str]) -> tuple:
    table, unreadable = read_chunk(data)
    assert table.column("key").to_pylist() == [key for key in keys if key in expected_rows]  # one row per key
    assert dict(zip(table["key"].to_pylist(), table["predicted"].to_pylist())) == {
        key: expected_rows[key] for key in keys if key in expected_rows}
    assert set(unreadable) == {key for key in keys if key in UNREADABLE}
    return table, unreadable


@pytest.mark.parametrize("how", [*PUT_FAULTS, UNRETRIED])
def test_every_chunk_reported_done_reads_back_whole_and_is_scored_once(
        source, model_folder, expected_rows, store, front, prefix, how):
    location, manifest, _ = source
    output = through(front, prefix, how)
    job = scoring_job(location, model_folder, output)
    chunks = chunked(manifest.paths, CHUNK)
    arm(front, f"{prefix}/predictions/chunk-000001.parquet", how)
    outcomes = [once_more_if_it_raised(lambda index=index, keys=keys: score_chunk.fn(job, index, keys),
                                       how if index == 1 else "") for index, keys in enumerate(chunks)]
    assert front.rules_left() == 0, "the fault never fired"

    stored = []
    for outcome, keys in zip(outcomes, chunks, strict=True):
        data = stored_chunk(store, output, outcome.index)
        table, unreadable = assert_chunk_holds(data, keys, expected_rows)
        assert (outcome.rows, outcome.unreadable) == (table.num_rows, unreadable)  # what was reported is what is there
        stored.append(data)

    before = front.methods["PUT"]
    again = [score_chunk.fn(job, index, keys) for index, keys in enumerate(chunks)]  # a rerun of the flow run
    assert all(outcome.skipped for outcome in again)
    assert front.methods["PUT"] == before, "a chunk already done was scored and written again"
    assert [stored_chunk(store, output, index) for index in range(len(chunks))] == stored
    assert [(o.rows, o.unreadable) for o in again] == [(o.rows, o.unreadable) for o in outcomes]


def test_a_chunk_garbled_on_the_store_is_scored_again_not_a_failure_of_every_rerun(
        source, model_folder, expected_rows, store, s3_endpoint, prefix):
    """A chunk file an earlier attempt left that cannot be read was taken for done, and its read
    raised a ValueError, which no retry retries: every rerun failed until someone deleted it."""
    location, manifest, _ = source
    output = direct(s3_endpoint, f"s3://{BUCKET}/{prefix}")
    job = scoring_job(location, model_folder, output)
    keys = chunked(manifest.paths, CHUNK)[0]
    store.pipe_file(chunk_url(output.url, 0).removeprefix("s3://"), b"PAR1 not a parquet file")
    outcome = score_chunk.fn(job, 0, keys)
    assert not outcome.skipped
    assert_chunk_holds(stored_chunk(store, output, 0), keys, expected_rows)


@pytest.mark.parametrize("how", [*PUT_FAULTS, UNRETRIED])
def test_summary_json_reads_back_whole_and_agrees_with_the_chunks(
        prefect_api, source, model_folder, expected_rows, store, front, prefix, how):
    location, manifest, _ = source
    output = through(front, prefix, how)
    job = scoring_job(location, model_folder, output)
    chunks = chunked(manifest.paths, CHUNK)
    for index, keys in enumerate(chunks):
        score_chunk.fn(job, index, keys)
    arm(front, f"{prefix}/{SUMMARY_FILE}", how)
    # 2 of 11 unreadable: allowed here, so the task returns its summary rather than failing after it.
    summary = once_more_if_it_raised(lambda: summarize_predictions.fn(job, len(chunks), max_unreadable_fraction=0.5),
                                     how)
    assert front.rules_left() == 0, "the fault never fired"

    kept = json.loads(store.cat_file(f"{BUCKET}/{prefix}/{SUMMARY_FILE}"))  # whole: it parses
    assert kept == json.loads(json.dumps(summary))
    predicted: Counter[str] = Counter()
    unreadable: dict[str, str] = {}
    for index, keys in enumerate(chunks):
        table, failed = assert_chunk_holds(stored_chunk(store, output, index), keys, expected_rows)
        predicted.update(table["predicted"].to_pylist())
        unreadable |= failed
    assert kept["rows"] == len(expected_rows) == predicted.total()
    assert kept["predicted_counts"] == dict(predicted)
    assert kept["unreadable"] == unreadable and set(unreadable) == set(UNREADABLE)
    assert kept["labelled"] == len(expected_rows)
    correct = sum(expected_rows[key] == key.split("/")[0] for key in expected_rows)
    assert kept["accuracy"] == pytest.approx(correct / len(expected_rows))
