"""An existing Dask cluster, started the way its owners start one: `dask scheduler` and
`dask worker` processes, with a nanny and without, reached by address and by a saved
`dask-cluster` block.

Three small clusters, each started once per module: one with Dask's defaults (daemonic
workers, the nanny's MALLOC_TRIM_THRESHOLD_, the profiler on), one set up for training as
docs/running.md says, and one of `--no-nanny` workers. None of the nanny clusters' workers has
PREFECT_API_URL: the flow's own setting reaches the ranks with each task.
"""

from __future__ import annotations

import http.server
import re
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import copy_context
from datetime import timedelta
from pathlib import Path

import distributed
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
)
from prefect_dask import DaskTaskRunner

from prefect_ddp.blocks.cluster import DaskCluster
from prefect_ddp.tasks.gang import GangRefused, run_gang
from prefect_ddp.tasks.gang import worker_checks
from prefect_ddp.tasks.gang.worker_checks import (
    api_error,
    check_workers,
    find_problems,
    probe_worker,
)
from tests.support.api_helpers import all_logs, assert_no_task_run_left_running, rank_task_runs
from tests.support.external_dask import TRAINING_ENV, dask_processes, owner_environment
from tests.support.flow_runs import run_tiny_flow
from tests.support.gang_functions import report_rank

UNREACHABLE_API = "http://127.0.0.1:9/api"  # the discard port: nothing listens


@pytest.fixture(scope="module")
def default_cluster(tmp_path_factory, prefect_home: Path) -> Iterator[str]:
    """One nanny worker as `dask worker` starts it: daemonic, MALLOC_TRIM_THRESHOLD_, profiler on."""
    with dask_processes(tmp_path_factory.mktemp("default-cluster"), 1, nanny=True,
                        env=owner_environment(prefect_home, {})) as address:
        yield address


@pytest.fixture(scope="module")
def training_cluster(tmp_path_factory, prefect_home: Path) -> Iterator[str]:
    """Two nanny workers started with docs/running.md's settings, still without PREFECT_API_URL."""
    with dask_processes(tmp_path_factory.mktemp("training-cluster"), 2, nanny=True,
                        env=owner_environment(prefect_home, TRAINING_ENV)) as address:
        yield address


@pytest.fixture(scope="module")
def no_nanny_cluster(tmp_path_factory, prefect_home: Path, prefect_api: str) -> Iterator[str]:
    """One `dask worker --no-nanny`, with the profiler off and the flow's PREFECT_API_URL."""
    settings = {"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False", "PREFECT_API_URL": prefect_api}
    with dask_processes(tmp_path_factory.mktemp("no-nanny-cluster"), 1, nanny=False,
                        env=owner_environment(prefect_home, settings)) as address:
        yield address


@flow(name="external-gang-test")
def one_rank_gang(address: str, needs_child_processes: bool) -> list[dict]:
    """One rank of report_rank on the cluster at `address`."""
    with DaskTaskRunner(address=address) as runner:
        return run_gang(report_rank, {}, task_runner=runner, world_size=1, init_timeout=timedelta(seconds=60),
                        needs_child_processes=needs_child_processes)


def probe(address: str, flow_api: str | None) -> list[dict]:
    """What probe_worker finds on each worker of the cluster at `address`."""
    with distributed.Client(address, timeout=30) as client:
        return list(client.run(probe_worker, flow_api).values())


def facts(probes: list[dict]) -> set[tuple]:
    return {(p["daemon"], p["malloc_trim_threshold"], p["profiler"], p["rank_api_url"], p["api_error"]) for p in probes}


def run_records(flow_run_id, last_words: str = "") -> tuple[dict[str, str], list[str]]:
    """The flow run's artifacts by key, and its log messages once one holds `last_words`.

    Logs reach the server in batches a moment after the run ends: read too soon, the run's
    last lines are missing.
    """
    with get_client(sync_client=True) as api:
        artifacts = api.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
        logs = all_logs(api, flow_run_id, last_words)
    return {a.key: a.data for a in artifacts}, [log.message for log in logs]


# --- what a probe finds, and what the gang makes of it: plain dicts, no cluster ---

WELL_SET_UP = {"host": "h", "cpus": 2, "cuda": False, "gpus": [], "gpu_claim": None, "daemon": False,
               "malloc_trim_threshold": None, "profiler": False, "prefect_api_url": None,
               "rank_api_url": "http://p:4200/api", "api_error": None, "output_folder": None, "sees_output": None}


