"""Stopping a gang on every way out of run_gang: signals to the flow's process, a rank
cancelled in Dask, a submit that fails half-way; ranks leave between steps on the stop flag.

The ranks run on the session's cluster, which the flow reaches by address, as an external
cluster: nothing that happens to the flow's process reaches them but the supervisor.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import distributed
import optuna
import pytest
import torch.distributed as dist
from optuna.trial import TrialState
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    TaskRunFilter,
    TaskRunFilterName,
    TaskRunFilterStartTime,
)
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelling, Running
from prefect_dask import DaskTaskRunner
from prefect_dask.task_runners import PrefectDaskFuture

from prefect_ddp.tasks.gang import GangError, GangStopped, RankContext, run_gang
from prefect_ddp.tasks.gang.states import crash_when_recorded
from prefect_ddp.tasks.gang.stopping import READ_EVERY_S, StopFlag
from prefect_ddp.tasks.gang.supervise import FAILURE_GRACE_S
from prefect_ddp.tasks.sweeps.sweep import SweepAlreadyRunning
from tests.support.api_helpers import assert_no_task_run_left_running, rank_task_runs
from tests.support.deployed import POOL
from tests.support.gang_functions import call_check_stop, gang_flow, report_rank, sweep_flow
from tests.support.image_folders import local_image_folder

REPO = Path(__file__).resolve().parent.parent
# The flow's own process, as `python my_flow.py` starts it. Python leaves SIGINT ignored in
# a process started in the background; a terminal's Ctrl-C raises KeyboardInterrupt.
FLOW_PROCESS = """
import json, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from tests.support.gang_functions import gang_flow
gang_flow(**json.loads(sys.argv[1]))
"""
RANKS_START_S = 120


def wait_for_marks(folder: Path, kind: str, ranks: int, process: subprocess.Popen | None = None,
                   timeout_s: float = RANKS_START_S) -> list[str]:
    """The contents of the `kind-RANK` marks that loop_until_stopped leaves, once every rank left one."""
    deadline = time.monotonic() + timeout_s
    while len(marks := sorted(folder.glob(f"{kind}-*"))) < ranks:
        assert process is None or process.poll() is None, f"the flow process exited {process.returncode}"
        assert time.monotonic() < deadline, f"only {len(marks)} of {ranks} ranks left a {kind!r} mark"
        time.sleep(0.2)
    return [mark.read_text() for mark in marks]


def worker_addresses(address: str) -> set[str]:
    with distributed.Client(address) as client:
        return set(client.scheduler_info(n_workers=-1)["workers"])


def assert_workers_free(address: str, before: set[str]) -> None:
    """The same workers as before (none restarted), idle, outside any process group, and
    free for the next gang, which gets both at once."""
    with distributed.Client(address) as client:
        assert set(client.scheduler_info(n_workers=-1)["workers"]) == before
        assert all(not keys for keys in client.processing().values()), client.processing()
        assert set(client.run(dist.is_initialized).values()) == {False}
    results = gang_flow(address, "report", {}, lease_timeout_s=5)
    assert [r["rank_sum"] for r in results] == [1.0, 1.0]


def read_flow_run(flow_run_id: str):
    with get_client(sync_client=True) as api:
        return api.read_flow_run(flow_run_id)


def assert_ranks_cancelled(flow_run_id: str) -> None:
    """Every task run is final, and the ranks ended Cancelled: they left by themselves."""
    runs = assert_no_task_run_left_running(flow_run_id)
    assert sorted((r.name, r.state.type.value) for r in runs) == [("rank-0", "CANCELLED"), ("rank-1", "CANCELLED")]


@pytest.mark.parametrize("signum, crash_message", [
    (signal.SIGTERM, "Execution was aborted by a termination signal."),  # Prefect's TerminationSignal
    (signal.SIGINT, "Execution was aborted by an interrupt signal."),  # KeyboardInterrupt
])
def test_a_signal_to_the_flow_process_stops_its_ranks_on_an_external_cluster(
    dask_cluster, tmp_path, signum, crash_message,
):
    address = dask_cluster.scheduler_address
    before = worker_addresses(address)
    parameters = {"address": address, "fn_name": "loop", "config": {"marks": str(tmp_path)}}
    process = subprocess.Popen([sys.executable, "-c", FLOW_PROCESS, json.dumps(parameters)], cwd=REPO,
                               env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        flow_run_id, _ = wait_for_marks(tmp_path, "running", 2, process)
        sent = time.monotonic()
        process.send_signal(signum)
        output, _ = process.communicate(timeout=60)
        stopped_in = time.monotonic() - sent
    finally:
        process.kill()
    # Within the grace a process runner gives before SIGKILL (30 s). That the ranks left on the
    # flag, not by the supervisor's restart after its grace, assert_workers_free checks below
    # (the same workers, none restarted): the decision, not the seconds, on a busy machine.
    assert stopped_in < 30, f"{stopped_in:.1f}s\n{output[-3000:]}"
    assert len(wait_for_marks(tmp_path, "left", 2, timeout_s=5)) == 2  # (still training before the fix)
    run = read_flow_run(flow_run_id)
    assert run.state.type.value == "CRASHED" and run.state.message == crash_message
    assert_ranks_cancelled(flow_run_id)
    assert_workers_free(address, before)


SWEEP_PROCESS = """
import json, sys
from tests.support.gang_functions import sweep_flow
sweep_flow(**json.loads(sys.argv[1]))
"""


HYPERPARAMETER_SWEEP_PROCESS = """
import json, sys
from prefect_ddp.flows.sweep import hyperparameter_sweep
from prefect_ddp.tasks.config import ClusterConfig, DataConfig, ModelConfig, OutputConfig, TrainingConfig
from prefect_ddp.tasks.sweeps.sweep import SweepSettings
given = json.loads(sys.argv[1])
hyperparameter_sweep(
    space={"training.lr": {"kind": "grid", "values": [0.001, 0.002]}},
    settings=SweepSettings(name="cancelled", n_trials=2, concurrency=2, sampler="grid", pruner="none"),
    data=DataConfig(url=given["images"], index_cache_minutes=0), model=ModelConfig(backbone="mobilenet_v3_small"),
    training=TrainingConfig(epochs=500, batch_size=4, image_size=32, num_workers=0),
    cluster=ClusterConfig(address=given["address"], init_timeout_s=60),  # max_restarts as by default: 1
    output=OutputConfig(url=given["output"]),
)
"""


def rank_runs_started_after(moment: datetime) -> list:
    with get_client(sync_client=True) as api:
        return api.read_task_runs(task_run_filter=TaskRunFilter(
            name=TaskRunFilterName(like_="rank-"), start_time=TaskRunFilterStartTime(after_=moment)))


@pytest.mark.slow
def test_a_cancelled_sweep_on_default_settings_leaves_no_rank_running_and_forms_no_gang_again(dask_cluster, tmp_path):
    """SIGTERM reaches the sweep's main thread; its trials' gangs run in other threads and
    would, with max_restarts=1, take their ranks' stop for a failure and form again."""
    address = dask_cluster.scheduler_address
    before = worker_addresses(address)
    local_image_folder(tmp_path / "images", per_class=8)
    given = {"images": str(tmp_path / "images"), "address": address, "output": str(tmp_path / "out")}
    started = datetime.now(timezone.utc)
    process = subprocess.Popen([sys.executable, "-c", HYPERPARAMETER_SWEEP_PROCESS, json.dumps(given)], cwd=REPO,
                               env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + RANKS_START_S
        while len(training := [r for r in rank_runs_started_after(started) if r.state and r.state.is_running()]) < 2:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0][-3000:]
            time.sleep(0.5)
        sent = datetime.now(timezone.utc)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    time.sleep(5)  # for the server to record a rank started just before the process ended
    assert rank_runs_started_after(sent) == [], output[-3000:]  # no gang formed again
    for trial_run in {run.flow_run_id for run in training}:
        assert [r.state.type.value for r in rank_task_runs(trial_run, expected=1)] == ["CANCELLED"]
        assert_no_task_run_left_running(trial_run)
    assert_workers_free(address, before)


