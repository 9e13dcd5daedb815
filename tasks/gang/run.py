"""`run_gang`: lease workers, run an attempt, re-form the gang after a failure, within one deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from prefect.context import TaskRunContext, get_run_context
from prefect.runtime import flow_run
from prefect_dask import DaskTaskRunner

from prefect_ddp.tasks.gang.attempt import GangSpec, run_attempt
from prefect_ddp.tasks.gang.context import RankContext
from prefect_ddp.tasks.gang.errors import (
    GangError,
    GangRefused,
    GangStopped,
    GangTimeout,
)
from prefect_ddp.tasks.gang.lease import leased_workers
from prefect_ddp.tasks.gang.progress import collective_timeout_s
from prefect_ddp.tasks.gang.results import COMPLETED, GangAttempt, GangResults
from prefect_ddp.tasks.gang.sending import prepare_to_send
from prefect_ddp.tasks.gang.stopping import scope_stopped
from prefect_ddp.tasks.gang.supervise import Deadline, wait_for_workers
from prefect_ddp.tasks.gang.trial import TrialLink
from prefect_ddp.tasks.reporting import run_logger

R = TypeVar("R")


def current_dask_runner() -> DaskTaskRunner:
    context = get_run_context()
    if isinstance(context, TaskRunContext):
        raise GangError(
            f"run_gang needs the flow's DaskTaskRunner, but was called inside task run "
            f"{context.task_run.name!r}, which has none. Call it from the flow function itself, or "
            "pass run_gang(..., task_runner=...)."
        )
    runner = context.task_runner
    if not isinstance(runner, DaskTaskRunner):
        raise GangError(
            f"run_gang needs a DaskTaskRunner; this flow runs with {type(runner).__name__}. "
            "Pass task_runner=DaskTaskRunner(...) to @flow, or run_gang(..., task_runner=...)."
        )
    return runner


def lease_holder() -> str:
    """Who holds a gang's workers, as the message of a gang that waits for them says it."""
    return f"flow run {flow_run.get_name() or '?'} ({flow_run.get_id() or 'outside a flow run'})"


def check_limits(timeout: timedelta | None, max_restarts: int) -> None:
    """Refuse limits that mean nothing, before any worker is touched."""
    if max_restarts < 0:
        raise ValueError(
            f"max_restarts={max_restarts} is negative; it counts how often a failed gang is "
            "re-formed: 0 (never, the default) or more."
        )
    if timeout is not None and timeout <= timedelta(0):
        raise ValueError(
            f"timeout={timeout!r} is not positive; give a positive timedelta for the whole "
            "run_gang call, or None for no limit."
        )


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
    needs_child_processes: bool = False,
    shared_output: bool = False,
    hang_timeout: timedelta | None = None,
    hang_floor: timedelta | None = None,
) -> GangResults[R]:
    """Run `train_fn(ctx, config)` on `world_size` Dask workers as one DDP world.

    Args:
        train_fn: the per-rank function. Its process group is already initialised; it must
            resume from its own checkpoint to benefit from restarts (`ctx.attempt` counts
            them), and should call `ctx.check_stop()` between steps so that a cancelled
            flow run stops it cleanly. Defined in a module, a script or a notebook.
        config: passed to every rank unchanged (picklable; plain values are best).
        task_runner: the DaskTaskRunner to use; default: the current flow's.
        world_size: number of ranks; default: every worker of the cluster.
        output_url: handed to the ranks as `ctx.output_url`.
        init_timeout: limit for the ranks to meet, and for any collective to complete;
            raised to `hang_floor` / 0.8 where that is longer, since a peer may wait that long
            for a rank that waits `hang_floor` on its own.
        timeout: limit for the whole call, all attempts together, counted from the call
            (waiting for free workers is limited by `lease_timeout` alone). When it passes
            the ranks are stopped and GangTimeout is raised; the gang is not re-formed.
            Default: none.
        max_restarts: how often to re-form the gang after a failure.
        lease_timeout: how long to wait for enough workers that no other gang holds.
        trial: the sweep trial this gang trains; `ctx.report` reports to it.
        needs_child_processes: `train_fn` starts processes (DataLoader workers): daemonic
            Dask workers, which cannot, are then refused before any rank starts.
        shared_output: `output_url` is a local path on one filesystem mounted on every
            worker host. Without it a local output that some rank's worker cannot see
            (another host's disk, a container's) is refused before any rank starts.
        hang_timeout: how long the gang may make no progress (`ctx.progress`,
            `ctx.check_stop`) before it is stopped as hung and re-formed; a frozen worker is
            found this long after it froze. Default: the larger of 60 s and 5 times the
            longest of the recent gaps between steps, below 80 % of `init_timeout`
            (docs/architecture.md, "Gang: progress").
        hang_floor: the least silence a gang of live workers is allowed: the longest a
            rank may wait on its own, e.g. for one batch (the recipe passes
            training.fetch_timeout_s), so its own error comes first. A frozen worker is
            still found at the hang limit. Default: none.

    Before any rank starts, each worker's setup is checked (worker_checks): settings
    that break training raise GangRefused naming the fix, slow ones are logged as
    warnings and shown in a `worker-setup` artifact.

    Returns:
        Each rank's return value, in rank order, as a list whose `.attempts` lists every
        GangAttempt (workers, how it ended, seconds): more than one when the gang was
        re-formed. A GangError that ends the call carries the same `.attempts`.

    Example:
        >>> results = run_gang(train, {"lr": 0.1}, world_size=2)  # doctest: +SKIP
        >>> [a.ended for a in results.attempts]  # doctest: +SKIP
        ['completed']
    """
    check_limits(timeout, max_restarts)
    runner = task_runner or current_dask_runner()
    prepare_to_send(runner.client, train_fn, config)
    floor_s = hang_floor.total_seconds() if hang_floor is not None else 0.0
    group_timeout_s = collective_timeout_s(init_timeout.total_seconds(), floor_s)
    if group_timeout_s > init_timeout.total_seconds():
        run_logger().info("The process group's timeout is %.0f s, not init_timeout's %.0f s: a rank may wait %.0f s "
                          "on its own (hang_floor), and its peers must outlast that", group_timeout_s,
                          init_timeout.total_seconds(), floor_s)
    spec = GangSpec(train_fn, config, output_url, group_timeout_s, trial, Deadline.after(timeout),
                    needs_child_processes, shared_output,
                    hang_timeout_s=hang_timeout.total_seconds() if hang_timeout is not None else None,
                    hang_floor_s=floor_s, holder=lease_holder())
    attempts: list[GangAttempt] = []
    try:
        return GangResults(_until_one_completes(runner, spec, world_size, max_restarts, lease_timeout, attempts), attempts)
    except GangError as error:
        if not attempts or isinstance(error, GangRefused):  # refused: no rank ever started
            raise
        raise error.after(attempts, max_restarts).with_traceback(error.__traceback__) from error.__cause__