@pytest.mark.unit
@pytest.mark.parametrize("changes, needs_child_processes, fatal, message", [
    ({"daemon": True}, True, True, r"distributed.worker.daemon=True on tcp://w:1: its processes are daemonic.*"
     r"this gang's ranks may start them \(training.num_workers is not 0.*Fix: start the workers with `DASK_DISTRIBUTED__WORKER__DAEMON=False"),
    ({"daemon": True}, False, False, r"this gang's ranks start none, but training.num_workers > 0 would fail"),
    ({"malloc_trim_threshold": "65536"}, False, False, r"MALLOC_TRIM_THRESHOLD_=65536 on tcp://w:1: .*1.5x slower.*"
     r"DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON='\{\"MALLOC_TRIM_THRESHOLD_\": None\}' dask worker"),
    ({"profiler": True}, False, False, r"profile.enabled=True .*DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False"),
    ({"rank_api_url": None}, False, True, r"PREFECT_API_URL on tcp://w:1: neither the flow nor the worker sets it.*"
     r"temporary Prefect server of its own.*Fix: set PREFECT_API_URL"),
    ({"rank_api_url": "http://other:4200/api"}, False, True,
     r"ranks there would report to http://other:4200/api, not to this flow's Prefect API http://p:4200/api"),
    ({"api_error": "URLError(ConnectionRefusedError(111))"}, False, True,
     r"the worker cannot reach http://p:4200/api \(URLError.*prefect server start --host 0.0.0.0"),
    ({"output_folder": "/data/out", "sees_output": False}, False, True,
     r"output /data/out on tcp://w:1: it is a local folder of the flow's host, and this worker does not see.*"
     r"Fix: give an s3:// output .*output.shared=true"),
])
def test_each_setting_is_named_with_its_fix(changes, needs_child_processes, fatal, message):
    probes = {"tcp://w:1": WELL_SET_UP | changes, "tcp://w:2": WELL_SET_UP}
    (problem,) = find_problems(probes, "http://p:4200/api", needs_child_processes)
    assert problem.fatal == fatal and problem.workers == ("tcp://w:1",)
    warned: set[str] = set()
    if fatal:
        with pytest.raises(GangRefused, match=r"cannot train as they are set up, so no rank was started:\n- .*" + message):
            check_workers(probes, "http://p:4200/api", needs_child_processes, warned)
    else:
        check_workers(probes, "http://p:4200/api", needs_child_processes, warned)
        assert any(re.search(message, w) for w in warned)


@pytest.mark.unit
def test_well_set_up_workers_raise_nothing_and_one_problem_is_named_once_for_all_its_workers():
    probes = {f"tcp://w:{n}": WELL_SET_UP for n in range(3)}
    assert find_problems(probes, "http://p:4200/api", needs_child_processes=True) == []
    slow = {address: p | {"profiler": True} for address, p in probes.items()}
    (problem,) = find_problems(slow, "http://p:4200/api", needs_child_processes=True)
    assert problem.workers == ("tcp://w:0", "tcp://w:1", "tcp://w:2") and not problem.fatal


@pytest.mark.unit
def test_a_server_that_answers_at_all_is_reachable_and_a_closed_port_is_not():
    class NeedsAKey(http.server.BaseHTTPRequestHandler):  # as Prefect Cloud answers without one
        def do_GET(self) -> None:
            self.send_error(401)

        def log_message(self, *args) -> None:
            pass

    with serving(NeedsAKey) as api_url:
        assert api_error(api_url) is None
    assert "Connection refused" in api_error(UNREACHABLE_API)


@contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """An HTTP server on loopback answering with `handler`, in a thread; yields its API URL."""
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_port}/api"
        finally:
            server.shutdown()


class SlowHealth(http.server.BaseHTTPRequestHandler):
    """A Prefect server too busy to answer within the first check's timeout."""

    def do_GET(self) -> None:
        time.sleep(1.0)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"true")

    def log_message(self, *args) -> None:
        pass


