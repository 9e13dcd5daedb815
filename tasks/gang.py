"""The DDP gang: run one per-rank function on several Dask workers as one torch world.

A gang is one Prefect task run per rank, each pinned to its own Dask worker, that agree on
world size, ranks and a master address before `init_process_group`. A supervisor in the
flow's process watches them; when a rank fails, a worker leaves or the deadline passes, it
stops every rank, records a final state for each, and re-forms the gang on the workers
that are alive, on a new port (the training function resumes from its checkpoint).

Before, with dask-pytorch-ddp:

    from dask_pytorch_ddp import dispatch, results
    futures = dispatch.run(client, train, lr=0.1)       # fixed port 23456, no timeout
    outputs = client.gather(futures)                    # hangs forever if a worker dies

After:

    from prefect import flow
    from prefect_dask import DaskTaskRunner
    from tasks.gang import RankContext, run_gang

    def train(ctx: RankContext, config: dict) -> float:
        ...  # torch.distributed is initialised; ctx.rank, ctx.world_size, ctx.device
        return loss

    @flow(task_runner=DaskTaskRunner(cluster_kwargs={"n_workers": 2}))
    def my_flow():
        losses = run_gang(train, {"lr": 0.1})           # one result per rank, rank order

Rank tasks have no Prefect retries on purpose: a retry would run in the same worker
process, alone, and could never re-form a process group with the others. Retrying is
the supervisor's job (`max_restarts`).
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlparse

import dask
import distributed
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.context import get_run_context
from prefect.exceptions import ObjectNotFound
from prefect.states import Crashed
from prefect_dask import DaskTaskRunner
from prefect_dask.task_runners import PrefectDaskFuture

from tasks.process_group import default_backend, process_group
from tasks.reporting import run_logger

R = TypeVar("R")

# Surviving gloo ranks fail within ~5 s of a peer's death (DESIGN 4); give them this long
# to record their own failure before they are cancelled.
FAILURE_GRACE_S = 15.0
# When one rank raises, its peers fail milliseconds later on the closed connection; wait
# this long for them so the report names the rank that failed first-hand.
PEER_FAILURE_WINDOW_S = 5.0
# What a rank reports when a peer, not itself, went wrong (gloo and NCCL wordings).
PEER_LOSS = re.compile(r"closed by peer|reset by peer|Broken pipe|remote process exited|Connection refused", re.I)
WORKER_RETURN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RankContext:
    """What a rank knows about its place in the gang; handed to the training function."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str
    device: str
    worker_address: str
    master_addr: str
    master_port: int
    attempt: int = 0
    output_url: str | None = None
    init_timeout_s: float = 300.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class GangError(RuntimeError):
    """The gang could not be formed or did not finish; the message says which rank and why."""


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


def choose_workers(client: distributed.Client, world_size: int | None) -> list[str]:
    """Worker addresses for the ranks, grouped by host so local ranks are contiguous."""
    workers = sorted(client.scheduler_info()["workers"], key=lambda a: (host_of(a), a))
    wanted = world_size or len(workers)
    if not workers or wanted > len(workers):
        raise GangError(
            f"world_size={wanted} needs {wanted} Dask workers (one rank each) but the cluster "
            f"has {len(workers)}: {workers}. Lower world_size or add workers."
        )
    return workers[:wanted]


def plan_ranks(
    addresses: list[str], probes: dict[str, dict[str, Any]], port: int, attempt: int,
    output_url: str | None, init_timeout_s: float,
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
        )
        for rank, address in enumerate(addresses)
    ]


