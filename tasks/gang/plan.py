"""Before a gang forms: which workers exist, what each has, a free port for the master, who is which rank."""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlparse

import distributed

from tasks.gang.context import RankContext
from tasks.gang.trial import TrialLink
from tasks.process_group import default_backend


def cluster_workers(client: distributed.Client) -> list[str]:
    """The address of every worker of the cluster: the one place the gang reads the worker set.

    `scheduler_info()` returns only 5 workers by default on distributed 2025.4 to 2026.6
    (dask/distributed#9045, undone in #9308), which made a gang on more workers see live
    ones as gone. Older versions take no `n_workers` but accept and ignore keywords, and
    return every worker.
    """
    return list(client.scheduler_info(n_workers=-1)["workers"])


def probe_worker() -> dict[str, Any]:
    """Run on each worker before a gang forms: what the rank there will have."""
    import torch

    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return {"cuda": torch.cuda.is_available(), "cpus": cpus}


def free_port() -> int:
    """A TCP port free right now on this host, for the rank-0 store to listen on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def host_of(address: str) -> str:
    return urlparse(address).hostname or address


def by_host(addresses: list[str]) -> list[str]:
    """Worker addresses grouped by host, so the ranks on one host get contiguous numbers."""
    return sorted(addresses, key=lambda a: (host_of(a), a))


def plan_ranks(
    addresses: list[str], probes: dict[str, dict[str, Any]], port: int, attempt: int,
    output_url: str | None, init_timeout_s: float, trial: TrialLink | None = None,
    stop_flag: str | None = None,
) -> list[RankContext]:
    """One context per address: rank order, local ranks per host, backend and master."""
    cuda_everywhere = all(probes[a]["cuda"] for a in addresses)
    per_host: dict[str, list[str]] = {}
    for address in addresses:
        per_host.setdefault(host_of(address), []).append(address)
    return [
        RankContext(
            rank=rank,
            local_rank=per_host[host_of(address)].index(address),
            world_size=len(addresses),
            local_world_size=len(per_host[host_of(address)]),
            backend=default_backend(cuda_everywhere),
            # dask-cuda gives each worker one GPU, visible to it as device 0.
            device="cuda:0" if cuda_everywhere else "cpu",
            worker_address=address,
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
