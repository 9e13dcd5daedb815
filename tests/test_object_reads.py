"""Image reads through obstore (prefect_ddp.tasks.data.object_reads.fetch_objects on S3), against the session's moto
server, the fault-injecting front (tests/support/faulty_s3.py) and a small server that refuses
every GET.

What is checked: one GET per object and keys as written; fetch_objects' own retries, not
obstore's, where the location asks for one attempt per request; missing and refused
objects as the permanent errors (FileNotFoundError, PermissionError) that are not retried,
with no credential in their text; the options obstore cannot honour left to s3fs; and
fork: obstore starts only in a loader process or where a caller says its process forks none,
a process forked before it started reads with a store of its own, one forked after reads with
s3fs instead of hanging, and a worker's own reads leave its loaders reading with obstore.
"""

from __future__ import annotations

import glob
import logging
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Event, Thread
from types import SimpleNamespace

import fsspec.asyn
import pytest
import s3fs
from fsspec.implementations.memory import MemoryFileSystem
from torch.utils.data import DataLoader, Dataset

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data.dataset import eval_transform, forked_workers
from prefect_ddp.tasks.data.fetch_ahead import FetchAheadLoader
from prefect_ddp.tasks.data.loaders import ManifestImages
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.object_reads import (
    PERMANENT_FETCH_ERRORS,
    fetch_objects,
    object_read_options,
    obstore_settings,
)
from prefect_ddp.tasks.data.storage import filesystem
from prefect_ddp.tasks.training.rank_setup import fetched
from tests.support.flow_runs import block_copy
from tests.support.fresh_process import in_child

# Keys fsspec would expand as patterns, a space, unicode, a plus and a percent sign, plus
# one obstore cannot name as it is (an empty segment), which s3fs reads.
ODD_KEYS = ["odd/x[1].jpg", "odd/y*.jpg", "odd/z?.jpg", "odd/with space.jpg", "odd/ünïcode.jpg",
            "odd/plus+and%20.jpg", "odd/double//slash.jpg"]
BUCKET = "test-images"


@pytest.fixture(scope="module")
def odd_objects(image_location: DataLocation, s3_fs: s3fs.S3FileSystem) -> dict[str, bytes]:
    objects = {f"{BUCKET}/{key}": f"bytes of {key}".encode() for key in ODD_KEYS}
    s3_fs.pipe(objects)
    return objects


def s3fs_calls(fs: s3fs.S3FileSystem) -> list[str]:
    """The S3 operations `fs`'s own (botocore) client sends from now on: obstore's are not among them."""
    client = fsspec.asyn.sync(fs.loop, fs.set_session)
    calls: list[str] = []
    client.meta.events.register("before-call.s3", lambda model, **_: calls.append(model.name))
    return calls


def read_fs(location: DataLocation) -> s3fs.S3FileSystem:
    """A filesystem as the dataset makes one: its own (as in a forked loader worker), no HEAD from s3fs."""
    options = object_read_options(location.url, location.storage_options(), concurrency=4)
    fs, _ = filesystem(location.url, {**options, "skip_instance_cache": True})
    return fs


def test_keys_load_as_themselves_with_one_get_each_through_obstore(image_location, odd_objects, front):
    fs = read_fs(block_copy(image_location, endpoint_url=front.endpoint))
    calls = s3fs_calls(fs)
    assert fetch_objects(fs, list(odd_objects), batch_size=4, forks_no_loaders=True) == odd_objects
    assert front.methods == {"GET": len(odd_objects)}
    assert all(front.gets[path] == 1 for path in odd_objects)
    assert calls == ["GetObject"], "only the key obstore cannot name goes through s3fs"


