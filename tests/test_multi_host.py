"""Ranks on separate hosts: the flow on a Dask cluster whose scheduler and two workers each
run in a network namespace of their own (tests/support/netns.py), with data and output on S3.

Every other test runs its ranks on one host, where the master address is loopback and
would work by accident. Here rank 0's address must be its host's address, gloo must
connect across the bridge, and a worker killed mid-training must be survived as on one
host: the nanny restarts it, the gang is re-formed and resumes from the checkpoint.

The session's Prefect and moto servers listen on the root namespace's 127.0.0.1, out of
the hosts' reach. Rather than start a second pair of servers on the bridge (the Prefect
server alone takes 11-14 s), a relay on the bridge address forwards to each; the flow
itself uses the relayed API URL, as a flow on a real cluster uses one every host reaches:
Prefect ships the flow's settings, its API URL included, with every task it sends to a
worker (prefect.context.serialize_context).
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import distributed
import psutil
import pytest
import s3fs
import yaml
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL, temporary_settings

from prefect_ddp.blocks.cluster import TRAINING_DASK_CONFIG
from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.gang.plan import host_of
from tests.support.api_helpers import all_logs, assert_no_task_run_left_running, send_held_logs_and_events
from tests.conftest import BUCKET
from tests.support.flow_runs import block_copy, run_tiny_flow
from tests.support.netns import Network, forward, network, unavailable

REPO = Path(__file__).resolve().parent.parent
DASK = str(Path(sys.executable).with_name("dask"))
SCHEDULER_PORT = 8786  # free: the scheduler's host is a namespace of its own
WORKERS = ("worker-a", "worker-b")
KILLED = "worker-b"
EPOCHS = 2
DATA_BLOCK = "netns-images"  # the session's test images, at the S3 relay's address
START_TIMEOUT_S = 60
ATTEMPT_LINE = re.compile(r"Gang attempt (\d+): \d+ ranks on \[([^\]]*)\], backend \w+, master (\S+):\d+")


@dataclass(frozen=True)
class Hosts:
    """The running cluster in its namespaces, and the session's servers as the hosts reach them."""

    net: Network
    scheduler_address: str
    nannies: dict[str, subprocess.Popen]
    api_url: str


def dask_config_file(folder: Path) -> Path:
    """TRAINING_DASK_CONFIG as a Dask config file, for DASK_CONFIG: set up as the project's own
    clusters are (non-daemonic, no MALLOC_TRIM_THRESHOLD_, no profiler). A file, since an
    environment variable lower-cases the key MALLOC_TRIM_THRESHOLD_ and so misses it."""
    tree: dict[str, Any] = {}
    for dotted, value in TRAINING_DASK_CONFIG.items():
        *parents, leaf = dotted.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path = folder / "dask.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.fixture
def hosts(prefect_api: str, s3_endpoint: str, image_location: DataLocation, tmp_path: Path) -> Iterator[Hosts]:
    """A scheduler and two nanny-managed workers, each on a host of its own; removed after the test."""
    if reason := unavailable():
        pytest.skip(f"multi-host test needs network namespaces: {reason}")
    with network(["scheduler", *WORKERS]) as net, forward(prefect_api, net.gateway) as api_url, \
            forward(s3_endpoint, net.gateway) as s3_url:
        block_copy(image_location, endpoint_url=s3_url).save(DATA_BLOCK, overwrite=True)
        # A worker inherits its nanny's environment, whatever the nanny's config drops.
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_TRIM_THRESHOLD_"} | {
            "DASK_CONFIG": str(dask_config_file(tmp_path)),
            "PREFECT_API_URL": api_url,
        }
        # No GLOO_SOCKET_IFNAME: this machine's hostname resolves to 127.0.0.1, as Debian's
        # 127.0.1.1 line makes it on many real hosts, and the ranks must pick the interface of
        # their worker's address themselves (prefect_ddp.tasks.gang.process_group.choose_gloo_interface).
        env.pop("GLOO_SOCKET_IFNAME", None)
        scheduler = net.hosts["scheduler"].address
        net.start("scheduler", [DASK, "scheduler", "--host", scheduler, "--port", str(SCHEDULER_PORT),
                                "--no-dashboard"], tmp_path / "scheduler.log", env, REPO)
        address = f"tcp://{scheduler}:{SCHEDULER_PORT}"
        # One core each, as separate hosts would have: a rank sets its torch threads from
        # the cores it may use, and two ranks each running 2 threads on these 2 shared cores
        # made an epoch 10x slower here.
        cores = sorted(os.sched_getaffinity(0))
        nannies = {
            name: net.start(
                name, ["taskset", "-c", str(cores[index % len(cores)]), DASK, "worker", address, "--nanny",
                       "--host", net.hosts[name].address, "--nthreads", "1", "--no-dashboard",
                       "--local-directory", str(tmp_path / name)],
                tmp_path / f"{name}.log", env, REPO,
            )
            for index, name in enumerate(WORKERS)
        }
        with distributed.Client(address, timeout=START_TIMEOUT_S) as client:  # retries until the scheduler listens
            client.wait_for_workers(len(WORKERS), timeout=START_TIMEOUT_S)
        try:
            yield Hosts(net, address, nannies, api_url)
        finally:
            # Before the relay closes, whether the test passed or not.
            send_held_logs_and_events()


