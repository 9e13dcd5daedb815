"""Session-wide real services: one Prefect server, one moto S3 server, one Dask cluster.

Started once per session (the Prefect server alone takes 11-14 s) and shared by every test
that needs them; unit tests that need none of them start none of them. The Prefect server
is a real `prefect server start`, so the CLI, a work pool's worker and the browser tests
use the same one as the flows run from this process.

The tiers (pyproject's markers; docs/testing.md, "Three tiers"): `unit` tests start no service, no Dask
cluster, no process group and no child process. Two checks keep them so: a unit test that
requests a fixture of SERVICE_FIXTURES fails before its fixtures are set up, and one that
starts a Python child process, a multiprocessing process, a Dask scheduler or a process
group while its fixtures or body run fails too (UnitGuard). `gpu` tests skip where torch
sees no CUDA device.
"""

from __future__ import annotations

import atexit
import io
import os
import shutil
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import dask
import pytest
import s3fs
from PIL import Image

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.deployments.local_services import (
    MOTO_CREDENTIALS,
    MOTO_REGION,
    create_bucket,
    moto_s3_server,
    prefect_server,
)
from prefect_ddp.deployments.sample_data import shapes_dataset
from tests.support.cluster_leftovers import SharedCluster
from tests.support.faulty_s3 import FaultyS3, faulty_s3

BUCKET = "test-images"
PER_CLASS = 10
IMAGE_SIDE = 32
# Fixtures that start a service or stand on one (the moto server, the Prefect server, the
# Dask cluster); a `unit` test may request none of them, directly or through another fixture.
SERVICE_FIXTURES = frozenset({"prefect_api", "s3_endpoint", "s3_fs", "image_location", "dask_cluster",
                              "deployments", "front", "mlflow_uri"})
# The work pool's worker (`prefect-ddp worker`) and `prefect-ddp serve` that tests start look
# for scheduled runs every 10 s by default: each deployment run would wait 5 s on average
# before it starts. Their children inherit these from the environment.
QUICK_POLLING = {"PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
# The session's SQLite-backed server at times answers nothing for up to 60 s on this loaded
# machine (its busy timeout; docs/architecture.md, "Facts: Prefect"). A client that gives up
# at its default 60 s and retries a state change the server made meanwhile gets the run's
# state back from the server, without its result: a flow that trained ended Completed and
# `state.result()` raised MissingResult. Clients of this session wait longer instead.
PATIENT_CLIENT = {"PREFECT_API_REQUEST_TIMEOUT": "180"}
# Dask's own monitors, at intervals for a 2-core machine that runs many clusters at once: an
# idle 2-worker cluster took 3.8 s of CPU a minute at Dask's defaults (its event loops' 20 ms
# ticks, the system monitor's 500 ms, each nanny's memory check every 100 ms) and 0.7 s with
# these (docs/testing.md, "The session's shared services"). Set for the whole session, so
# that every process it starts, flows and their clusters included, inherits them.
QUIET_DASK = {"DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "1s",
              "DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL": "2s",
              "DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL": "1s"}
os.environ.update(QUIET_DASK)
dask.config.refresh()
# The byte cache keeps resized copies of a run's training images in the user's own folder
# (~/.cache/prefect-ddp/images) unless told otherwise (tasks/data/cache_choice.py). The
# session's runs keep theirs in a private folder of its own (mkdtemp: mode 0700), removed at
# its end, which every process the session starts inherits (whatever folder the user's own
# environment names: the session neither reads nor fills that one).
SESSION_CACHE = tempfile.mkdtemp(prefix="prefect-ddp-test-cache-")
os.environ["PREFECT_DDP_CACHE_DIR"] = SESSION_CACHE
atexit.register(shutil.rmtree, SESSION_CACHE, ignore_errors=True)


def truncated_jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (10, 200, 10)).save(buffer, format="JPEG")
    return buffer.getvalue()[:200]