def test_a_failed_first_get_is_retried_by_fetch_objects_and_counted(image_location, odd_objects, front):
    # One attempt per request (DataLocation.max_attempts=1): obstore does not retry, fetch_objects does.
    fs = read_fs(block_copy(image_location, endpoint_url=front.endpoint, max_attempts=1))
    paths = list(odd_objects)[:3]
    for path in paths:
        front.fail_gets(glob.escape(path), times=1, how="503")
    assert fetch_objects(fs, paths, batch_size=4, attempts=2, forks_no_loaders=True) == {path: odd_objects[path] for path in paths}
    assert [front.gets[path] for path in paths] == [2, 2, 2]
    front.fail_gets(glob.escape(paths[0]), times=1, how="reset")
    failed = fetch_objects(fs, paths[:1], batch_size=4, attempts=1, forks_no_loaders=True)[paths[0]]
    assert isinstance(failed, Exception) and not isinstance(failed, PERMANENT_FETCH_ERRORS)
    assert front.gets[paths[0]] == 3


def test_attempts_per_request_follow_the_location_as_botocore_s_did(image_location, odd_objects, front):
    fs = read_fs(block_copy(image_location, endpoint_url=front.endpoint, max_attempts=3))
    path = list(odd_objects)[0]
    front.fail_gets(glob.escape(path), times=2, how="503")
    assert fetch_objects(fs, [path], batch_size=1, attempts=1, forks_no_loaders=True) == {path: odd_objects[path]}
    assert front.gets[path] == 3


def test_a_missing_object_is_a_file_not_found_error_and_is_not_retried(image_location, front):
    fs = read_fs(block_copy(image_location, endpoint_url=front.endpoint))
    path = f"{BUCKET}/odd/gone.jpg"
    assert isinstance(fetch_objects(fs, [path], batch_size=1, attempts=4, forks_no_loaders=True)[path], FileNotFoundError)
    assert front.gets[path] == 1