def _until_one_completes(
    runner: DaskTaskRunner, spec: GangSpec, world_size: int | None, max_restarts: int,
    lease_timeout: timedelta, attempts: list[GangAttempt],
) -> list[Any]:
    """Form the gang until an attempt completes, appending each attempt to `attempts`."""
    client = runner.client
    for number in range(1, max_restarts + 2):
        refuse_when_stopped(f"attempt {number} was not formed")
        with leased_workers(client, world_size, spec.holder, lease_timeout.total_seconds()) as leases:
            try:
                return _recorded_attempt(runner, spec, leases, number, attempts)
            except GangError as failure:
                refuse_when_stopped(f"attempt {number} ended ({failure}) and is not formed again")
                if isinstance(failure, (GangTimeout, GangRefused)) or number > max_restarts:
                    raise
                run_logger().warning("Gang attempt %d failed: %s. Re-forming it.", number, failure)
        wait_for_workers(client, len(leases))
        if spec.deadline.passed():
            raise spec.deadline.exceeded(f"it passed before attempt {number + 1} could start")
    raise AssertionError("unreachable")  # the loop returns or raises


def refuse_when_stopped(what: str) -> None:
    """GangStopped once the sweep running this gang is being stopped: a stop is never retried."""
    if scope_stopped():
        raise GangStopped(f"The gang was stopped for good, as the run that started it is being stopped: {what}.")


def _recorded_attempt(
    runner: DaskTaskRunner, spec: GangSpec, leases: dict[str, str], number: int, attempts: list[GangAttempt],
) -> list[Any]:
    """Run attempt `number` on the workers of `leases` ({address: lease id}) and append how it
    ended, "completed" or its failure, to `attempts`."""
    started = time.monotonic()
    ended = COMPLETED
    addresses = list(leases)
    try:
        return run_attempt(runner, spec, leases, attempt=number - 1)
    except BaseException as exc:
        ended = str(exc) if isinstance(exc, GangError) else repr(exc)
        raise
    finally:
        attempts.append(GangAttempt(number, list(addresses), len(addresses), ended, time.monotonic() - started))
