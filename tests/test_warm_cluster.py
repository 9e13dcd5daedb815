"""A cluster kept warm by the process that starts flow runs (blocks/warm_cluster.py).

What it decides for the user: which processes run a run's ranks. A run on the warm cluster
must find what a cluster of its own would give it: workers no earlier run has touched, its
own Prefect API, folder and environment, and no one else's tasks. A run that cannot have
that, or that finds another run on it, starts a cluster of its own and says why.
Real parts: a TLS LocalCluster held by this process, flow runs in child processes against
the session's Prefect server.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from distributed import Client, LocalCluster

from bench.project_log import project_messages
from prefect_ddp.blocks.cluster import DaskCluster
from prefect_ddp.blocks.warm_cluster import (
    REPLACE_FAILED,
    REPLACING,
    claim_warm_cluster,
    replace_failure,
    replace_used_workers,
    read_ticket,
    wait_until_free,
    warm_cluster,
    worker_addresses,
)

REPO = Path(__file__).resolve().parents[1]
SPEC = DaskCluster(n_workers=2)


@pytest.fixture(scope="module")
def holder(prefect_api: str) -> Iterator[tuple[Path, dict[str, str]]]:
    """A warm 2-worker cluster held by this process, started in the repository's root (where the flow
    runs below run); yields its ticket and the environment its child processes inherit."""
    before = os.getcwd()
    os.chdir(REPO)
    try:
        with warm_cluster(SPEC) as ticket:
            yield ticket, dict(os.environ)
    finally:
        os.chdir(before)


@pytest.fixture
def warm(holder: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch) -> Path:
    """The warm cluster's ticket, with this test's environment made the holder's, as a flow run's is (pytest
    changes PYTEST_CURRENT_TEST between a test's setup and its call: reset it in the test's body)."""
    ticket, environment = holder
    like_the_holder(monkeypatch, environment)
    return ticket


@pytest.fixture
def said() -> Iterator[list[str]]:
    """What the project logs during the test (bench/project_log.py says why not caplog)."""
    with project_messages() as messages:
        yield messages


def like_the_holder(monkeypatch: pytest.MonkeyPatch, environment: dict[str, str]) -> None:
    for key in set(os.environ) - set(environment):
        monkeypatch.delenv(key)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)


def connect(ticket: Path) -> Client:
    info = read_ticket(ticket)
    return Client(info.address, security=info.security(), timeout=30)


def worker_pids(ticket: Path) -> set[int]:
    with connect(ticket) as client:
        return set(client.run(os.getpid).values())


def run_flow(out: Path, environment: dict[str, str]) -> dict:
    """tests/support/warm_flow.py in a child process of the holder, as a worker starts a flow run."""
    subprocess.run([sys.executable, "-m", "tests.support.warm_flow", str(out)], check=True, cwd=REPO, timeout=240,
                   env=environment)
    return json.loads(out.read_text())


def test_flow_runs_started_beside_it_run_their_ranks_on_its_workers_fresh_each_time(holder, tmp_path):
    warm, environment = holder
    wait_until_free(warm)
    first_workers = worker_pids(warm)
    assert run_flow(tmp_path / "first.json", environment) == {"warm": True, "pids": sorted(first_workers)}
    # The run named its workers for replacement and let go without waiting for it: the next run waits for it.
    wait_until_free(warm)
    second_workers = worker_pids(warm)
    assert len(second_workers) == 2 and not second_workers & first_workers
    assert run_flow(tmp_path / "second.json", environment) == {"warm": True, "pids": sorted(second_workers)}


def test_one_run_at_a_time_and_a_run_that_died_on_it_leaves_fresh_workers_to_the_next(
        warm, holder, monkeypatch, said):
    like_the_holder(monkeypatch, holder[1])
    wait_until_free(warm)
    claim = claim_warm_cluster(SPEC)
    assert claim is not None
    assert claim_warm_cluster(SPEC) is None  # in use: this run starts its own cluster
    assert any("is in use by another run" in message for message in said)
    used = worker_pids(warm)
    claim.unlock()  # its process died: it never named its workers for replacement
    after_death = claim_warm_cluster(SPEC)
    assert after_death is not None and after_death.replace_first
    with connect(warm) as client:
        after_death.prepare(client)
        assert not set(client.run(os.getpid).values()) & used
        after_death.release(client)
    after_death.unlock()


@pytest.mark.parametrize("change, reason", [
    ("workers", "the run asks for 3 workers of 1 thread(s) and the warm cluster has 2 of 1"),
    ("environment", "its workers' environment differs from this run's in AWS_PROFILE"),
    ("folder", "its workers run in "),
    ("importable", "its workers cannot import from "),
    ("address", "the run asks for the cluster at tcp://10.0.0.5:8786"),
    ("cache", "its workers' environment differs from this run's in PREFECT_DDP_CACHE_DIR"),
])
def test_a_run_whose_ranks_would_see_a_difference_starts_its_own_cluster_and_says_why(
        warm, holder, change, reason, monkeypatch, tmp_path, said):
    like_the_holder(monkeypatch, holder[1])
    spec = SPEC
    if change == "workers":
        spec = DaskCluster(n_workers=3)
    elif change == "environment":
        monkeypatch.setenv("AWS_PROFILE", "a-value-that-stays-private")
    elif change == "folder":
        monkeypatch.chdir(tmp_path)
    elif change == "importable":
        monkeypatch.syspath_prepend(str(tmp_path))
    elif change == "cache":  # the ranks' byte cache would be the holder's folder (tasks/data/byte_cache.py)
        monkeypatch.setenv("PREFECT_DDP_CACHE_DIR", str(tmp_path / "a-cache-of-its-own"))
    else:
        spec = DaskCluster(address="tcp://10.0.0.5:8786")
    assert claim_warm_cluster(spec) is None
    text = "\n".join(said)
    assert reason in text and "Starting a cluster for this run" in text
    assert "a-value-that-stays-private" not in text


def test_prefect_settings_of_the_run_dask_configuration_and_mlflow_tracking_do_not_keep_it_off(warm, holder,
                                                                                               monkeypatch):
    like_the_holder(monkeypatch, holder[1])
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "a-run-id")
    monkeypatch.setenv("DASK_DISTRIBUTED__WORKER__DAEMON", "False")
    # A tracked run's process: `import mlflow` sets its telemetry id; an open session, its settings.
    monkeypatch.setenv("_MLFLOW_TELEMETRY_SESSION_ID", "a-session-id")
    monkeypatch.setenv("MLFLOW_TRACKING_AUTH", "prefect-ddp-session")
    wait_until_free(warm)
    claim = claim_warm_cluster(SPEC)
    assert claim is not None
    with connect(warm) as client:
        claim.release(client)
    claim.unlock()


def test_only_this_user_can_reach_it(warm):
    assert stat.S_IMODE(warm.stat().st_mode) == 0o600 and stat.S_IMODE(warm.parent.stat().st_mode) == 0o700
    address = read_ticket(warm).address
    assert address.startswith("tls://")
    with pytest.raises(Exception):  # no certificate: no connection, so no tasks of anyone else's
        Client(address.replace("tls://", "tcp://"), timeout=5)


def wait_for(condition, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.05)
    return value


def test_a_replacement_that_failed_is_tried_again_until_it_replaces_the_workers(tmp_path):
    """The replacer marked a set replaced before replacing it: one failure, and it never tried again
    (the cluster kept 0 workers, and every later warm run waited 120 s and failed)."""
    with (LocalCluster(n_workers=1, processes=False, threads_per_worker=1, dashboard_address=None) as cluster,
          Client(cluster) as watcher):
        used = set(watcher.run_on_scheduler(worker_addresses))
        (tmp_path / REPLACING).write_text(json.dumps(sorted(used)))  # as a run's release names them
        holders = Client(cluster, set_as_default=False)
        holders.close()  # the holder's client, closed under it: its first replacement fails
        stop = threading.Event()
        replacer = threading.Thread(target=replace_used_workers, args=(cluster, holders, tmp_path, 1, stop))
        replacer.start()
        try:
            failure = wait_for(lambda: replace_failure(tmp_path), "a note saying why the replacement failed")
            assert "could not replace the last run's workers" in failure
            wait_for(lambda: len(set(watcher.run_on_scheduler(worker_addresses)) - used) == 1
                     and not used & set(watcher.run_on_scheduler(worker_addresses)), "a new worker in its place")
            wait_for(lambda: not (tmp_path / REPLACE_FAILED).exists(), "the note gone once replaced")
        finally:
            stop.set()
            replacer.join()


def test_while_the_holder_cannot_replace_the_workers_runs_start_their_own_and_a_later_run_uses_it(
        warm, holder, monkeypatch, said):
    like_the_holder(monkeypatch, holder[1])
    wait_until_free(warm)
    note = warm.parent / REPLACE_FAILED
    note.write_text("ClosedClientError: the client was closed")  # what the replacer leaves where it failed
    try:
        assert claim_warm_cluster(SPEC) is None
        text = "\n".join(said)
        assert "could not replace the last run's workers (ClosedClientError: the client was closed)" in text
        assert "Starting a cluster for this run" in text
    finally:
        note.unlink()  # the replacer's retry succeeded
    claim = claim_warm_cluster(SPEC)
    assert claim is not None
    claim.withdraw()