class Refusing(BaseHTTPRequestHandler):
    """Answers every GET with the status in the server's `status` and S3's error body."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
        self.server.gets += 1
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def refusing_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    server.daemon_threads = True
    server.gets = 0
    thread = Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.unit
@pytest.mark.parametrize("status", [403, 401])
def test_a_refused_get_is_a_permission_error_without_the_credentials(refusing_server, status):
    refusing_server.status = status
    secret, token = f"secret-{uuid.uuid4().hex}", f"token-{uuid.uuid4().hex}"
    location = DataLocation(url="s3://private/images", endpoint_url=f"http://127.0.0.1:{refusing_server.server_port}",
                            region_name="us-east-1", aws_access_key_id="AKIDEXAMPLE",
                            aws_secret_access_key=secret, aws_session_token=token)
    fs = read_fs(location)
    error = fetch_objects(fs, ["private/images/a.jpg"], batch_size=1, attempts=4, forks_no_loaders=True)["private/images/a.jpg"]
    assert isinstance(error, PermissionError), repr(error)
    assert f"{status}" in str(error) and "private/images/a.jpg" in str(error)
    assert refusing_server.gets == 1, "a refusal comes back the same: not retried"
    texts = [str(error), repr(error), str(error.__cause__), repr(error.__cause__)]
    assert not [text for text in texts if secret in text or token in text]


@pytest.mark.unit
def test_every_option_a_data_location_produces_maps_to_obstore(monkeypatch):
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    base = DataLocation(url="s3://b/p", endpoint_url="http://127.0.0.1:9000", region_name="eu-west-1",
                        aws_access_key_id="AKID", aws_secret_access_key="s3cret", aws_session_token="tok",
                        max_attempts=2)
    settings = obstore_settings(base.storage_options())
    assert settings["config"] == {"endpoint": "http://127.0.0.1:9000", "region": "eu-west-1", "skip_signature": False}
    assert settings["client_options"]["allow_http"] is True
    assert settings["retry_config"] == {"max_retries": 1}
    assert settings["credential_provider"]() == {"access_key_id": "AKID", "secret_access_key": "s3cret",
                                                 "token": "tok", "expires_at": None}
    anonymous = obstore_settings(base.model_copy(update={"anonymous": True, "max_attempts": None}).storage_options())
    assert anonymous["config"]["skip_signature"] is True and anonymous["credential_provider"] is None
    assert anonymous["retry_config"] == {"max_retries": 4}, "botocore's default: 5 attempts"
    https = obstore_settings(base.model_copy(update={"endpoint_url": "https://minio.example"}).storage_options())
    assert https["client_options"]["allow_http"] is False
    botocore_style = {"anon": True, "endpoint_url": "http://h", "config_kwargs": {"retries": {"max_attempts": 2}}}
    assert obstore_settings(botocore_style)["retry_config"] == {"max_retries": 2}, "max_attempts counts retries"


@pytest.mark.unit
@pytest.mark.parametrize("options", [
    {"anon": True, "endpoint_url": "http://h", "profile": "dev"},
    {"anon": True, "endpoint_url": "http://h", "client_kwargs": {"verify": False}},
    {"anon": True, "endpoint_url": "http://h", "config_kwargs": {"s3": {"addressing_style": "virtual"}}},
    {"anon": True},  # AWS, no region known: botocore follows S3's redirect, obstore cannot
], ids=["profile", "verify", "addressing-style", "no-region"])
def test_options_obstore_cannot_honour_leave_the_reads_to_s3fs(options, monkeypatch, tmp_path):
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    assert obstore_settings(options) is None


@pytest.mark.unit
def test_no_credentials_anywhere_leaves_the_reads_to_s3fs(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert obstore_settings({"endpoint_url": "http://h", "client_kwargs": {"region_name": "us-east-1"}}) is None


def which_client_reads(location: DataLocation, path: str, expected: bytes, forks_no_loaders: bool = False) -> str:
    """Fetch `path` in this process: 's3fs' or 'obstore', by whether botocore sent it."""
    fs = read_fs(location)
    calls = s3fs_calls(fs)
    got = fetch_objects(fs, [path], batch_size=1, timeout_s=30, forks_no_loaders=forks_no_loaders)[path]
    if got != expected:
        return f"wrong result: {got!r}"
    return "s3fs" if calls else "obstore"


def fork_story(location: DataLocation, path: str, expected: bytes) -> list[str]:
    """Run in a fresh (spawned) process, where obstore has not started yet."""
    return [
        which_client_reads(location, path, expected),  # not a loader process, nor said to fork none: s3fs
        in_child("fork", which_client_reads, location, path, expected, True),  # so this child starts its own
        which_client_reads(location, path, expected, True),  # obstore starts here
        in_child("fork", which_client_reads, location, path, expected, True),  # and this child must not use it
        which_client_reads(location, path, expected, True),  # while the parent still does
    ]


def test_obstore_starts_only_where_said_and_a_child_forked_after_it_reads_with_s3fs(image_location, odd_objects):
    path = next(iter(odd_objects))
    story = in_child("spawn", fork_story, image_location, path, odd_objects[path])
    assert story == ["s3fs", "obstore", "obstore", "s3fs", "obstore"]


class ClientPerRead(Dataset):
    """One image, read by `which_client_reads` as a loader process reads: which client read it."""

    def __init__(self, location: DataLocation, path: str, expected: bytes) -> None:
        self.args = (location, path, expected)

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> str:
        return which_client_reads(*self.args)


def worker_reads_story(location: DataLocation, key: str, expected: bytes) -> list[str]:
    """In a fresh (spawned) process as on a Dask worker: a rank's own reads (its feed and decode
    measures, `rank_setup.fetched`; its champion's scoring, an in-process FetchAheadLoader; a
    shard's images, `S3ImageFolder.fetch`), then a DataLoader worker forked after them."""
    manifest = Manifest(root=f"s3://{BUCKET}", classes=["odd"], paths=[key], sizes=[len(expected)], labels=[0])
    images = ManifestImages(manifest, TrainingConfig(), location.storage_options(), fetch_threads=1)
    got = fetched(SimpleNamespace(images=images), [0], logging.getLogger(__name__))
    scored = [labels.tolist() for _, labels in FetchAheadLoader(images.dataset([0], eval_transform(8)), [0], 1)]
    loader = DataLoader(ClientPerRead(location, f"{BUCKET}/{key}", expected), batch_size=None, num_workers=1,
                        **forked_workers())
    return [f"fetched {got == [expected]}", f"scored {scored}", *loader]