@pytest.fixture(scope="session")
def prefect_home(tmp_path_factory) -> Path:
    """PREFECT_HOME for the Prefect CLI and workers that tests start, away from ~/.prefect."""
    return tmp_path_factory.mktemp("prefect-home")


@pytest.fixture(scope="session")
def prefect_api(prefect_home: Path) -> Iterator[str]:
    """`prefect server start` on a fresh SQLite file; this process and its children use it.

    At the session's end, the logs and events this process still holds go before the server does.
    """
    from prefect.settings import PREFECT_API_REQUEST_TIMEOUT, PREFECT_API_URL, temporary_settings

    from tests.support.api_helpers import send_held_logs_and_events

    # The scheduler looks for deployments to schedule every 60 s by default; the test of the
    # nightly schedule should not wait that long.
    fast_scheduler = {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "3"}
    with prefect_server(prefect_home, database=prefect_home / "prefect.db", settings=fast_scheduler) as api_url:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PREFECT_API_URL", api_url)
            for name, value in (QUICK_POLLING | PATIENT_CLIENT).items():
                patch.setenv(name, value)
            patient = float(PATIENT_CLIENT["PREFECT_API_REQUEST_TIMEOUT"])
            with temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_REQUEST_TIMEOUT: patient}):
                yield api_url
                send_held_logs_and_events()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    with moto_s3_server(Path(tempfile.mkdtemp(prefix="moto-"))) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def s3_fs(s3_endpoint: str) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(
        endpoint_url=s3_endpoint, key=MOTO_CREDENTIALS["aws_access_key_id"],
        secret=MOTO_CREDENTIALS["aws_secret_access_key"], client_kwargs={"region_name": MOTO_REGION},
        skip_instance_cache=True,
    )


@pytest.fixture(scope="session")
def image_location(s3_endpoint: str, s3_fs: s3fs.S3FileSystem) -> DataLocation:
    """A tiny image folder on S3 with the traps real buckets have.

    One truncated JPEG (must be excluded), one README (not an image) and one image
    directly under the prefix (in no class folder).
    """
    create_bucket(s3_endpoint, BUCKET)
    files = shapes_dataset(PER_CLASS, size=IMAGE_SIDE, seed=1)
    files["square/broken.jpg"] = truncated_jpeg()
    files["README.txt"] = b"not an image"
    files["stray.jpg"] = files["circle/0000.jpg"]
    s3_fs.pipe({f"{BUCKET}/shapes/{key}": data for key, data in files.items()})
    return DataLocation(
        url=f"s3://{BUCKET}/shapes", endpoint_url=s3_endpoint, region_name=MOTO_REGION, **MOTO_CREDENTIALS
    )


CLUSTER_WORKERS = 2
# The session's cluster, once started: each test that uses it waits for all its workers first,
# and what it leaves there is freed before the next test takes it (pytest_runtest_protocol).
SESSION_CLUSTER: list[SharedCluster] = []


@pytest.fixture(scope="session")
def dask_cluster(prefect_api: str):
    """2 worker processes, set up the way the project's own clusters are."""
    from prefect_ddp.blocks.cluster import create_local_cluster

    cluster = create_local_cluster(n_workers=CLUSTER_WORKERS)
    SESSION_CLUSTER.append(SharedCluster(cluster, CLUSTER_WORKERS))
    yield cluster
    SESSION_CLUSTER.pop().close()
    cluster.close()


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> Iterator[str]:
    """A real `mlflow server` (SQLite, local artifacts); yields its tracking URI."""
    from tests.support.mlflow_server import mlflow_server

    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


@pytest.fixture(scope="session")
def deployments(prefect_api: str, prefect_home: Path, image_location: DataLocation) -> Iterator[dict[str, str]]:
    """prefect.yaml deployed to the session's server, a process worker polling its pool, and
    the test images saved as block `test-images`; yields the Prefect CLI's environment."""
    from tests.support.deployed import deployed_with_worker

    image_location.save("test-images", overwrite=True)
    with deployed_with_worker(prefect_home, prefect_home / "worker.log") as env:
        yield env