def worker_pid(hosts: Hosts, name: str) -> int:
    """The pid of the worker process (not its nanny) on host `name`."""
    with distributed.Client(hosts.scheduler_address) as client:
        pids = client.run(os.getpid)
    (pid,) = [pid for address, pid in pids.items() if host_of(address) == hosts.net.hosts[name].address]
    assert psutil.Process(pid).ppid() == hosts.nannies[name].pid, "not a worker its nanny started"
    return pid


def kill_after_first_checkpoint(fs: s3fs.S3FileSystem, prefix: str, pid: int, flow_ended: threading.Event,
                                seen: dict[str, Any]) -> None:
    """SIGKILL `pid` as soon as the run's first checkpoint is on S3: mid-training, most often
    with an epoch still to go (an epoch takes seconds here, a look at S3 milliseconds; on a
    loaded machine the look took longer than the last epoch)."""
    while not flow_ended.is_set():
        fs.invalidate_cache()  # s3fs would answer from the listing it cached before the run wrote
        if fs.glob(f"{prefix}/*/checkpoints/checkpoint.pt"):
            os.kill(pid, signal.SIGKILL)
            seen["killed"] = pid
            return
        time.sleep(0.05)


def run_log(flow_run_id) -> list[str]:
    """The run's log messages, once the second gang attempt's line is in."""
    with get_client(sync_client=True) as api:
        return [log.message for log in all_logs(api, flow_run_id, "Gang attempt 2")]


def gang_attempts_logged(messages: list[str]) -> dict[int, tuple[list[str], str]]:
    """What the log says of each gang attempt: its workers in rank order and the master host."""
    return {int(m[1]): ([w.strip(" '") for w in m[2].split(",")], m[3])
            for message in messages if (m := ATTEMPT_LINE.search(message))}


@pytest.mark.slow
def test_ranks_on_two_hosts_train_meet_at_rank_0s_address_and_survive_a_killed_worker(hosts: Hosts, s3_fs):
    prefix = f"{BUCKET}/netns-outputs"
    killed_pid = worker_pid(hosts, KILLED)
    seen: dict[str, Any] = {}
    flow_ended = threading.Event()
    killer = threading.Thread(target=kill_after_first_checkpoint, args=(s3_fs, prefix, killed_pid, flow_ended, seen),
                              daemon=True)
    killer.start()
    with temporary_settings({PREFECT_API_URL: hosts.api_url}):
        try:
            state = run_tiny_flow(
                f"s3://{prefix}", {"address": hosts.scheduler_address, "world_size": 2, "max_restarts": 1},
                data={"block": DATA_BLOCK}, training={"epochs": EPOCHS},
            )
        finally:
            flow_ended.set()
            killer.join()
        assert state.is_completed(), f"{state.type.value}: {state.message}"
        assert seen.get("killed") == killed_pid, "the run completed, but no worker was killed after its first checkpoint"
        summary = state.result()
        flow_run_id = state.state_details.flow_run_id
        messages = run_log(flow_run_id)
        assert_no_task_run_left_running(flow_run_id)
    # The gang's own worker checks found the workers set up as the project's clusters are.
    assert not [m for m in messages if m.startswith("Worker setup:")]

    logged = gang_attempts_logged(messages)
    worker_hosts = {hosts.net.hosts[name].address for name in WORKERS}
    first, second = summary["attempts"]
    for attempt in (first, second):
        assert attempt["world_size"] == 2 and {host_of(w) for w in attempt["workers"]} == worker_hosts, attempt
        # The master is rank 0's host: the address its peers on the other host reach it at.
        workers, master = logged[attempt["number"]]
        assert workers == attempt["workers"] and master == host_of(workers[0]), (logged, attempt)
        assert not ipaddress.ip_address(master).is_loopback
    # The nanny restarted the killed worker (a new port on the same host); the re-formed
    # gang resumed from a checkpoint the first wrote: epoch 1's, or epoch 2's where the
    # kill came late (seen under load), never from the start.
    assert first["ended"] != "completed" and second["ended"] == "completed", summary["attempts"]
    assert set(second["workers"]) != set(first["workers"])
    assert 1 <= second["resumed_after_epoch"] <= EPOCHS, second
    assert [h["epoch"] for h in summary["history"]] == list(range(1, EPOCHS + 1))
    assert summary["files"]["model.pt"].startswith(f"s3://{prefix}/")
    s3_fs.invalidate_cache()
    assert s3_fs.exists(summary["files"]["model.pt"])
    report = s3_fs.cat(summary["files"]["report.md"]).decode()
    assert "The gang was re-formed: 2 attempts" in report
