"""torch.distributed set-up and tear-down for one rank, kept apart from the training loop.

`process_group` takes every value explicitly and reads no environment variables, so two
gangs on one cluster cannot pick up each other's MASTER_PORT. At world size 1 it does
nothing, and the collectives below are no-ops without a process group, so the same
training loop runs unchanged in a unit test, on one worker and on many.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

logger = logging.getLogger(__name__)


def default_backend(cuda_on_every_rank: bool) -> str:
    """nccl when every rank has a GPU, else gloo (nccl cannot serve CPU tensors)."""
    return "nccl" if cuda_on_every_rank else "gloo"


def tcp_init_method(host: str, port: int) -> str:
    """`tcp://host:port` for init_process_group; an IPv6 host goes in brackets (`tcp://[::1]:29500`).

    Without them `tcp://::1:29500` does not parse as host and port.
    """
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def interface_holding(address: str) -> str | None:
    """The name of this machine's network interface that has `address`, if one has it."""
    import psutil

    interfaces: dict[str, list[Any]] = psutil.net_if_addrs()
    for name, addresses in interfaces.items():
        if any(entry.address.split("%")[0] == address for entry in addresses):
            return name
    return None


def choose_gloo_interface(own_address: str | None) -> None:
    """Point gloo at the interface of this rank's own address, unless its owner already did.

    gloo offers its peers the address its host name resolves to. Where that is loopback
    (Debian's `127.0.1.1` line; `127.0.0.1` on this machine), ranks on other hosts are told
    to connect to 127.0.0.1 and init fails with "connectFullMesh failed ...
    remote=[127.0.0.1]". The address the rank's Dask worker listens on is one its peers
    can reach, so gloo uses that address's interface. gloo reads only the environment.
    """
    if own_address and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = interface_holding(own_address)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface


def forget_failed_joins() -> None:
    """Number this process's next group as a fresh process would: 0.

    torch names the default group by a per-process counter, counted before the rendezvous,
    and the group's store keys carry the name (`/default_pg/0//cpu//0/1`). A join that failed
    (a peer gone mid-rendezvous, a store timeout) raised the counter without making a group,
    so no destroy reset it: every later gang that paired this worker with a fresh process
    waited for keys of another name until its timeout (DistStoreError after 60 s, attempt
    after attempt): a worker poisoned until restarted (docs/architecture.md, "Facts: torch
    and gloo"). With no group in this process (checked by the caller), 0 is what the
    counter must be; torch's own destroy sets it so.
    """
    distributed_c10d._world.group_count = 0


def every_rank_joined(backend: str) -> None:
    """Wait until every rank's join has finished: a barrier right after the join.

    A rank's join can return while a peer is still connecting to it (gloo's
    connectFullMesh): a training function that does no collective (or ends before its first)
    then destroyed the group under that peer, which failed with "Connection closed by
    peer" (seen under load in tests/test_sending.py's gang of two ranks that build a model).
    """
    if backend == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


@contextmanager
def process_group(
    *,
    backend: str,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout: timedelta,
    own_address: str | None = None,
) -> Iterator[None]:
    """Join the gang's process group for the duration of the block.

    `master_addr` is a bare host name or address, IPv4 or IPv6 (`::1`, no brackets).
    `own_address` is the address this rank's peers reach it at (its Dask worker's host):
    gloo sends from that address's interface (`choose_gloo_interface`).

    The block starts once every rank has joined (`every_rank_joined`). The group is
    destroyed on the way out whatever happens inside; a failure to destroy it is logged,
    never raised over the error that ended the block.
    """
    if world_size == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError(
            f"This process already belongs to a process group (rank {dist.get_rank()} of "
            f"{dist.get_world_size()}), so it cannot join another as rank {rank}: two gangs "
            "share a Dask worker. Give each concurrent gang its own workers."
        )
    if backend == "gloo":
        choose_gloo_interface(own_address)
    forget_failed_joins()
    dist.init_process_group(
        backend=backend,
        init_method=tcp_init_method(master_addr, master_port),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    try:
        every_rank_joined(backend)
        yield
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # never mask the error that is already on its way out
            logger.exception("destroy_process_group failed on rank %d", rank)


def all_reduce_sum(values: list[float], device: torch.device | str = "cpu") -> list[float]:
    """Sum `values` over every rank; returns them unchanged without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def all_gather_strings(items: list[str], device: torch.device | str = "cpu") -> list[str]:
    """Every rank's `items`, in rank order; `items` itself without a process group.

    Sent as JSON in a uint8 tensor, padded to the longest rank's, rather than with
    `all_gather_object`, so that no rank unpickles anything (as `broadcast_bytes`).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return list(items)
    data = json.dumps(items).encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, length)
    sizes = [int(n.item()) for n in lengths]
    payload = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    payload[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    payloads = [torch.empty_like(payload) for _ in sizes]
    dist.all_gather(payloads, payload)
    return [item for size, got in zip(sizes, payloads) for item in json.loads(got[:size].cpu().numpy().tobytes())]


def broadcast_flag(flag: bool, device: torch.device | str = "cpu") -> bool:
    """Rank 0's `flag` on every rank; the flag itself without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    tensor = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.broadcast(tensor, src=0)
    return bool(tensor.item())


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DistributedDataParallel when there is a process group, else the model itself."""
    if not (dist.is_available() and dist.is_initialized()):
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def sync_buffers(model: torch.nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm running stats) to every rank.

    Each rank updates its running stats in its own last training step, so without this the
    ranks would validate slightly different models, none of them the one rank 0 saves.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def broadcast_bytes(data: bytes | None, device: torch.device | str = "cpu", src: int = 0) -> bytes | None:
    """Rank `src`'s `data` (or its None) on every rank; `data` itself without a process group.

    Sent as a length and a uint8 tensor rather than with `broadcast_object_list`, so no
    rank unpickles anything: the bytes may come from storage (a checkpoint), which is only
    ever opened with `torch.load(weights_only=True)`.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return data
    is_source = dist.get_rank() == src
    length = torch.tensor([-1 if data is None or not is_source else len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src)
    if length.item() < 0:
        return None
    if is_source:
        assert data is not None  # the source's None went out as length -1, returned above
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src)
    return data if is_source else payload.cpu().numpy().tobytes()
