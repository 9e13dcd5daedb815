"""Before a gang forms: which workers exist, who is which rank on which device."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any
from urllib.parse import urlparse

import distributed

from prefect_ddp.tasks.gang.context import RankContext
from prefect_ddp.tasks.gang.errors import GangRefused
from prefect_ddp.tasks.gang.gpu_claims import ONE_GPU_PER_WORKER, GpuClaim
from prefect_ddp.tasks.gang.process_group import default_backend
from prefect_ddp.tasks.gang.trial import TrialLink

logger = logging.getLogger(__name__)


def cluster_workers(client: distributed.Client) -> list[str]:
    """The address of every worker of the cluster: the one place the gang reads the worker set.

    Asked of the scheduler itself, not read from `client.scheduler_info()`: that returns
    the client's cached copy, which the client's own periodic refresh overwrites with a
    copy of no workers (it asks for `n_workers=0`). A read that raced with the refresh came
    back with an empty cluster: a gang refused to form ("the cluster has 0"), and the
    supervisor took live workers for gone. `scheduler_info()` also showed only 5 workers
    by default on distributed 2025.4 to 2026.6 (dask/distributed#9045).
    """
    addresses: list[str] = client.run_on_scheduler(_worker_addresses)
    return addresses


def _worker_addresses(dask_scheduler: Any = None) -> list[str]:
    return list(dask_scheduler.workers)


def cpu_set() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity; all of the host's where there is none)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return tuple(range(os.cpu_count() or 1))


def thread_shares(cpu_sets: dict[str, tuple[int, ...]], addresses: list[str]) -> dict[str, int]:
    """Torch threads for a rank on each of `addresses`: its worker's CPUs over every worker of
    the cluster on the same host that may run on the same CPUs.

    Every worker, not only this gang's ranks: a sweep's trials and concurrent runs are other
    gangs on the host's other workers, and two single-rank gangs that each took all of a
    2-core host's threads trained 5x slower per step than with one thread each (and 20x in
    a loaded test run: docs/architecture.md, "Gang: rendezvous"). Workers pinned to other CPUs
    (dask-cuda's per-GPU affinity) do not count against each other. `cpu_sets` holds the
    CPUs of the gang's workers (their probes) and of the others that answered
    (`bystander_cpu_sets`).
    """
    sharing: dict[tuple[str, tuple[int, ...]], int] = {}
    for address, cpus in cpu_sets.items():
        key = (host_of(address), cpus)
        sharing[key] = sharing.get(key, 0) + 1
    return {address: max(1, len(cpu_sets[address]) // sharing[(host_of(address), cpu_sets[address])])
            for address in addresses}


# How long the gang waits for the other workers' CPUs (bystander_cpu_sets).
BYSTANDER_TIMEOUT_S = 5.0


def bystander_cpu_sets(client: distributed.Client, gang: list[str]) -> dict[str, tuple[int, ...]]:
    """The CPUs of the cluster's workers outside `gang`, or none where they do not all answer
    within BYSTANDER_TIMEOUT_S.

    Bounded: a frozen worker (SIGSTOP, a host stuck in swap) accepts the connection and never
    answers, and an unbounded `client.run` held every later gang of the cluster until the
    scheduler dropped that worker, 5 minutes by default. Left out, the others' ranks are not
    counted, and the gang's ranks take more threads than their share; a frozen worker uses no
    CPU anyway. A worker that raises is left out too.
    """
    others = [address for address in cluster_workers(client) if address not in gang]
    if not others:
        return {}
    answers: dict[str, tuple[int, ...]] = {}

    def ask() -> None:
        try:
            answers.update(client.run(cpu_set, workers=others, on_error="ignore"))
        except Exception:  # a worker closed while asked (the broadcast's CommClosedError): none counted
            logger.debug("The other workers' CPUs could not be asked", exc_info=True)

    asking = threading.Thread(target=ask, name="bystander-cpus", daemon=True)
    asking.start()
    asking.join(BYSTANDER_TIMEOUT_S)
    return dict(answers)


def host_of(address: str) -> str:
    """The bare host of a worker address: `10.0.0.5`, `node-3`, or `::1` (no brackets)."""
    return urlparse(address).hostname or address


def by_host(addresses: list[str]) -> list[str]:
    """Worker addresses grouped by host, so the ranks on one host get contiguous numbers."""
    return sorted(addresses, key=lambda a: (host_of(a), a))


def hosts(addresses: list[str]) -> dict[str, list[str]]:
    """The addresses on each host, in the given (rank) order."""
    per_host: dict[str, list[str]] = {}
    for address in addresses:
        per_host.setdefault(host_of(address), []).append(address)
    return per_host


def gpu_devices(addresses: list[str], probes: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Each rank's CUDA device: the GPU its worker process claimed; GangRefused where it has none or ranks share one.

    A device belongs to a worker for the worker's whole life, not to a gang
    (tasks/gang/gpu_claims.py): each claims one on its first probe, so gangs that share a
    host get disjoint GPUs. The claim is in the worker's own numbering, which dask-cuda's
    CUDA_VISIBLE_DEVICES makes differ between workers; the UUID names the GPU everywhere.
    Two ranks that hold one UUID are workers whose claims could not see each other (one
    process for both, or separate claim folders).
    """
    claims: dict[str, GpuClaim] = {a: probes[a]["gpu_claim"] for a in addresses}
    holders: dict[str, list[str]] = {}
    for address, claim in claims.items():
        if claim.uuid is None:
            raise GangRefused(f"Worker {address} on host {host_of(address)} has no GPU of its own: {claim.why_none}")
        holders.setdefault(claim.uuid, []).append(address)
    shared = [f"{uuid} is held by the workers of {len(workers)} ranks ({', '.join(workers)})"
              for uuid, workers in holders.items() if len(workers) > 1]
    if shared:
        raise GangRefused(
            f"Ranks would share a GPU: {'; '.join(shared)}. Their claims could not see each other: the "
            "workers run in one process (LocalCluster(processes=False)), or keep their claims in "
            f"different folders (another HOME, another container). {ONE_GPU_PER_WORKER}"
        )
    return {address: claim.device for address, claim in claims.items()}


def plan_ranks(
    addresses: list[str], probes: dict[str, dict[str, Any]], port: int, attempt: int,
    output_url: str | None, init_timeout_s: float, trial: TrialLink | None = None,
    stop_flag: str | None = None, leases: dict[str, str] | None = None, gang_id: str | None = None,
    max_world_size: int | None = None, elastic: bool = False, regroups: int = 0,
) -> list[RankContext]:
    """One context per address: rank order, local ranks and devices per host, backend and master;
    `leases`: {address: lease id} of the gang's leases (lease.leased_workers).

    Raises GangRefused, before any rank starts, where ranks would share a GPU.
    """
    per_host = hosts(addresses)
    cuda_everywhere = all(probes[a]["cuda"] for a in addresses)
    devices = gpu_devices(addresses, probes) if cuda_everywhere else dict.fromkeys(addresses, "cpu")
    return [
        RankContext(
            rank=rank,
            local_rank=per_host[host_of(address)].index(address),
            world_size=len(addresses),
            local_world_size=len(per_host[host_of(address)]),
            backend=default_backend(cuda_everywhere),
            device=devices[address],
            worker_address=address,
            # The bare host of the worker rank 0 runs on (the one its peers connect to),
            # never loopback for a worker on another host; process_group adds brackets.
            master_addr=host_of(addresses[0]),
            master_port=port,
            attempt=attempt,
            output_url=output_url,
            init_timeout_s=init_timeout_s,
            trial=trial,
            stop_flag=stop_flag,
            lease=(leases or {}).get(address),
            gang_id=gang_id,
            # An elastic gang's top, None for every worker of the cluster; a fixed gang's own size.
            max_world_size=max_world_size if elastic else len(addresses),
            elastic=elastic,
            regroups=regroups,
        )
        for rank, address in enumerate(addresses)
    ]
