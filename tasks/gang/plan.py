"""Before a gang forms: which workers exist, a free port for the master, who is which rank on which device."""

from __future__ import annotations

import socket
from typing import Any
from urllib.parse import urlparse

import distributed

from tasks.gang.context import RankContext
from tasks.gang.trial import TrialLink
from tasks.gang.errors import GangRefused
from tasks.process_group import default_backend


def cluster_workers(client: distributed.Client) -> list[str]:
    """The address of every worker of the cluster: the one place the gang reads the worker set.

    `scheduler_info()` returns only 5 workers by default on distributed 2025.4 to 2026.6
    (dask/distributed#9045, undone in #9308), which made a gang on more workers see live
    ones as gone. Older versions take no `n_workers` but accept and ignore keywords, and
    return every worker.
    """
    return list(client.scheduler_info(n_workers=-1)["workers"])


def free_port() -> int:
    """A TCP port free right now on this host, for the rank-0 store to listen on.

    Bound dual-stack where the host has IPv6 (free on IPv4 and IPv6 alike, as torch's
    TCPStore listens on both), IPv4 where it has no IPv6, IPv6 where it has no IPv4.
    """
    if socket.has_dualstack_ipv6():
        server = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    else:
        try:
            server = socket.create_server(("", 0), family=socket.AF_INET)
        except OSError:  # an IPv6-only host
            server = socket.create_server(("::", 0), family=socket.AF_INET6)
    with server:
        return server.getsockname()[1]


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


def gpu_devices(per_host: dict[str, list[str]], probes: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Each rank's CUDA device where every rank has one; GangRefused where ranks would share one.

    dask-cuda starts one worker per GPU and puts that GPU first in the worker's
    CUDA_VISIBLE_DEVICES, so each worker's cuda:0 is a GPU of its own (it still sees the
    others, after it). Plain `dask worker`s on a multi-GPU host all see the same GPUs in
    the same order: there the local rank picks one. GPUs are told apart by UUID.
    """
    devices: dict[str, str] = {}
    for host, workers in per_host.items():
        seen = [probes[a]["gpus"] for a in workers]
        if len({gpus[0] for gpus in seen}) == len(workers):  # each has a cuda:0 of its own
            devices.update((a, "cuda:0") for a in workers)
        elif all(gpus == seen[0] for gpus in seen) and len(workers) <= len(seen[0]):
            devices.update((a, f"cuda:{local_rank}") for local_rank, a in enumerate(workers))
        else:
            raise GangRefused(
                f"{len(workers)} ranks on host {host} ({', '.join(workers)}) cannot each have a GPU of "
                f"their own: their workers see {', '.join(str(len(g)) for g in seen)} GPU(s), not "
                "one each, nor the same ones in the same order. Start one worker per GPU with "
                "dask-cuda (`dask cuda worker tcp://<scheduler>:8786`), or give each `dask worker` "
                "its own GPU (CUDA_VISIBLE_DEVICES=0, 1, ...)."
            )
    return devices


def plan_ranks(
    addresses: list[str], probes: dict[str, dict[str, Any]], port: int, attempt: int,
    output_url: str | None, init_timeout_s: float, trial: TrialLink | None = None,
    stop_flag: str | None = None,
) -> list[RankContext]:
    """One context per address: rank order, local ranks and devices per host, backend and master.

    Raises GangRefused, before any rank starts, where ranks would share a GPU.
    """
    per_host = hosts(addresses)
    cuda_everywhere = all(probes[a]["cuda"] for a in addresses)
    devices = gpu_devices(per_host, probes) if cuda_everywhere else dict.fromkeys(addresses, "cpu")
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
        )
        for rank, address in enumerate(addresses)
    ]