def limit_threads(ctx: RankContext, cpus: int) -> None:
    """Share the host's cores between the ranks on it instead of each taking all of them."""
    import torch

    torch.set_num_threads(max(1, cpus // ctx.local_world_size))
    if ctx.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(ctx.device))


@task(name="ddp-rank", retries=0, cache_policy=NO_CACHE, persist_result=False)
def run_rank(train_fn: Callable[[RankContext, Any], R], config: Any, ctx: RankContext, cpus: int) -> R:
    """One rank: join the process group, run the training function, always leave the group."""
    limit_threads(ctx, cpus)
    with process_group(
        backend=ctx.backend,
        rank=ctx.rank,
        world_size=ctx.world_size,
        master_addr=ctx.master_addr,
        master_port=ctx.master_port,
        timeout=timedelta(seconds=ctx.init_timeout_s),
    ):
        return train_fn(ctx, config)


def current_dask_runner() -> DaskTaskRunner:
    runner = get_run_context().task_runner
    if not isinstance(runner, DaskTaskRunner):
        raise GangError(
            f"run_gang needs a DaskTaskRunner; this flow runs with {type(runner).__name__}. "
            "Pass task_runner=DaskTaskRunner(...) to @flow, or run_gang(..., task_runner=...)."
        )
    return runner


def run_gang(
    train_fn: Callable[[RankContext, Any], R],
    config: Any,
    *,
    task_runner: DaskTaskRunner | None = None,
    world_size: int | None = None,
    output_url: str | None = None,
    init_timeout: timedelta = timedelta(minutes=5),
    timeout: timedelta | None = None,
    max_restarts: int = 0,
) -> list[R]:
    """Run `train_fn(ctx, config)` on `world_size` Dask workers as one DDP world.

    Args:
        train_fn: the per-rank function; importable on the workers. Its process group is
            already initialised; it must resume from its own checkpoint to benefit from
            restarts (`ctx.attempt` counts them).
        config: passed to every rank unchanged (picklable; plain values are best).
        task_runner: the DaskTaskRunner to use; default: the current flow's.
        world_size: number of ranks; default: every worker of the cluster.
        output_url: handed to the ranks as `ctx.output_url`.
        init_timeout: limit for the ranks to meet, and for any collective to complete.
        timeout: limit for the whole gang; default none.
        max_restarts: how often to re-form the gang after a failure.

    Returns:
        Each rank's return value, in rank order.

    Example:
        >>> results = run_gang(train, {"lr": 0.1}, world_size=2)  # doctest: +SKIP
    """
    runner = task_runner or current_dask_runner()
    client = runner.client
    log = run_logger()
    for attempt in range(max_restarts + 1):
        addresses = choose_workers(client, world_size)
        try:
            return _run_attempt(
                runner, client, train_fn, config, addresses, attempt, output_url,
                init_timeout, timeout,
            )
        except GangError as failure:
            if attempt == max_restarts:
                raise
            log.warning("Gang attempt %d failed: %s. Re-forming it.", attempt + 1, failure)
            _wait_for_workers(client, len(addresses))
    raise AssertionError("unreachable")  # the loop returns or raises


def _run_attempt(
    runner: DaskTaskRunner, client: distributed.Client, train_fn: Callable, config: Any,
    addresses: list[str], attempt: int, output_url: str | None,
    init_timeout: timedelta, timeout: timedelta | None,
) -> list[Any]:
    try:
        probes = client.run(probe_worker, workers=addresses)
        port = client.run(free_port, workers=[addresses[0]])[addresses[0]]
    except Exception as exc:  # a worker left between choosing and asking: form again
        raise GangError(f"Could not prepare workers {addresses} for a gang: {exc!r}") from exc
    contexts = plan_ranks(addresses, probes, port, attempt, output_url, init_timeout.total_seconds())
    run_logger().info(
        "Gang attempt %d: %d ranks on %s, backend %s, master %s:%d",
        attempt + 1, len(contexts), addresses, contexts[0].backend, contexts[0].master_addr, port,
    )
    futures: list[PrefectDaskFuture] = []
    for ctx in contexts:
        # Pinned with no escape: Dask must never run a rank elsewhere, alone, into a
        # rendezvous that the other ranks have already left.
        with dask.annotate(workers=[ctx.worker_address], allow_other_workers=False):
            futures.append(
                runner.submit(
                    run_rank.with_options(task_run_name=f"rank-{ctx.rank}"),
                    parameters={
                        "train_fn": train_fn,
                        "config": config,
                        "ctx": ctx,
                        "cpus": probes[ctx.worker_address]["cpus"],
                    },
                )
            )
    deadline = time.monotonic() + timeout.total_seconds() if timeout else None
    try:
        _supervise(client, futures, contexts, deadline)
    except GangError:
        try:
            _stop(client, futures, contexts)
        except Exception:  # the failure being reported matters more than the clean-up's
            run_logger().exception("Stopping the gang's ranks failed")
        raise
    return [future.result() for future in futures]


def wait_for(
    client: distributed.Client, futures: list[distributed.Future], timeout_s: float,
    return_when: str = "ALL_COMPLETED",
) -> None:
    """distributed.wait on this client (not the process's default one), without raising at the timeout."""
    with client.as_current():
        try:
            distributed.wait(futures, timeout=timeout_s, return_when=return_when)
        except (TimeoutError, distributed.TimeoutError):
            pass


def _supervise(
    client: distributed.Client, futures: list[PrefectDaskFuture],
    contexts: list[RankContext], deadline: float | None, poll_s: float = 1.0,
) -> None:
    """Return once every rank completed; raise GangError at the first sign of trouble."""
    pending = dict(zip((f.wrapped_future for f in futures), contexts))
    while pending:
        wait_for(client, list(pending), poll_s, return_when="FIRST_COMPLETED")
        failures = _collect_failures(pending)
        if failures:
            wait_for(client, list(pending), PEER_FAILURE_WINDOW_S)
            raise GangError(_root_cause_first(failures + _collect_failures(pending)))
        if not pending:
            return
        alive = set(client.scheduler_info()["workers"])
        gone = [c for c in pending.values() if c.worker_address not in alive]
        if gone:
            raise GangError(
                f"Worker {gone[0].worker_address} of rank {gone[0].rank} left the cluster "
                "(killed, out of memory or lost) while training."
            )
        if deadline is not None and time.monotonic() > deadline:
            raise GangError(f"The gang did not finish within its timeout; ranks {sorted(c.rank for c in pending.values())} were still running.")


def _collect_failures(pending: dict[distributed.Future, RankContext]) -> list[str]:
    """Take the finished ranks out of `pending`; returns why each one that did not complete failed."""
    failures = []
    for dask_future in [f for f in pending if f.done()]:
        ctx = pending.pop(dask_future)
        if dask_future.status == "error":
            failures.append(f"Rank {ctx.rank} on {ctx.worker_address} failed in Dask: {dask_future.exception()!r}")
            continue
        state = dask_future.result()
        if not state.is_completed():
            failures.append(f"Rank {ctx.rank} on {ctx.worker_address} ended {state.type.value}: {state.message}")
    return failures


def _root_cause_first(failures: list[str]) -> str:
    """One message, the ranks that failed first-hand before those that only lost a peer."""
    ordered = sorted(failures, key=lambda message: bool(PEER_LOSS.search(message)))
    others = f" (then {len(ordered) - 1} more rank(s) failed: {'; '.join(ordered[1:])})" if len(ordered) > 1 else ""
    return ordered[0] + others


def _stop(client: distributed.Client, futures: list[PrefectDaskFuture], contexts: list[RankContext]) -> None:
    """Stop every rank, give each task run a final state, and restart stuck workers."""
    dask_futures = [f.wrapped_future for f in futures]
    wait_for(client, dask_futures, FAILURE_GRACE_S)
    stuck = [c.worker_address for f, c in zip(dask_futures, contexts) if not f.done()]
    client.cancel(dask_futures, force=True)
    _crash_unfinished_task_runs(futures)
    alive = set(client.scheduler_info()["workers"])
    # A rank thread blocked in a collective cannot be interrupted; restarting its worker
    # is the only way to free the process (and its process group) for the next gang.
    stuck_alive = [a for a in stuck if a in alive]
    if stuck_alive:
        run_logger().warning("Restarting workers %s whose ranks did not stop.", stuck_alive)
        try:
            client.restart_workers(stuck_alive)
        except Exception:  # workers without a nanny cannot restart; they time out alone
            run_logger().exception("Could not restart workers %s", stuck_alive)


def _read_task_run(api: Any, task_run_id: Any, attempts: int = 10) -> Any:
    """The task run, or None; the server records task runs from events, a moment late."""
    for _ in range(attempts):
        try:
            return api.read_task_run(task_run_id)
        except ObjectNotFound:
            time.sleep(0.5)
    return None


def _crash_unfinished_task_runs(futures: list[PrefectDaskFuture]) -> None:
    """Give every rank's task run a final state; never raise over the gang's own error."""
    with get_client(sync_client=True) as api:
        for future in futures:
            task_run = _read_task_run(api, future.task_run_id)
            if task_run is None:  # cancelled before it started: no task run was created
                continue
            try:
                if task_run.state is None or not task_run.state.is_final():
                    api.set_task_run_state(
                        future.task_run_id,
                        Crashed(message="Stopped by the gang supervisor after another rank or its worker failed."),
                        force=True,
                    )
            except Exception:
                run_logger().exception("Could not mark task run %s as crashed", future.task_run_id)


def _wait_for_workers(client: distributed.Client, n: int) -> None:
    """Give restarted workers (the nanny brings one back within seconds) time to return."""
    try:
        client.wait_for_workers(n, timeout=WORKER_RETURN_TIMEOUT_S)
    except (TimeoutError, distributed.TimeoutError):
        run_logger().warning("Only %d of %d workers came back; re-forming on those.", len(client.scheduler_info()["workers"]), n)