@pytest.mark.unit
def test_a_slow_server_is_reached_a_silent_or_foreign_one_is_not(monkeypatch):
    monkeypatch.setattr(worker_checks, "API_CHECK_TIMEOUT_S", 0.3)
    monkeypatch.setattr(worker_checks, "API_SLOW_TIMEOUT_S", 3.0)
    with serving(SlowHealth) as api_url:
        assert api_error(api_url) is None
    monkeypatch.setattr(worker_checks, "API_SLOW_TIMEOUT_S", 0.3)
    with socket.socket() as silent:  # takes connections (the kernel's backlog), never answers: a proxy whose upstream is down
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        assert "connected, but no answer within 0.6 s" in api_error(f"http://127.0.0.1:{silent.getsockname()[1]}/api")
    with socket.socket() as foreign:  # answers, but not HTTP
        foreign.bind(("127.0.0.1", 0))
        foreign.listen(8)

        def answer() -> None:
            connection, _ = foreign.accept()
            with connection:
                connection.recv(1024)
                connection.sendall(b"\x00\x01 not http\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        assert "BadStatusLine" in api_error(f"http://127.0.0.1:{foreign.getsockname()[1]}/api")
    assert "Connection refused" in api_error(UNREACHABLE_API)


# --- real `dask worker` processes ---

def test_the_probe_reads_what_dask_worker_set(default_cluster, training_cluster, no_nanny_cluster, prefect_api):
    (by_default,) = probe(default_cluster, UNREACHABLE_API)
    assert (by_default["daemon"], by_default["malloc_trim_threshold"], by_default["profiler"]) == (True, "65536", True)
    assert by_default["prefect_api_url"] is None and by_default["rank_api_url"] == UNREACHABLE_API
    assert "Connection refused" in by_default["api_error"]
    assert facts(probe(training_cluster, prefect_api)) == {(False, None, False, prefect_api, None)}
    # The flow sets no URL here: a rank would use the worker's own, which it reaches.
    assert facts(probe(no_nanny_cluster, None)) == {(False, None, False, prefect_api, None)}


def test_daemonic_workers_are_refused_before_any_rank_when_ranks_start_processes(default_cluster, prefect_api):
    state = one_rank_gang(default_cluster, needs_child_processes=True, return_state=True)
    assert state.is_failed()
    with pytest.raises(GangRefused, match=r"no rank was started:\n- distributed.worker.daemon=True on tcp://127.0.0.1:\d+: "
                       r".*Fix: start the workers with `DASK_DISTRIBUTED__WORKER__DAEMON=False dask worker ...`"):
        state.result()
    flow_run_id = state.state_details.flow_run_id
    assert rank_task_runs(flow_run_id, expected=0) == []
    artifacts, _ = run_records(flow_run_id)
    setup = artifacts["worker-setup"]
    assert "**fatal**: distributed.worker.daemon=True" in setup and "**warning**: MALLOC_TRIM_THRESHOLD_=65536" in setup
    assert "**warning**: distributed.worker.profile.enabled=True" in setup


def test_the_flow_refuses_daemonic_workers_when_training_uses_loader_processes(default_cluster, prefect_api,
                                                                              image_location, tmp_path):
    image_location.save("test-images", overwrite=True)
    state = run_tiny_flow(tmp_path, {"address": default_cluster}, training={"num_workers": 1})
    assert state.is_failed(), state
    with pytest.raises(GangRefused, match=r"DASK_DISTRIBUTED__WORKER__DAEMON=False"):
        state.result()
    assert rank_task_runs(state.state_details.flow_run_id, expected=0) == []
    assert_no_task_run_left_running(state.state_details.flow_run_id)


def test_slow_settings_are_warned_about_and_the_gang_still_runs(default_cluster, prefect_api):
    state = one_rank_gang(default_cluster, needs_child_processes=False, return_state=True)
    (result,) = state.result()
    assert result["ctx"].world_size == 1 and result["rank_sum"] == 0.0
    flow_run_id = state.state_details.flow_run_id
    assert [run.state.type.value for run in rank_task_runs(flow_run_id, expected=1)] == ["COMPLETED"]
    artifacts, logs = run_records(flow_run_id, "Worker setup: distributed.worker.profile.enabled")
    warnings = [line for line in logs if line.startswith("Worker setup: ")]
    assert len(warnings) == 3 and any("MALLOC_TRIM_THRESHOLD_=65536" in line for line in warnings)
    assert "**warning**: distributed.worker.daemon=True" in artifacts["worker-setup"]


@pytest.mark.slow
def test_two_flow_runs_share_a_cluster_saved_as_a_block(training_cluster, prefect_api, image_location, tmp_path):
    image_location.save("test-images", overwrite=True)
    DaskCluster(address=training_cluster).save("external-test-cluster", overwrite=True)
    with ThreadPoolExecutor(2) as pool:
        # copy_context: each thread talks to the session's server, as this one does.
        runs = [pool.submit(copy_context().run, run_tiny_flow, tmp_path / name, {"block": "external-test-cluster"},
                            flow_run_name=name) for name in ("first", "second")]
        states = [run.result() for run in runs]
    assert [state.is_completed() for state in states] == [True, True], states
    ranks = [rank_task_runs(state.state_details.flow_run_id, expected=1) for state in states]
    # The workers have no PREFECT_API_URL: the ranks reported to the flow's server all the same.
    assert [[run.state.type.value for run in runs] for runs in ranks] == [["COMPLETED"], ["COMPLETED"]]
    workers = [state.result()["ranks"][0]["worker_address"] for state in states]
    (first,), (second,) = ranks
    # Ranks that trained side by side did so on workers leased to one run each. (Whether they
    # overlapped depends on how soon the server created the second run on a loaded machine;
    # tests/test_gang.py holds two gangs at once for that.)
    if first.start_time < second.end_time and second.start_time < first.end_time:
        assert workers[0] != workers[1]
    for state in states:
        assert "worker-setup" not in run_records(state.state_details.flow_run_id)[0]  # nothing to fix
        assert_no_task_run_left_running(state.state_details.flow_run_id)


@pytest.mark.slow
def test_a_no_nanny_worker_reached_by_address_trains_with_loader_processes(no_nanny_cluster, prefect_api, image_location,
                                                                          tmp_path):
    image_location.save("test-images", overwrite=True)
    state = run_tiny_flow(tmp_path, {"address": no_nanny_cluster}, training={"num_workers": 1})
    assert state.is_completed(), state
    assert state.result()["ranks"][0]["worker_address"].startswith("tcp://127.0.0.1:")