def test_reads_on_a_worker_leave_the_loader_processes_forked_after_them_reading_with_obstore(image_location,
                                                                                            odd_objects):
    """On a GPU, decode_on="auto" fetches images in the rank before its loaders fork; a champion is
    scored, shards written, in a worker whose next gang forks its loaders there: through obstore,
    any of them left every loader process forked after it reading with s3fs, at about 1 ms more
    CPU per image."""
    key = "odd/with space.jpg"
    story = in_child("spawn", worker_reads_story, image_location, key, odd_objects[f"{BUCKET}/{key}"])
    assert story == ["fetched True", "scored [[-1]]", "obstore"]


@pytest.mark.unit
def test_reads_still_queued_when_the_limit_passes_time_out_like_the_running_one():
    """On a filesystem of sync reads (local disk, NFS), the reads queued behind a stalled one
    are cancelled at the limit; each was a CancelledError out of fetch_objects, not a timeout."""
    stalled = Event()

    class Stalling(MemoryFileSystem):
        protocol = "stalling"

        def cat_file(self, path, start=None, end=None, **kwargs):
            stalled.wait(30)
            return super().cat_file(path, start, end, **kwargs)

    filesystem = Stalling()
    paths = [f"/stalled/{n}.jpg" for n in range(4)]
    filesystem.pipe({path: b"image" for path in paths})
    try:
        fetched = fetch_objects(filesystem, paths, batch_size=1, attempts=1, timeout_s=0.2)
    finally:
        stalled.set()
    assert {path: type(outcome) for path, outcome in fetched.items()} == dict.fromkeys(paths, TimeoutError)


def test_a_stalled_get_gives_back_its_thread_once_its_call_timed_out(image_location, odd_objects, front):
    """obstore's GETs run on threads, which cannot be cancelled at the call's limit as a coroutine
    was: obstore ends each request `timeout_s` after it started, so a stalled store holds no
    thread (nor connection) for long, and later calls are not starved of threads."""
    location = block_copy(image_location, endpoint_url=front.endpoint)
    path = next(iter(odd_objects))
    front.stall_gets("*", seconds=30)
    started = time.monotonic()
    fetched = fetch_objects(read_fs(location), [path], batch_size=1, attempts=1, timeout_s=1, forks_no_loaders=True)
    assert isinstance(fetched[path], TimeoutError)
    assert wait_until(lambda: not reads_running(), timeout_s=20), "the stalled GET still holds its thread"
    assert time.monotonic() - started < 30  # ended by obstore's timeout, not by the front's stall
    front.clear()
    assert fetch_objects(read_fs(location), [path], batch_size=1, attempts=1, timeout_s=10,
                         forks_no_loaders=True)[path] == odd_objects[path]


def reads_running() -> bool:
    """Whether a thread of this process's read pool is inside an obstore GET (its innermost frame)."""
    frames = sys._current_frames()
    return any(thread.name.startswith("object-read") and "obstore.get(" in traceback.format_stack(frames[thread.ident])[-1]
               for thread in threading.enumerate() if thread.ident in frames)


def wait_until(done, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.1)
    return done()


@pytest.mark.unit
def test_no_read_starts_once_the_limit_has_passed():
    started_late = []
    deadline_at = []

    class Slow(MemoryFileSystem):
        protocol = "slow"

        def cat_file(self, path, start=None, end=None, **kwargs):
            if deadline_at and time.monotonic() > deadline_at[0]:
                started_late.append(path)
            time.sleep(0.05)
            return super().cat_file(path, start, end, **kwargs)

    slow = Slow()
    paths = [f"/slow/{n}.jpg" for n in range(40)]
    slow.pipe({path: b"image" for path in paths})
    deadline_at.append(time.monotonic() + 0.3)
    fetched = fetch_objects(slow, paths, batch_size=2, attempts=1, timeout_s=0.3)
    assert any(isinstance(outcome, bytes) for outcome in fetched.values())
    assert any(isinstance(outcome, TimeoutError) for outcome in fetched.values())
    time.sleep(0.2)  # the reads running at the limit finish; none may have started after it
    assert started_late == []