@pytest.fixture
def front(s3_endpoint: str) -> Iterator[FaultyS3]:
    """The fault-injecting, request-counting S3 front (tests/support/faulty_s3.py) before the
    session's moto server: fresh per test, so its counts and rules start empty."""
    with faulty_s3(s3_endpoint) as front:
        yield front


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slowest files first; `gpu` tests skip, saying why, where torch sees no CUDA device."""
    slowest_files_first(items)
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: torch.cuda.is_available() is False here (no CUDA device or "
                                   "driver); it runs on a machine with one")
    for item in gpu_tests:
        item.add_marker(skip)


def recorded_seconds() -> dict[str, float]:
    """Each test file's seconds in the last run bench/suite_times.py recorded (tests/DURATIONS.md)."""
    table = Path(__file__).with_name("DURATIONS.md")
    if not table.exists():
        return {}
    seconds = {}
    for line in table.read_text().splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) > 3 and cells[1].startswith("tests/"):
            try:
                seconds[cells[1]] = float(cells[3])
            except ValueError:  # a row edited by hand: that file keeps its place
                continue
    return seconds


def slowest_files_first(items: list[pytest.Item]) -> None:
    """Order the files by their recorded seconds, longest first, each file's tests as they were.

    xdist (pyproject's addopts: `--dist loadfile`) hands the files to its two processes in
    this order: with the longest first, the last files to finish are short ones, and neither
    process waits long for the other at the end. Files not in the record go last.
    """
    seconds = recorded_seconds()
    position = {}
    for index, item in enumerate(items):
        position.setdefault(item.nodeid.split("::")[0], index)
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::")[0], 0.0), position[item.nodeid.split("::")[0]]))


class StartedInUnitTest(RuntimeError):
    """Raised where a `unit` test starts what the unit tier leaves out."""


def _is_python(program) -> bool:
    return program == sys.executable or os.path.basename(os.fsdecode(program)).startswith("python")


class UnitGuard:
    """While a `unit` test's fixtures and body run: no Python child process (a Prefect, moto or
    Dask server, a script, Prefect's temporary server), no multiprocessing process (DataLoader
    workers, spawned ranks), no Dask scheduler (a LocalCluster, even in-process) and no process
    group. What it starts is refused, and the test fails even if the code under test swallowed
    the refusal. Other programs (`mount`, matplotlib's `fc-list`) are left alone."""

    def __init__(self) -> None:
        import multiprocessing.process
        import subprocess

        import distributed
        import torch.distributed

        self.started: list[str] = []
        self.service_threads = set(threading.enumerate()) - {threading.main_thread()}
        self.patch = pytest.MonkeyPatch()
        popen_init = subprocess.Popen.__init__
        process_start = multiprocessing.process.BaseProcess.start
        scheduler_init = distributed.Scheduler.__init__
        init_process_group = torch.distributed.init_process_group

        def popen(popen_self, args, *rest, **kwargs):
            program = kwargs.get("executable") or (args if isinstance(args, (str, bytes, os.PathLike)) else args[0])
            if not kwargs.get("shell") and _is_python(program):
                self.refuse(f"a Python child process {args!r}")
            popen_init(popen_self, args, *rest, **kwargs)

        self.patch.setattr(subprocess.Popen, "__init__", self.in_test_thread(popen, popen_init))
        self.patch.setattr(multiprocessing.process.BaseProcess, "start", self.in_test_thread(
            lambda p: self.refuse(f"a process {p!r}"), process_start))
        self.patch.setattr(distributed.Scheduler, "__init__", self.in_test_thread(
            lambda *a, **k: self.refuse("a Dask scheduler"), scheduler_init))
        self.patch.setattr(torch.distributed, "init_process_group", self.in_test_thread(
            lambda *a, **k: self.refuse("a process group"), init_process_group))

    def in_test_thread(self, guarded, original):
        """`guarded` in the test's thread and the threads it starts; `original` in the threads
        that were running before it: the session's services (a Dask nanny restarting a worker
        of the shared cluster, a server's threads) keep working beside a unit test."""
        def call(*args, **kwargs):
            chosen = original if threading.current_thread() in self.service_threads else guarded
            return chosen(*args, **kwargs)
        return call

    def refuse(self, what: str):
        self.started.append(what)
        raise StartedInUnitTest(f"a unit test started {what}; the unit tier starts no services or processes "
                                "(take the unit mark off this test)")


