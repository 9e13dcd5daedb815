"""One rank of a gang: a Prefect task run pinned to its Dask worker.

Rank tasks have no Prefect retries on purpose: a retry would run in the same worker
process, alone, and could never re-form a process group with the others. Retrying is
the supervisor's job (`max_restarts`). A rank that the supervisor stopped ends Cancelled,
not Failed, so the report tells a stop from the failure that caused it.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import distributed
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run
from prefect.states import Cancelled, State

from prefect_ddp.tasks.gang.context import RankContext
from prefect_ddp.tasks.gang.errors import GangRegroup, GangStopped
from prefect_ddp.tasks.gang.fencing import fenced
from prefect_ddp.tasks.gang.freed_memory import return_freed_memory
from prefect_ddp.tasks.gang.plan import host_of
from prefect_ddp.tasks.gang.process_group import process_group
from prefect_ddp.tasks.gang.progress import forget_progress, send_progress
from prefect_ddp.tasks.gang.resizing import Regrouped
from prefect_ddp.tasks.gang.stale import running
from prefect_ddp.tasks.gang.stopping import stop_requested

R = TypeVar("R")


def limit_threads(ctx: RankContext, threads: int) -> None:
    """Take this rank's share of its host's cores (plan.thread_shares) instead of all of them."""
    import torch

    torch.set_num_threads(threads)
    if ctx.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(ctx.device))


def leave_worker_thread_pool() -> None:
    """Let the worker run other tasks beside this rank (decode checks of another run).

    A rank holds its worker for the whole training; without this, any other task Dask
    placed on that worker would wait for the training to end. Leases (not the thread
    pool) keep two ranks off one worker.
    """
    try:
        distributed.secede()
    except ValueError:  # not inside a Dask worker (a unit test calling the task's fn)
        pass


@task(name="ddp-rank", retries=0, cache_policy=NO_CACHE, persist_result=False)
def run_rank(train_fn: Callable[[RankContext, Any], R], config: Any, ctx: RankContext, threads: int,
             holder: str = "a gang") -> R | State:
    """One rank: join the process group, run the training function, always leave the group.

    While it runs, its worker process knows it (`stale.running`): a later gang that finds it
    there, its own gang gone, stops it before starting a rank beside it. When it ends, what
    it freed goes back to the operating system (`freed_memory`), or each gang would leave
    its worker larger."""
    with running(ctx.worker_address, ctx.rank, holder, ctx.stop_flag, task_run.get_id()):
        try:
            return _run_rank(train_fn, config, ctx, threads)
        except BaseException as error:
            let_go_of_failed_rank(error)
            raise
        finally:
            return_freed_memory()


def let_go_of_failed_rank(error: BaseException) -> None:
    """Free what a failed training function still holds, before its worker runs the next gang.

    Its exception's traceback keeps the function's frames, and with them their locals: a
    DataLoader iterator with its loader processes, a process group's store and sockets. The
    exception outlives the task (Prefect's Failed state, Dask's record of the error), so all
    of that lived on in the worker: the next gang there forked its loaders beside the old
    iterators, which failed in the children ("can only test a child process", a segfault,
    "DataLoader worker exited unexpectedly"), gang after gang (issue 33's soak). Clearing the
    finished frames keeps the traceback's text; `return_freed_memory`, as every rank ends,
    collects the cycles at once.
    """
    traceback.clear_frames(error.__traceback__)


def _run_rank(train_fn: Callable[[RankContext, Any], R], config: Any, ctx: RankContext, threads: int) -> R | State:
    leave_worker_thread_pool()
    limit_threads(ctx, threads)
    send_progress(ctx.progress_topic, ctx.rank, "rendezvous")
    with process_group(
        backend=ctx.backend,
        rank=ctx.rank,
        world_size=ctx.world_size,
        master_addr=ctx.master_addr,
        master_port=ctx.master_port,
        timeout=timedelta(seconds=ctx.init_timeout_s),
        own_address=host_of(ctx.worker_address),
    ):
        try:
            return train_fn(ctx, config)
        except GangRegroup:
            return Regrouped(ctx.world_size)  # type: ignore[return-value]  # taken out by run_gang, never returned
        except Exception as error:
            # A peer that left on the stop flag, or on losing its lease, fails the collective
            # this rank waits in: while the gang is stopping, that failure is part of the stop.
            if (isinstance(error, GangStopped) or stop_requested(ctx.stop_flag, max_age_s=0)
                    or fenced(ctx.worker_address, ctx.lease, max_age_s=0)):
                return Cancelled(message=f"Stopped by the gang supervisor: {error}")
            raise
        finally:
            forget_progress(ctx.progress_topic)
