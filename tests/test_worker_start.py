"""Workers of the project's CPU clusters are forked from a forkserver that imported torch once,
and still start as spawned workers did: this process's environment, the flow's Prefect API,
spawn as the default start method of what they start (blocks/worker_forkserver.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import distributed
import psutil
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from prefect_ddp.blocks.cluster import create_local_cluster
from prefect_ddp.blocks.nanny_environment import GIVEN_NAMES, leave_only_given
from prefect_ddp.blocks.worker_forkserver import FORKSERVER_PRELOAD
from prefect_ddp.tasks.reporting import flow_api_url
from tests.support.gang_functions import child_pids


def parent_command_line() -> list[str]:
    return psutil.Process().parent().cmdline()


def prefect_api_url() -> str | None:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def environment(*names: str) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


def loader_children_left() -> dict[str, object]:
    """Read a batch through a DataLoader that names no start method, then see what it left running."""
    before = child_pids()
    total = sum(float(batch[0].sum()) for batch in DataLoader(TensorDataset(torch.arange(8.0)), num_workers=1))
    return {"method": multiprocessing.get_start_method(), "sum": total,
            "left": sorted(set(child_pids()) - set(before))}


def test_workers_are_forked_from_a_forkserver_that_imported_torch_and_torchvision(dask_cluster):
    with distributed.Client(dask_cluster.scheduler_address) as client:
        parents = client.run(parent_command_line)
    assert len(parents) == 2
    for command_line in parents.values():
        server = " ".join(command_line)
        assert "multiprocessing.forkserver" in server, command_line
        assert all(repr(module) in server for module in FORKSERVER_PRELOAD), command_line


def test_forked_workers_report_to_the_flows_prefect_api_and_start_loaders_as_spawned_ones_did(dask_cluster):
    """Prefect reads PREFECT_API_URL once, on import: the forkserver must not have imported it."""
    with distributed.Client(dask_cluster.scheduler_address) as client:
        urls = client.run(prefect_api_url)
        loaders = client.run(loader_children_left)
    assert set(urls.values()) == {flow_api_url()}
    for worker, seen in loaders.items():
        assert seen == {"method": "spawn", "sum": 28.0, "left": []}, (worker, seen)


def test_a_cluster_started_later_gets_this_process_s_environment_of_that_moment(dask_cluster, monkeypatch):
    """The forkserver kept the environment of the session cluster's start; a variable set since
    reaches the new cluster's workers, and one of Dask's pre-spawn defaults (OMP_NUM_THREADS=1)
    set here wins over the default, as with spawn."""
    monkeypatch.setenv("SET_AFTER_THE_FORKSERVER", "seen")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    with create_local_cluster(n_workers=1) as cluster, distributed.Client(cluster) as client:
        seen = client.run(environment, "SET_AFTER_THE_FORKSERVER", "OMP_NUM_THREADS")
    assert list(seen.values()) == [{"SET_AFTER_THE_FORKSERVER": "seen", "OMP_NUM_THREADS": "7"}]


@pytest.mark.unit
def test_a_worker_drops_what_it_inherited_that_its_nanny_did_not_give_and_the_list_with_it():
    inherited = {"FROM_THE_FORKSERVER": "stale", "GIVEN": "1", GIVEN_NAMES: json.dumps(["GIVEN"])}
    assert leave_only_given(inherited) == ["FROM_THE_FORKSERVER"]
    assert inherited == {"GIVEN": "1"}
    assert leave_only_given(inherited) == [] and inherited == {"GIVEN": "1"}  # outside such a worker: nothing


def test_a_restarted_or_added_worker_gets_the_environment_of_its_start_and_no_spec_holds_it():
    """Issue 56: each nanny held a copy of the environment made when the cluster was created, so a
    worker restarted (after a killed rank) or added (the warm cluster's scale) got that copy back: a
    changed variable reverted, an added one was missing, a removed credential was still there; and
    every secret of the environment sat in `cluster.worker_spec`. Run from a script that imports the
    project at its top, as a user's does: a forked worker imports it before its nanny's environment
    is applied, and the pruning once ran only then, doing nothing; and Prefect, imported with it,
    kept a removed setting (the break-it reviews of issue 56)."""
    script = subprocess.run([sys.executable, str(Path(__file__).parent / "support" / "environment_script.py")],
                            capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert script.returncode == 0, script.stderr[-3000:]
    seen = json.loads(script.stdout.strip().splitlines()[-1])
    assert seen["started"] == {"CHANGED_LATER": "before", "REMOVED_SECRET": "s3cr3t-value", "ADDED_LATER": None,
                               "OMP_NUM_THREADS": "1", "prefect_max_retries": 7, "child_given_names": "None"}
    assert not seen["spec_holds_secret"]
    assert seen["later"] == [{"CHANGED_LATER": "after", "REMOVED_SECRET": None, "ADDED_LATER": "seen",
                              "OMP_NUM_THREADS": "1", "prefect_max_retries": 5, "child_given_names": "None"}] * 2