def test_a_second_sweep_of_the_same_name_is_refused_the_first_runs_on_and_sigterm_stops_the_gangs_of_all_its_trials(
        dask_cluster, tmp_path):
    """Before, the second marked the first's running trials failed and queued them again;
    the first then crashed on Optuna's UpdateFinishedTrialError. Then SIGTERM to the first: the
    signal reaches the sweep's main thread, and the trials' gangs, which run in other threads, stop.

    One sweep process for both decisions (they were two tests, each starting the same sweep process
    and ending it with SIGTERM): the refused second sweep touches neither the first's trials nor
    its flow run, so the first's stop is the one a lone sweep's would be."""
    address = dask_cluster.scheduler_address
    before = worker_addresses(address)
    parameters = {"address": address, "marks": str(tmp_path), "trials": 2, "name": "twice"}
    process = subprocess.Popen([sys.executable, "-c", SWEEP_PROCESS, json.dumps(parameters)], cwd=REPO,
                               env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        flow_run_id, _ = wait_for_marks(tmp_path, "running", 2, process)
        second = sweep_flow(**parameters | {"lease_timeout_s": 5}, return_state=True)
        assert second.is_failed()
        with pytest.raises(SweepAlreadyRunning, match=r"Sweep 'twice' is running now in flow run \S+ \(seen \d+ s ago\): "
                           r"a second sweep of the same name would mark its running trials failed.*another settings.name"):
            second.result()
        study = optuna.load_study(study_name="twice", storage=f"sqlite:///{tmp_path}/twice/study.db")
        assert [t.state for t in study.trials] == [TrialState.RUNNING, TrialState.RUNNING]  # untouched
        assert process.poll() is None  # the first trains on
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert "UpdateFinishedTrialError" not in output, output[-3000:]
    assert set(wait_for_marks(tmp_path, "left", 2, timeout_s=5)) == {"GangStopped"}, output[-3000:]
    runs = assert_no_task_run_left_running(flow_run_id)
    assert [r.state.type.value for r in runs if r.name.startswith("rank-")] == ["CANCELLED", "CANCELLED"]
    assert_workers_free(address, before)


def test_a_rank_cancelled_in_dask_stops_the_gang_and_its_peers_leave_cleanly(dask_cluster, tmp_path):
    address = dask_cluster.scheduler_address
    before = worker_addresses(address)
    state = gang_flow(address, "loop", {"marks": str(tmp_path), "cancel_own_future": True}, return_state=True)
    with pytest.raises(GangError, match=r"^Rank 1 on tcp://\S+ was cancelled in Dask before it finished"):
        state.result()
    # The first rank to read the flag leaves with GangStopped; its peer, when it waited in
    # the step's collective by then, on the closed connection.
    assert "GangStopped" in wait_for_marks(tmp_path, "left", 2, timeout_s=5)
    runs = assert_no_task_run_left_running(state.state_details.flow_run_id)
    assert {r.name: r.state.type.value for r in runs}["rank-0"] == "CANCELLED"
    assert_workers_free(address, before)


class SecondSubmitFails(DaskTaskRunner):
    """A real DaskTaskRunner whose second submit fails once the first rank runs, as a
    connection lost half-way through submitting a gang would."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.submitted: list[PrefectDaskFuture] = []

    def submit(self, task, parameters, wait_for=None, dependencies=None) -> PrefectDaskFuture:
        if self.submitted:
            wait_until_running(self.submitted[0].task_run_id)
            raise ConnectionError("lost the scheduler while submitting rank 1 (test)")
        self.submitted.append(super().submit(task, parameters, wait_for, dependencies))
        return self.submitted[0]


def wait_until_running(task_run_id) -> None:
    deadline = time.monotonic() + RANKS_START_S
    with get_client(sync_client=True) as api:
        while True:
            try:
                state = api.read_task_run(task_run_id).state
                if state is not None and state.is_running():
                    return
            except ObjectNotFound:  # recorded from its events, a moment late (and its state later still)
                pass
            assert time.monotonic() < deadline, "rank 0 never started"
            time.sleep(0.2)


@flow(name="gang-half-submitted")
def half_submitted_gang(address: str) -> list:
    with SecondSubmitFails(address=address) as runner:
        return run_gang(report_rank, {}, task_runner=runner)


def test_a_submit_failing_half_way_still_stops_the_ranks_already_submitted(dask_cluster):
    address = dask_cluster.scheduler_address
    state = half_submitted_gang(address, return_state=True)
    with pytest.raises(ConnectionError, match="lost the scheduler while submitting rank 1"):  # not masked
        state.result()
    # Rank 0 waited in the rendezvous for a rank 1 that never came; it was stopped, not
    # left RUNNING until its init timeout.
    runs = assert_no_task_run_left_running(state.state_details.flow_run_id)
    assert [(r.name, r.state.type.value) for r in runs] == [("rank-0", "CRASHED")]
    results = gang_flow(address, "report", {}, lease_timeout_s=5)  # both workers are free
    assert [r["rank_sum"] for r in results] == [1.0, 1.0]


CTX = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo", device="cpu",
                  worker_address="local", master_addr="127.0.0.1", master_port=0)


@pytest.mark.unit
def test_check_stop_does_nothing_outside_a_dask_worker_or_without_a_flag():
    assert CTX.check_stop() is None
    assert replace(CTX, stop_flag="prefect-ddp-stop:x").check_stop() is None
    assert issubclass(GangStopped, GangError)


def test_check_stop_costs_a_scheduler_round_trip_a_second_and_sees_the_flag_within_one(dask_cluster):
    with distributed.Client(dask_cluster.scheduler_address) as client:
        flag = StopFlag(client)
        ctx = replace(CTX, stop_flag=flag.name)
        calm = client.submit(call_check_stop, ctx, 0.5, pure=False).result()
        # A round trip takes a millisecond or more: one per call would allow a few hundred.
        assert calm["stopped_after_s"] is None and calm["calls"] > 5000, calm
        flag.set()
        try:
            stopped = client.submit(call_check_stop, ctx, 5, pure=False).result()
        finally:
            flag.remove()
    assert stopped["stopped_after_s"] is not None and stopped["stopped_after_s"] < READ_EVERY_S + 0.5, stopped


def wait_for_flow_run_state(flow_run_id, final_type: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (run := read_flow_run(flow_run_id)).state.type.value != final_type:
        assert time.monotonic() < deadline, f"flow run still {run.state.type.value} after {timeout_s}s"
        time.sleep(0.5)


@pytest.mark.slow
def test_cancelling_a_deployment_run_stops_its_ranks(deployments, dask_cluster, tmp_path):
    """The UI's Cancel: the API sets the run Cancelling, and the process worker that started
    the run's process sends it SIGTERM (30 s before SIGKILL); the flow ends Cancelled."""
    address = dask_cluster.scheduler_address
    before = worker_addresses(address)
    # By module path, so that the ranks find the functions the flow names (by file path the
    # module would be "gang_functions", which the Dask workers cannot import).
    gang_flow.from_source(source=str(REPO), entrypoint="tests.support.gang_functions.gang_flow").deploy(
        name="stop-on-cancel", work_pool_name=POOL, print_next_steps=False,
    )
    run = run_deployment("gang-test/stop-on-cancel", timeout=0, parameters={
        "address": address, "fn_name": "loop", "config": {"marks": str(tmp_path)},
    })
    wait_for_marks(tmp_path, "running", 2)
    with get_client(sync_client=True) as api:
        api.set_flow_run_state(run.id, Cancelling(message="Cancelled from the UI (test)"))
    # The worker hears of the Cancelling state within seconds (an event, or its own poll), then the
    # flow stops its ranks within FAILURE_GRACE_S: a generous deadline over both, on a busy machine.
    wait_for_flow_run_state(run.id, "CANCELLED", timeout_s=FAILURE_GRACE_S + 120)
    assert len(wait_for_marks(tmp_path, "left", 2, timeout_s=5)) == 2
    assert_ranks_cancelled(run.id)
    assert_workers_free(address, before)


@task
def recorded_late() -> None:
    """Stands for a rank whose task run the server records only after the gang has stopped."""


def test_a_started_ranks_task_run_recorded_after_its_gang_stopped_is_crashed_once_recorded(prefect_api, caplog):
    """The server records a task run from its worker's events, and its recorder retries a write its
    database refused at the next flush: under load a started rank's run was recorded after the
    supervisor's 5-s wait, never crashed, and stayed RUNNING (CI). Such runs are crashed once recorded,
    up to their deadline; one never recorded by then is named in a warning."""
    late, lost = uuid.uuid4(), uuid.uuid4()

    def record() -> None:
        with get_client(sync_client=True) as api:
            api.create_task_run(recorded_late, None, str(late), id=late, state=Running())

    # In the test's settings (the session's server), which a thread sees only in a copy of its context.
    recorder = threading.Timer(2, contextvars.copy_context().run, [record])
    recorder.start()
    with caplog.at_level(logging.WARNING, logger="prefect_ddp"):
        crash_when_recorded({late: time.monotonic() + 60, lost: time.monotonic() + 4})
    recorder.join()
    with get_client(sync_client=True) as api:
        assert api.read_task_run(late).state.type.value == "CRASHED"
    assert f"had not recorded the task runs ['{lost}'] of ranks that had started when their gang stopped" in caplog.text
