"""`run_gang`: lease workers, run an attempt, re-form the gang after a failure, within one deadline."""

from __future__ import annotations

import itertools
import sys
import time
import uuid
from dataclasses import replace
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
from prefect_ddp.tasks.gang.handover import drop_parked
from prefect_ddp.tasks.gang.lease import leased_workers
from prefect_ddp.tasks.gang.grow_watch import free_workers
from prefect_ddp.tasks.gang.progress import collective_timeout_s
from prefect_ddp.tasks.gang.resizing import Regrouped
from prefect_ddp.tasks.gang.results import COMPLETED, REGROUPED, GangAttempt, GangResults
from prefect_ddp.tasks.gang.sending import prepare_to_send
from prefect_ddp.tasks.gang.states import crash_when_recorded
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
    min_world_size: int | None = None,
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
        world_size: number of ranks; default: every worker of the cluster. With
            `min_world_size`, the most ranks.
        min_world_size: make the gang elastic: it starts once this many workers are free,
            on as many up to `world_size` as are; after a failure it re-forms at once on the
            workers free (this many at least), without waiting for lost ones to return; and
            while it trains below `world_size`, a worker come free makes it regroup larger at
            the function's next safe boundary (`ctx.regroup_requested`; tasks/gang/resizing.py).
            Regroups do not count against `max_restarts`. Default: a fixed size.
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
    check_size_range(world_size, min_world_size)
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
                    hang_floor_s=floor_s, holder=lease_holder(), gang_id=f"gang-{uuid.uuid4().hex}",
                    elastic=min_world_size is not None, max_world_size=world_size)
    attempts: list[GangAttempt] = []
    try:
        return GangResults(_until_one_completes(runner, spec, (min_world_size, world_size), max_restarts,
                                                lease_timeout, attempts), attempts)
    except GangError as error:
        if not attempts or isinstance(error, GangRefused):  # refused: no rank ever started
            raise
        raise error.after(attempts, max_restarts).with_traceback(error.__traceback__) from error.__cause__
    finally:
        if spec.elastic:
            forget_parked_state(runner, spec)
        # Last, as it may wait; a flow being cancelled or interrupted (TerminationSignal, KeyboardInterrupt)
        # takes one look instead.
        ending = sys.exc_info()[1]
        crash_when_recorded(spec.late_runs, wait=ending is None or isinstance(ending, Exception))


def check_size_range(world_size: int | None, min_world_size: int | None) -> None:
    """Refuse a size range that means nothing, before any worker is touched."""
    if min_world_size is None:
        return
    if min_world_size < 1 or (world_size is not None and min_world_size > world_size):
        raise ValueError(
            f"min_world_size={min_world_size} with world_size={world_size}: give 1 <= min_world_size <= "
            "world_size (or world_size None, for up to every worker of the cluster)."
        )


def forget_parked_state(runner: DaskTaskRunner, spec: GangSpec) -> None:
    """Free what the gang's ranks parked in their workers' memory (tasks/gang/handover.py): its
    run is over, whatever its end. Logged, never raised: the gang's own outcome matters more."""
    try:
        runner.client.run(drop_parked, spec.gang_id, on_error="ignore")
    except Exception:
        run_logger().exception("Could not free the state the gang parked on its workers; a worker "
                               "frees it when a later gang parks its own.")


def _until_one_completes(
    runner: DaskTaskRunner, spec: GangSpec, sizes: tuple[int | None, int | None], max_restarts: int,
    lease_timeout: timedelta, attempts: list[GangAttempt],
) -> list[Any]:
    """Form the gang until an attempt completes, appending each attempt to `attempts`; `sizes`:
    (min_world_size, world_size). Failures are re-formed up to `max_restarts` times, regroups
    (an elastic gang grown larger) as often as workers come free."""
    client = runner.client
    least, most = sizes
    failures = 0
    regrouped_from: int | None = None  # the size of the attempt before, where it regrouped
    for number in itertools.count(1):
        refuse_when_stopped(f"attempt {number} was not formed")
        with leased_workers(client, most, spec.holder, lease_timeout.total_seconds(), least) as leases:
            if regrouped_from is not None and len(leases) <= regrouped_from:
                # The workers that still look free were not to be had (a stale rank on one): no
                # regroup for them again.
                spec.not_growing.update(set(free_workers(client)) - set(leases))
            regrouped_from = None
            try:
                results = _recorded_attempt(runner, spec, leases, number, attempts)
                if not all(isinstance(result, Regrouped) for result in results):
                    return results
                run_logger().info("Gang attempt %d of %d ranks regrouped: forming it again on the workers free.",
                                  number, len(leases))
                regrouped_from = len(leases)
                spec = replace(spec, regroups=spec.regroups + 1)
            except GangError as failure:
                refuse_when_stopped(f"attempt {number} ended ({failure}) and is not formed again")
                failures += 1
                if isinstance(failure, (GangTimeout, GangRefused)) or failures > max_restarts:
                    raise
                run_logger().warning("Gang attempt %d failed: %s. Re-forming it.", number, failure)
                if not spec.elastic:  # an elastic gang re-forms on the survivors, and grows back later
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
    started, started_at = time.monotonic(), time.time()
    ended = COMPLETED
    addresses = list(leases)
    try:
        results = run_attempt(runner, spec, leases, attempt=number - 1)
        if results and all(isinstance(result, Regrouped) for result in results):
            ended = REGROUPED
        return results
    except BaseException as exc:
        ended = str(exc) if isinstance(exc, GangError) else repr(exc)
        raise
    finally:
        attempts.append(GangAttempt(number, list(addresses), len(addresses), ended, time.monotonic() - started,
                                    started_at))
