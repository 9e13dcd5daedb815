"""GPUs belong to worker processes, not gangs: real Dask worker processes on a simulated 4-GPU host.

No GPU is needed: each worker runs the real probe with four made-up GPU UUIDs in place of
torch's, and claims one through real file locks in a folder of the test's own, so the
claims of other test runs on this machine never meet these. The last test uses plain
processes: a claim must end with its process even while a child forked from it lives.
"""

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import distributed
import pytest

from prefect_ddp.tasks.gang import GangRefused
from prefect_ddp.tasks.gang.gpu_claims import GpuClaim, claim_gpu
from prefect_ddp.tasks.gang.lease import leased_workers
from prefect_ddp.tasks.gang.plan import by_host, cluster_workers, plan_ranks
from prefect_ddp.tasks.gang.worker_checks import probe_worker, setup_table

SIMULATED_HOST = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]


@pytest.fixture
def client(request: pytest.FixtureRequest) -> Iterator[distributed.Client]:
    """A cluster of `request.param` worker processes, each with a nanny, on this host."""
    with (distributed.LocalCluster(n_workers=request.param, threads_per_worker=1, dashboard_address=":0") as cluster,
          distributed.Client(cluster) as client):
        yield client


def probes(client: distributed.Client, addresses: list[str], claims: Path) -> dict[str, dict]:
    """The real probe of each worker, as if each saw the four GPUs of SIMULATED_HOST."""
    return client.run(probe_worker, None, SIMULATED_HOST, claims, workers=addresses)


def devices(client: distributed.Client, leases: dict[str, str], claims: Path) -> list[str]:
    """The device of each rank of a gang formed on the leased workers, probed as before every attempt."""
    gang = list(leases)
    return [ctx.device for ctx in plan_ranks(gang, probes(client, gang, claims), 1, 0, None, 30)]


def replace_worker(client: distributed.Client, address: str, count: int) -> str:
    """Restart the worker at `address` through its nanny; the new process's address."""
    before = set(cluster_workers(client))
    client.restart_workers([address])
    client.wait_for_workers(count)
    (new,) = set(cluster_workers(client)) - before
    return new


@pytest.mark.parametrize("client", [4], indirect=True)
def test_two_gangs_on_one_simulated_4_gpu_host_get_disjoint_devices(client, tmp_path):
    # Before, devices were numbered by rank within each gang: both gangs got cuda:0 and cuda:1.
    with leased_workers(client, 2, "gang B", 30) as gang_b:
        with leased_workers(client, 2, "gang A", 30) as gang_a:
            first_a, first_b = devices(client, gang_a, tmp_path), devices(client, gang_b, tmp_path)
            assert len(set(first_a + first_b)) == 4, (first_a, first_b)
            # A nanny restarts one of A's workers while B trains: a new process at a new address,
            # so its place among the host's addresses may change; B's devices must not.
            replace_worker(client, next(iter(gang_a)), count=4)
        with leased_workers(client, 2, "gang A, re-formed", 30) as gang_a:
            again_a = devices(client, gang_a, tmp_path)
        assert devices(client, gang_b, tmp_path) == first_b  # a worker's claim lasts its life
        assert set(again_a).isdisjoint(first_b) and len(set(again_a)) == 2, (again_a, first_b)


@pytest.mark.parametrize("client", [5], indirect=True)
def test_a_fifth_worker_is_refused_until_a_holder_exits_and_the_table_shows_each_claim(client, tmp_path):
    workers = by_host(cluster_workers(client))
    found = probes(client, workers, tmp_path)  # all five claim at once
    claims: dict[str, GpuClaim] = {address: probe["gpu_claim"] for address, probe in found.items()}
    assert sorted(c.uuid for c in claims.values() if c.uuid) == SIMULATED_HOST
    (refused,) = [address for address, claim in claims.items() if claim.uuid is None]
    holder_of_b = next(address for address, claim in claims.items() if claim.uuid == "GPU-b")
    with pytest.raises(GangRefused, match=rf"Worker {refused} on host 127.0.0.1 has no GPU of its own: all 4 GPU\(s\) "
                       rf"it sees are held by other processes on its host: GPU-a by worker tcp://.*, GPU-b by worker "
                       rf"{holder_of_b} \(pid \d+\), .*dask-cuda .*CUDA_VISIBLE_DEVICES=0, 1"):
        plan_ranks([refused], found, 1, 0, None, 30)
    table = setup_table(found)
    assert f"| {holder_of_b} |" in table and "| cuda:1 (GPU-b) of 4 |" in table and "| none of 4 |" in table

    newcomer = replace_worker(client, holder_of_b, count=5)  # its process ends, and its claim with it
    assert devices(client, [refused], tmp_path) == ["cuda:1"]  # the lowest GPU free again
    with pytest.raises(GangRefused, match=rf"Worker {newcomer} .* has no GPU of its own: all 4 GPU\(s\)"):
        devices(client, [newcomer], tmp_path)


def claim_fork_and_end(claims: Path, child_pid: multiprocessing.Queue) -> None:
    """A worker process that claims a GPU, forks a child that outlives it (a DataLoader worker), and ends."""
    claim_gpu(SIMULATED_HOST, "a worker that forks", claims)
    pid = os.fork()
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    child_pid.put(pid)


def test_a_claim_ends_with_its_worker_process_even_while_a_forked_child_lives(tmp_path):
    spawn = multiprocessing.get_context("spawn")
    child_pid = spawn.Queue()
    worker = spawn.Process(target=claim_fork_and_end, args=(tmp_path, child_pid))
    worker.start()
    child = child_pid.get(timeout=120)
    try:
        # Not join(): it waits on a pipe that the forked child inherited, so until the child ends.
        deadline = time.monotonic() + 120
        while worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert worker.exitcode == 0
        os.kill(child, 0)  # still alive, holding the worker's open lock file
        with ProcessPoolExecutor(1, mp_context=spawn) as newcomer:
            claim = newcomer.submit(claim_gpu, SIMULATED_HOST, "a new worker", tmp_path).result(timeout=120)
        assert claim == GpuClaim("GPU-a", 0)  # a flock would still be held by the child
    finally:
        os.kill(child, signal.SIGKILL)
