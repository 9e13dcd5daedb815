"""Per-rank functions for the gang tests, and the flow that runs them; in a module of their
own so workers can import them, and a flow process started by a test can run the flow."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import distributed
import psutil
import torch
import torch.distributed as dist
from prefect import flow
from prefect.runtime import flow_run
from prefect_dask import DaskTaskRunner
from torch.utils.data import DataLoader, TensorDataset

from prefect_ddp.tasks.gang import GangStopped, RankContext, all_reduce_sum, run_gang
from prefect_ddp.tasks.gang.freed_memory import return_freed_memory
from prefect_ddp.tasks.sweeps.settings import SweepSettings
from prefect_ddp.tasks.training.job import TrainJob
from prefect_ddp.tasks.training.recipe import train_classifier
from prefect_ddp.tasks.sweeps.sweep import sweep


def report_rank(ctx: RankContext, config: dict) -> dict:
    """Who am I, and does a collective over the whole gang work?"""
    return {
        "ctx": ctx,
        "pid": os.getpid(),
        "initialized": dist.is_initialized(),
        "dist_world": dist.get_world_size() if dist.is_initialized() else 1,
        "rank_sum": all_reduce_sum([float(ctx.rank)])[0],
        "config": config,
        "threads": torch.get_num_threads(),
    }


def fail_on_rank_1(ctx: RankContext, config: dict) -> dict:
    if ctx.rank == 1 and ctx.attempt < config.get("fail_attempts", 99):
        raise RuntimeError(f"boom on rank {ctx.rank}, attempt {ctx.attempt}")
    return report_rank(ctx, config)


def kill_worker_on_rank_1(ctx: RankContext, config: dict) -> dict:
    """The first attempt loses rank 1's whole worker process, as an OOM kill would."""
    if ctx.rank == 1 and ctx.attempt == 0:
        # Mid-training, as in life: long enough for the RUNNING state to reach the server
        # (a process killed within milliseconds of starting never reports its task run).
        time.sleep(3)
        os.kill(os.getpid(), signal.SIGKILL)
    return report_rank(ctx, config)


class KillsItsWorkerWhenSent:
    """A rank's result that SIGKILLs the worker process holding it as Dask sends it to the flow."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid

    def __reduce__(self) -> tuple:
        if self.pid == os.getpid():
            os.kill(self.pid, signal.SIGKILL)
        return (KillsItsWorkerWhenSent, ())


class SlowToSend:
    """A rank's result that its worker takes `seconds` to send (a large one, or a slow link)."""

    def __init__(self, seconds: float = 0.0, pid: int | None = None) -> None:
        self.seconds, self.pid = seconds, pid

    def __reduce__(self) -> tuple:
        if self.pid == os.getpid():
            time.sleep(self.seconds)
        return (SlowToSend, ())


def slow_to_send_on_rank_1(ctx: RankContext, config: dict) -> dict | SlowToSend:
    reported = report_rank(ctx, config)  # with its peer's collective
    return SlowToSend(config["seconds"], os.getpid()) if ctx.rank == 1 else reported


def unsendable_on_rank_1(ctx: RankContext, config: dict) -> dict | object:
    reported = report_rank(ctx, config)  # with its peer's collective
    return threading.Lock() if ctx.rank == 1 else reported  # no pickle can send a lock


def die_when_fetched_on_rank_1(ctx: RankContext, config: dict) -> dict | KillsItsWorkerWhenSent:
    """The first attempt's rank 1 finishes, and its worker is lost before the flow has the result."""
    reported = report_rank(ctx, config)  # with its peer's collective
    return KillsItsWorkerWhenSent(os.getpid()) if ctx.rank == 1 and ctx.attempt == 0 else reported


def sleep_past_the_deadline(ctx: RankContext, config: dict) -> dict:
    """A rank that will not stop by itself (as one blocked in a collective would not)."""
    time.sleep(config["seconds"])
    return report_rank(ctx, config)


def hold_worker(ctx: RankContext, config: dict) -> dict:
    """Keep the gang's workers busy; say where and when. For `config["seconds"]`, or, with
    `config["until"]` (a folder), until that folder holds `config["marks"]` files (each holder leaves
    one, `held-WORKER`, once it holds its worker; the test may add its own), `seconds` then being only
    the longest it holds."""
    started = time.time()
    until = config.get("until")
    if until is None:
        time.sleep(config["seconds"])
    else:
        folder = Path(until)
        (folder / f"held-{ctx.worker_address.replace('/', '_').replace(':', '_')}").write_text(str(started))
        while len(list(folder.iterdir())) < config["marks"] and time.time() - started < config["seconds"]:
            time.sleep(0.1)
    return {"worker": ctx.worker_address, "started": started, "ended": time.time(),
            "threads": torch.get_num_threads()}