UNIT_GUARD = pytest.StashKey[UnitGuard]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a test's fixtures are set up (this runs before pytest's own setup): a `unit`
    test that asks for a service fails, and the guard goes up; a test on the session's
    cluster waits until all its workers are up.

    A test before it may have killed or restarted a worker, whose nanny brings it back
    seconds later (more on a loaded machine): a test that started meanwhile saw one worker,
    and a gang of world size 1 where it expected 2.
    """
    fixtures = getattr(item, "fixturenames", ())
    if item.get_closest_marker("unit") is None:
        if "dask_cluster" in fixtures and SESSION_CLUSTER:
            SESSION_CLUSTER[0].wait_for_workers()
        return
    services = sorted(SERVICE_FIXTURES.intersection(fixtures))
    if services:
        pytest.fail(f"{item.nodeid} is marked unit but requests {', '.join(services)} (directly or through "
                    "another fixture), which start services: take the unit mark off, or the fixture out.",
                    pytrace=False)
    item.stash[UNIT_GUARD] = UnitGuard()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield
    guard = item.stash.get(UNIT_GUARD, None)
    if guard is not None and guard.started:
        pytest.fail(f"{item.nodeid} is marked unit but started {'; '.join(guard.started)}", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    try:
        return (yield)
    finally:
        guard = item.stash.get(UNIT_GUARD, None)
        if guard is not None:
            guard.patch.undo()
            del item.stash[UNIT_GUARD]



class ClusterLeftovers(UserWarning):
    """A test left the session's cluster in use, and the harness freed it (the message says how)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """After a test on the session's cluster, before the next takes it: free the cluster of what
    the test left there (tests/support/cluster_leftovers.py), and say what, naming the test.

    One failed test left a deployment run holding both workers, and every test after it waited
    for them until its timeout (issue 47). A plain wrapper, registered after pytest-timeout's
    (conftest files load after installed plugins): it runs outside the test's timeout, so the
    test that used up its time still gets its cleanup, and inside pytest's warning capture
    (a `tryfirst` wrapper), so the warning is recorded against this test.
    """
    started = datetime.now(timezone.utc)
    outcome = yield
    fixtures = getattr(item, "fixturenames", ())
    if "dask_cluster" in fixtures and SESSION_CLUSTER:  # not after the session's last test: it is closed
        try:
            cleaned = SESSION_CLUSTER[0].free_after(item.nodeid, started, flow_runs="deployments" in fixtures)
        except Exception as exc:  # raised from this hook it would end the whole session
            cleaned = f"the harness could not check what {item.nodeid} left on the session's Dask cluster: {exc!r}"
        if cleaned:
            warnings.warn(ClusterLeftovers(cleaned), stacklevel=1)
    return outcome


# What tests/test_docs_blocks.py ran or checked of each page's blocks, under this key of its reports'
# user properties: they travel from pytest-xdist's workers to this process, which prints them.
DOCS_BLOCK = "docs_block"


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """List each documented block the docs test ran or checked, for CI's log."""
    done = sorted({value for report in terminalreporter.stats.get("passed", [])
                   for key, value in report.user_properties if key == DOCS_BLOCK})
    if done:
        terminalreporter.write_sep("-", f"documented blocks run or checked: {len(done)}")
        for line in done:
            terminalreporter.write_line(line)
