"""`run_gang`: lease workers, plan the ranks, submit them pinned, supervise, re-form on failure."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import dask
import distributed
from prefect.context import get_run_context
from prefect.runtime import flow_run
from prefect_dask import DaskTaskRunner
from prefect_dask.task_runners import PrefectDaskFuture

from tasks.gang.context import GangError, RankContext
from tasks.gang.lease import leased_workers
from tasks.gang.plan import free_port, plan_ranks, probe_worker
from tasks.gang.rank import run_rank
from tasks.gang.sending import prepare_to_send
from tasks.gang.supervise import stop, supervise, wait_for_workers
from tasks.gang.trial import TrialLink
from tasks.reporting import run_logger

R = TypeVar("R")


def current_dask_runner() -> DaskTaskRunner:
    runner = get_run_context().task_runner
    if not isinstance(runner, DaskTaskRunner):
        raise GangError(
            f"run_gang needs a DaskTaskRunner; this flow runs with {type(runner).__name__}. "
            "Pass task_runner=DaskTaskRunner(...) to @flow, or run_gang(..., task_runner=...)."
        )
    return runner


def lease_holder() -> str:
    """Who holds a gang's workers, as the message of a gang that waits for them says it."""
    return f"flow run {flow_run.get_name() or '?'} ({flow_run.get_id() or 'outside a flow run'})"


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
    lease_timeout: timedelta = timedelta(minutes=10),
    trial: TrialLink | None = None,
) -> list[R]:
    """Run `train_fn(ctx, config)` on `world_size` Dask workers as one DDP world.

    Args:
        train_fn: the per-rank function. Its process group is already initialised; it must
            resume from its own checkpoint to benefit from restarts (`ctx.attempt` counts
            them). Defined in a module, a script or a notebook.
        config: passed to every rank unchanged (picklable; plain values are best).
        task_runner: the DaskTaskRunner to use; default: the current flow's.
        world_size: number of ranks; default: every worker of the cluster.
        output_url: handed to the ranks as `ctx.output_url`.
        init_timeout: limit for the ranks to meet, and for any collective to complete.
        timeout: limit for the whole gang; default none.
        max_restarts: how often to re-form the gang after a failure.
        lease_timeout: how long to wait for enough workers that no other gang holds.
        trial: the sweep trial this gang trains; `ctx.report` reports to it.

    Returns:
        Each rank's return value, in rank order.

    Example:
        >>> results = run_gang(train, {"lr": 0.1}, world_size=2)  # doctest: +SKIP
    """
    runner = task_runner or current_dask_runner()
    client = runner.client
    prepare_to_send(client, train_fn, config)
    log = run_logger()
    for attempt in range(max_restarts + 1):
        with leased_workers(client, world_size, lease_holder(), lease_timeout.total_seconds()) as addresses:
            try:
                return _run_attempt(
                    runner, client, train_fn, config, addresses, attempt, output_url,
                    init_timeout, timeout, trial,
                )
            except GangError as failure:
                if attempt == max_restarts:
                    raise
                log.warning("Gang attempt %d failed: %s. Re-forming it.", attempt + 1, failure)
        wait_for_workers(client, len(addresses))
    raise AssertionError("unreachable")  # the loop returns or raises


def _run_attempt(
    runner: DaskTaskRunner, client: distributed.Client, train_fn: Callable, config: Any,
    addresses: list[str], attempt: int, output_url: str | None,
    init_timeout: timedelta, timeout: timedelta | None, trial: TrialLink | None,
) -> list[Any]:
    try:
        probes = client.run(probe_worker, workers=addresses)
        port = client.run(free_port, workers=[addresses[0]])[addresses[0]]
    except Exception as exc:  # a worker left between choosing and asking: form again
        raise GangError(f"Could not prepare workers {addresses} for a gang: {exc!r}") from exc
    contexts = plan_ranks(addresses, probes, port, attempt, output_url, init_timeout.total_seconds(), trial)
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
        supervise(client, futures, contexts, deadline)
    except GangError:
        try:
            stop(client, futures, contexts)
        except Exception:  # the failure being reported matters more than the clean-up's
            run_logger().exception("Stopping the gang's ranks failed")
        raise
    return [future.result() for future in futures]