def loop_until_stopped(ctx: RankContext, config: dict) -> NoReturn:
    """Train until told to stop: short steps, each with a collective, `ctx.check_stop()` after each.

    Leaves marks in the folder `config["marks"]`: `running-RANK` (holding the flow run's
    id) once training, and `left-RANK` (holding what ended the loop) on the way out. With
    `config["cancel_own_future"]`, the last rank cancels its own Dask future first, as
    another client or the dashboard could.
    """
    marks = Path(config["marks"])
    if config.get("cancel_own_future") and ctx.rank == ctx.world_size - 1:
        cancel_own_dask_future()
    name = f"{ctx.rank}-trial-{ctx.trial.number}" if ctx.trial else f"{ctx.rank}"
    (marks / f"running-{name}").write_text(flow_run.get_id() or "")
    try:
        while True:
            all_reduce_sum([1.0])
            ctx.check_stop()
            time.sleep(0.05)
    except BaseException as exc:
        (marks / f"left-{name}").write_text(type(exc).__name__)
        raise


def asleep_in_c(ctx: RankContext, config: dict) -> dict:
    """Leave a `running-RANK` mark in `config["marks"]`, then sleep in C (libc's sleep) for
    `config["seconds"]`: no flag, signal or exception can reach the rank until it wakes."""
    (Path(config["marks"]) / f"running-{ctx.rank}").write_text(flow_run.get_id() or "")
    ctypes.CDLL(None).sleep(int(config["seconds"]))
    return report_rank(ctx, config)


def call_check_stop(ctx: RankContext, seconds: float) -> dict:
    """Call `ctx.check_stop()` as fast as possible for `seconds`, or until it raises."""
    calls, started = 0, time.monotonic()
    try:
        while time.monotonic() - started < seconds:
            ctx.check_stop()
            calls += 1
    except GangStopped:
        return {"calls": calls, "stopped_after_s": time.monotonic() - started}
    return {"calls": calls, "stopped_after_s": None}


def cancel_own_dask_future() -> None:
    """Cancel the running task's future in the scheduler, for every client that holds it."""
    worker = distributed.get_worker()
    client = worker.client
    client.cancel([distributed.Future(worker.get_current_task(), client)], force=True)


def report_every_epoch(ctx: RankContext, config: dict) -> dict:
    """A sweep trainable: the loss falls with epochs, faster with a larger lr; stops when told.
    With `fail_first_attempt`, the gang's first attempt fails before it reports anything; with
    `broken`, every attempt does, as a template's `loss = ...` would."""
    if config.get("fail_first_attempt") and ctx.attempt == 0:
        raise RuntimeError("the first attempt fails, as a lost worker would")
    if config.get("broken"):
        raise TypeError("unsupported operand type(s) for /: 'float' and 'ellipsis'")
    losses = []
    for epoch in range(1, config["epochs"] + 1):
        loss = all_reduce_sum([1.0 / (1.0 + config["lr"] * epoch)])[0] / ctx.world_size
        losses.append(loss)
        if ctx.report(epoch, {"loss": loss}):
            break
    model_url = f"{ctx.output_url}/losses.json"  # each trial has a folder of its own
    if ctx.is_main and config.get("keep_losses", True):
        os.makedirs(ctx.output_url, exist_ok=True)
        with open(model_url, "w") as file:
            json.dump(losses, file)
    return {"losses": losses, "rank": ctx.rank, "model_url": model_url}


def freeze_rank_1(ctx: RankContext, config: dict) -> dict:
    """Steps with a collective each; in the first attempt rank 1's worker process freezes
    (SIGSTOP: alive and silent, as a hung host leaves it) after a few steps, its pid and the
    time left in `config["marks"]`."""
    for step in range(1, config["steps"] + 1):
        all_reduce_sum([1.0])
        ctx.progress("step", epoch=1, step=step)
        ctx.check_stop()
        if ctx.rank == 1 and ctx.attempt == 0 and step == config["freeze_at"]:
            marks = Path(config["marks"])
            (marks / "frozen").write_text(json.dumps({"pid": os.getpid(), "at": time.time()}))
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(0.05)
    return report_rank(ctx, config)


def slow_but_alive(ctx: RankContext, config: dict) -> dict:
    """A slow first step on every rank, then a slow checkpoint on rank 0: silent, not hung."""
    ctx.progress("data")
    time.sleep(config["slow_s"])
    for step in range(1, 4):
        all_reduce_sum([1.0])
        ctx.progress("step", epoch=1, step=step)
        ctx.check_stop()
    ctx.progress("checkpoint", epoch=1)
    if ctx.is_main:
        time.sleep(config["slow_s"])
    return report_rank(ctx, config)


def train_job(ctx: RankContext, config: dict) -> dict:
    """The recipe's own per-rank entry point, on a TrainJob that travelled as a flow parameter."""
    return train_classifier(ctx, TrainJob.model_validate(config))


def loader_then_fail(ctx: RankContext, config: dict) -> dict:
    """Read one batch through a DataLoader with a worker process (forked), then fail, the
    iterator alive in this frame, as a rank whose checkpoint write hit a full disk does."""
    batches = iter(DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=1))
    next(batches)
    raise OSError(errno.ENOSPC, "No space left on device")


def loader_sum(ctx: RankContext, config: dict) -> dict:
    """Sum a small set through a DataLoader with two worker processes (forked), all-reduced."""
    total = sum(float(batch[0].sum()) for batch in DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4,
                                                              num_workers=2))
    return {"sum": all_reduce_sum([total])[0], "children": child_pids()}


KEPT_BLOCKS: list[bytes] = []  # what leave_holes keeps in its worker, for the rest of the session


def leave_holes(ctx: RankContext, config: dict) -> dict:
    """Allocate about 200 MB in 1 kB blocks and keep every 64th, as a worker keeps a few objects
    of every run: the rest is freed as the rank returns, in holes glibc keeps for its thread.
    The thread may have run other tasks before: what they left free in its arena is first
    given back, so that the blocks take new pages and the growth is seen."""
    return_freed_memory()
    before = resident_mb()
    blocks = [bytes(1000 + (i & 1)) for i in range(200_000)]
    peak = resident_mb()
    KEPT_BLOCKS.extend(blocks[::64])
    return {"worker": ctx.worker_address, "before": before, "peak": peak}


def resident_mb() -> int:
    """This process's resident memory (also with `client.run`, on a worker)."""
    return psutil.Process().memory_info().rss >> 20


def child_pids() -> list[int]:
    """The processes this one started that still run (also with `client.run`, on a worker)."""
    return sorted(child.pid for child in psutil.Process().children(recursive=True))


RANK_FUNCTIONS = {"report": report_rank, "loader_then_fail": loader_then_fail, "loader_sum": loader_sum, "leave_holes": leave_holes, "train": train_job, "freeze": freeze_rank_1, "slow": slow_but_alive, "fail": fail_on_rank_1, "kill": kill_worker_on_rank_1,
                  "dies_when_fetched": die_when_fetched_on_rank_1, "slow_to_send": slow_to_send_on_rank_1,
                  "unsendable": unsendable_on_rank_1,
                  "sleep": sleep_past_the_deadline, "asleep_in_c": asleep_in_c, "hold": hold_worker, "loop": loop_until_stopped}


@flow(name="gang-test")
def gang_flow(address: str, fn_name: str, config: dict, world_size: int | None = None, max_restarts: int = 0,
              timeout_s: float | None = None, lease_timeout_s: float = 600, hang_timeout_s: float | None = None,
              hang_floor_s: float | None = None):
    """One gang of RANK_FUNCTIONS[fn_name] on the cluster at `address`; each rank's result."""
    with DaskTaskRunner(address=address) as runner:
        return run_gang(RANK_FUNCTIONS[fn_name], config, task_runner=runner, world_size=world_size,
                        max_restarts=max_restarts, init_timeout=timedelta(seconds=60),
                        timeout=timedelta(seconds=timeout_s) if timeout_s else None,
                        lease_timeout=timedelta(seconds=lease_timeout_s),
                        hang_timeout=timedelta(seconds=hang_timeout_s) if hang_timeout_s else None,
                        hang_floor=timedelta(seconds=hang_floor_s) if hang_floor_s else None)


@flow(name="sweep-test")
def sweep_flow(address: str, marks: str, trials: int, name: str = "sweep", lease_timeout_s: int = 1800) -> dict:
    """`trials` one-rank trials of loop_until_stopped at once, on the cluster at `address`."""
    with DaskTaskRunner(address=address) as runner:
        return sweep(loop_until_stopped, {"marks": marks, "x": 0}, {"x": {"kind": "grid", "values": list(range(trials))}},
                     SweepSettings(name=name, n_trials=trials, concurrency=trials, metric="loss", direction="minimize",
                                   lease_timeout_s=lease_timeout_s),
                     task_runner=runner, output=marks)
